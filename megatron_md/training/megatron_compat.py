"""Megatron-LM's `pretrain_gpt.py` command line, read here: what is accepted without effect, refused, or differs.

megatron_lm_flags.json is a snapshot of Megatron-LM's parser (tools/megatron_lm_flags.py writes it, with the
commit). A flag of that snapshot which megatron_md does not implement stops the run with one line naming it,
before any work; the few that mean nothing here are accepted with a one-line note each. Flags both share keep
Megatron-LM's default except those in DIFFERS, each with its reason (tests/training/test_megatron_compat.py
checks both tables against the snapshot; docs/usage.md lists them).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("megatron_lm_flags.json")

# Accepted and ignored: each means nothing here (the note says why), whatever value it is given.
ACCEPTED = {
    "--use-mcore-models": "megatron-core's GPTModel is the only model megatron_md builds",
    "--use-dist-ckpt": "checkpoints are always megatron-core's dist_checkpointing (torch_dist)",
    "--auto-detect-ckpt-format": "torch_dist is the only checkpoint format",
    "--log-throughput": "tokens/s and TFLOP/s per device are always in the log line and metrics.jsonl",
    "--no-create-attention-mask-in-dataloader": "the loader never builds attention masks (the attention is causal "
                                                "by construction)",
    "--no-mmap-bin-files": "the indexed dataset's .bin files are memory-mapped either way (speed only, same samples)",
    "--tiktoken-pattern": "no TikToken tokenizer here: the pattern has nothing to apply to",
    "--no-position-embedding": "Megatron-LM's deprecated switch; with --position-embedding-type rope it changes "
                               "nothing (and any other type is refused, as Megatron-LM does)",
}
# Accepted only at the value where Megatron-LM behaves as megatron_md always does.
ONLY_AT = {
    "--context-parallel-size": ("1", "context parallelism is not implemented"),
}
# Refused with the way out, where there is one; any other unimplemented flag is refused by name.
REASONS = {
    "--fp16": "fp16 with loss scaling is not implemented: use --bf16",
    "--fp8-format": "FP8 training (Transformer Engine, Hopper GPUs) is not implemented",
    "--step-batch-size-schedule": "use --rampup-batch-size START INCREMENT SAMPLES",
    "--lr-warmup-init": "warmup starts from 0",
    "--use-flash-attn": "use --attention-backend flash",
}
# Shared flags whose default here is not Megatron-LM's, on purpose. (flag -> why); the test compares the rest.
DIFFERS = {
    "--num-layers": "Megatron-LM requires it; 2 here, so a bare `megatron-md train --mock-data` runs",
    "--hidden-size": "Megatron-LM requires it; 64 here, as --num-layers",
    "--seq-length": "Megatron-LM requires it; 1024 here",
    "--micro-batch-size": "Megatron-LM requires it; 1 here",
    "--train-iters": "Megatron-LM requires it or --train-samples; 100 here",
    "--vocab-size": "Megatron-LM takes it from the tokenizer; 131072 (the MD paper's) for mock data here",
    "--lr": "Megatron-LM requires it; 3e-4 here (the MD families' recipes and sweeps set their own)",
    "--num-query-groups": "Megatron-LM applies it only with --group-query-attention; here it always applies, and "
                          "is unset (multi-head attention) by default",
    "--split": "both use 969,30,1 when unset (Megatron-LM fills it in after parsing)",
    "--eval-iters": "4 here, not 100: CPU runs evaluate at the end by default",
    "--log-interval": "10 here, not 100",
    "--exit-signal-handler": "on here (SIGTERM/SIGUSR1 save and exit cleanly: SLURM preemption); --no-exit-signal-"
                             "handler turns it off",
    "--profile-ranks": "unset means rank 0 in both",
    "--no-load-optim": "a plain switch in both (Megatron-LM's parser stores None for off)",
    "--no-load-rng": "as --no-load-optim",
    "--moe-grouped-gemm": "unset means on when Transformer Engine builds the layers (its kernel), off otherwise",
    "--attention-backend": "auto: Transformer Engine's choice with TE layers, torch's sdpa without (Megatron-LM "
                           "always expects TE)",
    "--transformer-impl": "auto: Transformer Engine when it imports, else megatron-core's local layers",
    "--bias-swiglu-fusion": "the fusions are unset (on where the kernel exists: CUDA) rather than on; Megatron-LM's "
                            "--no-bias-swiglu-fusion spelling works here too",
    "--bias-gelu-fusion": "as --bias-swiglu-fusion",
    "--bias-dropout-fusion": "as --bias-swiglu-fusion",
    "--masked-softmax-fusion": "as --bias-swiglu-fusion",
    "--gradient-accumulation-fusion": "as --bias-swiglu-fusion",
    "--cross-entropy-loss-fusion": "unset means on on CUDA, off on CPU",
    "--muon-tp-mode": "auto: duplicated (Megatron-LM's default) for --optimizer muon, layer_sharded for MD and "
                      "Manifold Muon (our engine)",
    "--muon-fp32-matmul-prec": "auto: medium on CUDA (Megatron-LM's default), highest on CPU",
    "--lion-beta1": "the lion_md base's (the Lion paper's 0.9, 0.99); Megatron-LM's are for its own Lion",
    "--lion-beta2": "as --lion-beta1",
    "--moe-layer-freq": "the same 1, kept as text so that a list expression such as '([0]*2+[1]*10)' parses",
}


@lru_cache(maxsize=1)
def snapshot() -> dict:
    """{'commit': ..., 'flags': {dest: {'flags': [...], 'default': ..., 'value': bool}}} of Megatron-LM."""
    return json.loads(SNAPSHOT.read_text())


@lru_cache(maxsize=1)
def _by_flag() -> dict[str, dict]:
    return {f: e for e in snapshot()["flags"].values() for f in e["flags"]}


def megatron_flag(flag: str) -> dict | None:
    """Megatron-LM's entry for ``--flag`` (its option strings, default, whether it takes a value), or None."""
    return _by_flag().get(flag)


def screen(unknown: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """Sort the tokens argparse did not know: ({accepted flag: its note}, refused Megatron-LM flags with their
    reasons, tokens that are not Megatron-LM's either)."""
    notes, refused, foreign = {}, [], []
    i = 0
    while i < len(unknown):
        token = unknown[i]
        name, eq, inline = token.partition("=")
        entry = megatron_flag(name) if name.startswith("--") else None
        takes_value = bool(entry and entry["value"])
        value = inline if eq else None
        if takes_value and not eq:
            values = []
            while i + 1 < len(unknown) and not unknown[i + 1].startswith("--"):
                values.append(unknown[i + 1])
                i += 1
            value = " ".join(values)
        i += 1
        if entry is None:
            foreign.append(token)
        elif name in ACCEPTED:
            notes[name] = f"{name}: accepted, no effect here ({ACCEPTED[name]})"
        elif name in ONLY_AT and value == ONLY_AT[name][0]:
            notes[name] = f"{name} {value}: accepted ({ONLY_AT[name][1]}; {value} is what runs)"
        elif name in ONLY_AT:
            refused.append(f"{name} {value}: {ONLY_AT[name][1]} (only {ONLY_AT[name][0]} is accepted)")
        else:
            refused.append(f"{name}: {REASONS.get(name, 'not implemented in megatron_md')}")
    return notes, refused, foreign


def normalise(cfg, given: set[str], accepted: dict[str, str]) -> list[str]:
    """Megatron-LM's own adjustments after parsing, made the same way here, with a note for each (``given``: the
    settings the command line or --config named; ``accepted``: screen()'s accepted flags). ValueError where
    Megatron-LM refuses."""
    notes = []
    p, m = cfg.parallel, cfg.model
    if "--no-position-embedding" in accepted and m.position_embedding_type != "rope":
        raise ValueError(f"--no-position-embedding with --position-embedding-type {m.position_embedding_type}: "
                         "Megatron-LM refuses it too; say --position-embedding-type none (or rope)")
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        p.sequence_parallel = False
        notes.append("--sequence-parallel: off, since --tensor-model-parallel-size is 1 (as Megatron-LM does)")
    if ("num_query_groups" in given and m.num_query_groups != m.num_attention_heads
            and not m.group_query_attention):
        notes.append(f"--num-query-groups {m.num_query_groups} applies without --group-query-attention here "
                     "(Megatron-LM would ignore it and build multi-head attention)")
    return notes


def markdown(shared: int) -> str:
    """docs/usage.md's tables (tools/render_readme_tables.py, block ``megatron_compat``); ``shared``: how many flags
    keep Megatron-LM's name and default."""
    snap = snapshot()
    row = lambda k, v: f"| `{k}` | {v} |"  # noqa: E731
    return "\n".join([
        f"Against Megatron-LM {snap['commit'][:12]} ({len(snap['flags'])} settings in its parser): "
        f"{shared} flags share its name, meaning and default; every other flag of its parser that "
        "`megatron-md train --help` does not list is refused by name before any work.", "",
        "| accepted, no effect here | why |", "| --- | --- |",
        *[row(k, v) for k, v in ACCEPTED.items()],
        *[row(f"{k} {v[0]}", f"only this value: {v[1]}") for k, v in ONLY_AT.items()], "",
        "| refused, with the way out | |", "| --- | --- |", *[row(k, v) for k, v in REASONS.items()], "",
        "| differs on purpose | how and why |", "| --- | --- |", *[row(k, v) for k, v in DIFFERS.items()],
    ])


def shared_defaults(fields: dict, flag) -> tuple[dict, dict]:
    """({our flag: (our default, Megatron-LM's)} for every flag both define, the subset whose defaults differ).
    ``fields``: the run config's {name: (section, Field)}; ``flag``: name -> --flag."""
    snap = snapshot()["flags"]
    shared, differing = {}, {}
    for name, (_, f) in fields.items():
        entry = snap.get(name) or megatron_flag(flag(name))  # the same destination first, else the flag
        if entry is None:
            continue
        dest = next(d for d, e in snap.items() if e is entry)
        # a switch both spell the same way is off unless given; Megatron-LM stores some under another name
        theirs = entry["default"] if dest == name else (False if not entry["value"] else entry["default"])
        shared[flag(name)] = (f.default, theirs)
        if f.default != theirs:
            differing[flag(name)] = (f.default, theirs)
    return shared, differing
