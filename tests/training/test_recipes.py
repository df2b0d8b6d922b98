"""Every shipped recipe survives its first checkpoint: examples/**/*.yaml, shrunk to a tiny width on 2 gloo
ranks with the recipe's optimizer, precision and parallel layout, trains 2 steps, saves, resumes and takes 2
more steps bit-identically to a straight 4-step run.

Shrinking (``shrunk_args``): 2 layers, hidden 64 (head dim 16, the recipe's GQA ratio), FFN 128, MoE 4
experts of width 32 (top-k at most 2), vocab 1024, sequence 32, micro-batch 1, global batch 2, mock data;
warmup (if any) 1 step, 4 iterations. Kept: the optimizer and all its settings (geometry, manifold mode,
MD options), --bf16, --use-distributed-optimizer, the MD paper architecture options, and the kind of
parallelism: TP/PP/EP above 2 become 2 (a recipe with EP8 runs EP2), everything runs on 2 ranks (DP fills the
rest).

Cost: a 2-rank run through the CLI is mostly start-up (~15 s here; ~2 s in the suite's pooled worlds), and there
are ~25 recipes x 2 runs. Recipes whose shrunk settings are the same (``setting``: optimizer + manifold mode,
precision, distributed optimizer, layout, model kind) are trained once, by one representative;
``test_recipe_maps_to_a_tested_setting`` checks every file maps onto a setting whose representative runs in the
default suite, and prints the mapping. The other files train too under ``-m slow`` (``make test-slow``).

Two runs, not three: the straight run's own save at step 2 is the checkpoint the resumed run starts from (its save
at step 4 removed, as if the job had stopped right after step 2); --exit-interval's stop and save are tested in
tests/training/checkpoints/test_resume.py. Why 4 steps and not 3: the step-3 loss only sees the weights of step 2
(the checkpoint's model); the optimizer state saved beside them (momentum, Adam moments, MD gains, manifold duals,
the scheduler) first shows in the step-4 loss and the final evaluation.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from megatron_md.training.config import resolve
from megatron_md.training.validate import validate_config
from mdtest import QUIET, REPO, eval_records, run_cli, train_records

pytestmark = pytest.mark.multirank

# A glob, so a new example cannot ship without this test covering it.
RECIPES = sorted((REPO / "examples").rglob("*.yaml"))
WORLD = 2
ITERS, EXIT = 4, 2

# Where a setting holds several files, its representative is the first in sorted order, unless one of these
# is among them: the two manifold groups differ only by geometry, and between these two the representatives
# exercise Stiefel (both modes), DGram and MD state (fast mode keeps the dual warm starts in the checkpoint).
PREFERRED = ("manifold_paper/gpt2-small_hetero-md.yaml", "manifold_paper/tiny-gpt2_hetero_cpu.yaml")


def _rel(path: Path) -> str:
    return path.relative_to(REPO / "examples").as_posix()


def _cap(n: int) -> int:
    return min(n, WORLD)


def shrunk_args(path: Path) -> list[str]:
    """The recipe at a tiny width on 2 ranks: its optimizer, precision and parallel kinds, nothing large."""
    cfg = resolve(None, str(path), {})
    m, p, o = cfg.model, cfg.parallel, cfg.optimizer
    tp, pp, ep = _cap(p.tensor_model_parallel_size), _cap(p.pipeline_model_parallel_size), _cap(
        p.expert_model_parallel_size)
    assert tp * pp <= WORLD, f"{_rel(path)}: TP{tp} x PP{pp} does not fit on {WORLD} ranks; extend shrunk_args"
    args = [
        "--config", str(path), "--nproc-per-node", str(WORLD),
        "--num-layers", "2", "--hidden-size", "64", "--kv-channels", "16", "--ffn-hidden-size", "128",
        "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "1024", "--mock-data",
        "--micro-batch-size", "1", "--global-batch-size", "2",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--expert-model-parallel-size", str(ep),
        "--train-iters", str(ITERS), "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1",
        *QUIET,
    ]
    if m.num_experts:
        args += ["--num-experts", "4", "--moe-router-topk", str(min(m.moe_router_topk, 2)),
                 "--moe-ffn-hidden-size", "32"]
        if tp > 1 and ep > 1:
            args += ["--expert-tensor-parallel-size", "1"]  # EP2 x ETP2 would need 4 ranks
    if o.lr_warmup_iters:
        args += ["--lr-warmup-iters", "1"]
    if o.lr_decay_iters:
        args += ["--lr-decay-iters", str(ITERS)]
    if o.lr_wsd_decay_iters:
        args += ["--lr-wsd-decay-iters", "2"]
    return args


def setting(path: Path) -> tuple:
    """What decides whether two recipes checkpoint the same way once shrunk."""
    cfg = resolve(None, str(path), {})
    m, p, t, o = cfg.model, cfg.parallel, cfg.training, cfg.optimizer
    optimizer = o.optimizer + (f"/{o.manifold.manifold_mode}" if o.optimizer == "manifold_muon" else "")
    layout = f"TP{_cap(p.tensor_model_parallel_size)}-PP{_cap(p.pipeline_model_parallel_size)}-" \
             f"EP{_cap(p.expert_model_parallel_size)}"
    kind = ("moe" if m.num_experts else "dense", m.normalization, m.position_embedding_type,
            "untied" if m.untie_embeddings_and_output_weights else "tied")
    return (optimizer, "bf16" if t.bf16 else "fp32", "distopt" if p.use_distributed_optimizer else "-", layout,
            "/".join(kind))


def _groups() -> dict[tuple, list[Path]]:
    groups: dict[tuple, list[Path]] = defaultdict(list)
    for path in RECIPES:
        groups[setting(path)].append(path)
    return groups


GROUPS = _groups()
REPRESENTATIVE = {
    key: next((f for f in files if _rel(f) in PREFERRED), files[0]) for key, files in GROUPS.items()
}
TESTED = set(REPRESENTATIVE.values())


def _mapping() -> str:
    lines = []
    for key, files in sorted(GROUPS.items()):
        rep = REPRESENTATIVE[key]
        lines.append(f"{' '.join(key)}  <- runs {_rel(rep)}")
        lines += [f"    {_rel(f)}" for f in files if f != rep]
    return "\n".join(lines)


E2E = "md_paper/moe-6.7b_muon_md.yaml"  # through the real CLI and torchrun (make test-all)


def _param(path: Path):
    marks = () if path in TESTED else (pytest.mark.slow,)
    return pytest.param(path, id=_rel(path), marks=(*marks, pytest.mark.e2e) if _rel(path) == E2E else marks)


def test_recipes_are_found():
    assert len(RECIPES) >= 20 and any(_rel(p).startswith("md_paper/") for p in RECIPES)
    assert set(PREFERRED) <= {_rel(p) for p in RECIPES}, "a preferred representative was renamed"
    print("\nrecipe settings (setting <- representative, then the files it stands for):\n" + _mapping())


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_recipe_maps_to_a_tested_setting(path, tmp_path):
    """Each file's shrunk run is valid on 2 ranks, keeps the recipe's kinds, and its setting is trained."""
    key = setting(path)
    rep = REPRESENTATIVE[key]
    print(f"\n{_rel(path)} -> {' '.join(key)} (trained by {_rel(rep)})")
    recipe = resolve(None, str(path), {})
    shrunk = _shrunk_config(path, "--save", str(tmp_path / "ck"))
    validate_config(shrunk, WORLD)
    # The representative's shrunk run has what decides the checkpoint path: same optimizer, precision, layout.
    trained = _shrunk_config(rep, "--save", str(tmp_path / "ck"))
    assert _checkpoint_kind(shrunk) == _checkpoint_kind(trained)
    assert shrunk.optimizer == _with(recipe.optimizer, shrunk.optimizer, "lr_warmup_iters", "lr_decay_iters",
                                     "lr_wsd_decay_iters")
    assert shrunk.training.bf16 == recipe.training.bf16
    assert shrunk.parallel.use_distributed_optimizer == recipe.parallel.use_distributed_optimizer
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        assert getattr(shrunk.parallel, name) == _cap(getattr(recipe.parallel, name)), name
    assert bool(shrunk.model.num_experts) == bool(recipe.model.num_experts)
    for name in ("sandwich_norm", "layer_scale", "embedding_scale", "normalization", "position_embedding_type",
                 "untie_embeddings_and_output_weights", "moe_token_dispatcher_type", "moe_grouped_gemm"):
        assert getattr(shrunk.model, name) == getattr(recipe.model, name), name
    assert shrunk.model.hidden_size == 64 and shrunk.model.num_layers == 2


def _checkpoint_kind(cfg) -> tuple:
    o, p, m = cfg.optimizer, cfg.parallel, cfg.model
    return (o.optimizer, o.manifold.manifold_mode if o.optimizer == "manifold_muon" else None, cfg.training.bf16,
            p.use_distributed_optimizer, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
            p.expert_model_parallel_size, m.num_experts, m.normalization, m.position_embedding_type,
            m.untie_embeddings_and_output_weights, m.hidden_size, m.num_layers, m.num_attention_heads,
            m.num_query_groups, m.vocab_size, m.seq_length)


def _with(recipe_section, shrunk_section, *names):
    """``recipe_section`` with ``names`` taken from ``shrunk_section`` (the fields shrinking may change)."""
    return dataclasses.replace(recipe_section, **{n: getattr(shrunk_section, n) for n in names})


def _shrunk_config(path: Path, *extra: str):
    """The config ``megatron-md train`` resolves from the shrunk command line (the CLI's own parser)."""
    from megatron_md.training.arguments import train_parser

    values = vars(train_parser().parse_args([*shrunk_args(path), *extra]))
    return resolve(None, values.pop("config"), values)


def _losses(run_dir: Path, key: str = "lm_loss") -> list:
    return [r[key] for r in train_records(run_dir)]


@pytest.mark.parametrize("path", [_param(p) for p in RECIPES])
def test_recipe_resumes_bit_identically(path, tmp_path):
    """A straight 4-step run that saves at step 2, then the requeued job from that save (``--load`` and ``--save`` the
    same directory, as a job preempted right after it saved): steps 3-4 and the final eval equal the straight run's,
    and the resumed run saves again. The MoE recipe E2E runs through the real CLI and torchrun (e2e)."""
    args = shrunk_args(path)
    straight, resumed, ck = (tmp_path / n for n in ("straight", "resumed", "ck"))
    run_cli(["train", *args, "--save", str(ck), "--save-interval", str(EXIT), "--run-dir", str(straight)])
    assert (ck / f"iter_{EXIT:07d}").is_dir() and (ck / f"iter_{ITERS:07d}").is_dir()
    shutil.rmtree(ck / f"iter_{ITERS:07d}")  # the job stopped after its save at EXIT
    (ck / "latest_checkpointed_iteration.txt").write_text(f"{EXIT}\n")
    proc = run_cli(["train", *args, "--load", str(ck), "--save", str(ck), "--run-dir", str(resumed)], check=False)

    assert [r["iteration"] for r in train_records(straight)] == list(range(1, ITERS + 1))
    assert [r["iteration"] for r in train_records(resumed)] == list(range(EXIT + 1, ITERS + 1)), proc.stderr[-6000:]
    for key in ("lm_loss", "grad_norm", "lr"):
        assert _losses(resumed, key) == _losses(straight, key)[EXIT:], key  # bit-identical
    assert eval_records(resumed)[-1]["eval_lm_loss"] == eval_records(straight)[-1]["eval_lm_loss"]
    # ... and a resumed run can checkpoint again (its next save is the one a requeued job relies on).
    assert proc.returncode == 0, f"the resumed run trained identically but exited {proc.returncode}:\n" \
        f"{proc.stderr[-6000:]}"
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
