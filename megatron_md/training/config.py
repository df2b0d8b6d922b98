"""Typed run configuration: dataclasses that generate Megatron-named flags and read YAML.

Precedence when resolving a run: dataclass defaults < ``--model`` preset < ``--config`` YAML
< command-line flags. Every field ``foo_bar`` is the flag ``--foo-bar``; booleans also get
``--no-foo-bar``. The field's ``help`` metadata is the flag's help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from megatron_md.config_files import EXAMPLES_DIR, find_config, load_yaml  # noqa: F401 (re-exported)
from megatron_md.fields import RANGES, opt
from megatron_md.mcore.families import FAMILIES, descriptions
from megatron_md.mcore.family_configs import SECTIONS as OPTIMIZER_SECTIONS
from megatron_md.training.model_config import ModelConfig, derive_sizes  # noqa: F401 (re-exported)



def range_errors(cfg) -> list[str]:
    """One line per numeric setting outside its field's declared range (unset optional values pass)."""
    errors = []
    for name, (section, f) in FIELDS.items():
        valid, value = f.metadata.get("valid"), getattr(section_of(cfg, section), name)
        if valid is None or value is None:
            continue
        ok, says = RANGES[valid]
        if not ok(value):
            errors.append(f"{flag(name)} {says}, got {value}")
    return errors


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "Tensor parallel size (TP).", valid=">=1")
    pipeline_model_parallel_size: int = opt(1, "Pipeline stages (PP).", valid=">=1")
    expert_model_parallel_size: int = opt(1, "Expert parallel size (EP).", valid=">=1")
    expert_tensor_parallel_size: Optional[int] = opt(None, "TP inside experts (default: TP).", valid=">=1")
    sequence_parallel: bool = opt(False, "Sequence parallelism (needs TP>1; required by MoE+TP).")
    use_distributed_optimizer: bool = opt(False, "Shard optimizer state over data parallel.")
    overlap_grad_reduce: bool = opt(
        False, "Reduce (reduce-scatter with the distributed optimizer) each gradient bucket as soon as its "
        "backward finishes, overlapping communication with the rest of the backward pass.")
    overlap_param_gather: bool = opt(
        False, "Distributed optimizer: all-gather each bucket's updated parameters during the next forward "
        "pass, just before its layers need them (needs --use-distributed-optimizer and --overlap-grad-reduce).")
    grad_reduce_in_bf16: bool = opt(
        False, "With --bf16: reduce (and accumulate) gradients in bf16 rather than fp32 (half the communication).")
    ddp_bucket_size: Optional[int] = opt(
        None, "Elements per gradient-communication bucket (unset: megatron's default, max(40M, 1M x DP) with "
        "overlap; one bucket per buffer without).", valid=">=1")


@dataclass
class SharedOptimConfig:
    """Settings every optimizer shares (the LR schedule, clipping, the AdamW of 1-D parameters)."""

    optimizer: str = opt(  # choices and help read the registry when the flags are made: --plugin ones included
        "adam", lambda: "Optimizer: " + "; ".join(f"{n}: {d}" for n, d in descriptions().items()) + ".",
        FAMILIES.keys(),
    )
    lr: float = opt(3e-4, "Peak learning rate (1-D params and LM head; all params for adam/muon).", valid=">0")
    min_lr: float = opt(0.0, "Final learning rate.", valid=">=0")
    lr_decay_style: str = opt(
        "linear", "LR schedule after warmup.", ["constant", "linear", "cosine", "WSD"]
    )
    lr_warmup_iters: int = opt(0, "Linear warmup iterations (0 allowed).", valid=">=0")
    lr_warmup_fraction: Optional[float] = opt(
        None, "Warmup as a fraction of the decay horizon (instead of --lr-warmup-iters/-samples).", valid="[0,1]")
    lr_decay_iters: Optional[int] = opt(None, "Decay horizon (default: train-iters).", valid=">=1")
    lr_warmup_samples: int = opt(0, "With --train-samples: linear warmup over this many samples.", valid=">=0")
    lr_decay_samples: Optional[int] = opt(
        None, "With --train-samples: the decay horizon in samples (default: train-samples).", valid=">=1")
    decoupled_lr: Optional[float] = opt(
        None, "Peak LR of the input embedding and the output layer (megatron-core's decoupled LR; --optimizer "
        "adam).", valid=">0")
    decoupled_min_lr: Optional[float] = opt(None, "Final LR with --decoupled-lr (default --min-lr).", valid=">=0")
    lr_wsd_decay_iters: Optional[int] = opt(None, "WSD: final decay iterations.", valid=">=1")
    lr_wsd_decay_style: str = opt("exponential", "WSD decay shape.", ["linear", "cosine", "exponential"])
    weight_decay: float = opt(0.01, "Decoupled weight decay.", valid=">=0")
    clip_grad: float = opt(1.0, "Global gradient-norm clip (0 disables).", valid=">=0")
    adam_beta1: float = opt(0.9, "Adam beta1.", valid="[0,1)")
    adam_beta2: float = opt(0.999, "Adam beta2 (MD and Manifold Muon: 0.95 by their recipes).", valid="[0,1)")
    adam_eps: float = opt(1e-8, "Adam epsilon.", valid=">0")
    qk_clip: bool = opt(
        False, "QK-clip (MuonClip): after each step, every layer whose largest pre-softmax attention logit exceeded "
        "--qk-clip-threshold has its query/key scale brought back to it (docs/qk_clip.md: which weights, per "
        "optimizer).")
    qk_clip_threshold: float = opt(100.0, "QK-clip: the largest attention logit a head keeps (τ).", valid=">0")
    qk_clip_alpha: float = opt(
        0.5, "QK-clip: the queries take η^α of the factor η = τ/max, the keys η^(1-α).", valid="[0,1]")


# OptimConfig: the shared settings plus one typed section per family (``cfg.optimizer.md.md_sphere``); a new
# family adds its section in mcore/family_configs.py, not here.
OptimConfig = dataclasses.make_dataclass(
    "OptimConfig", [(name, klass, field(default_factory=klass)) for name, klass in OPTIMIZER_SECTIONS.items()],
    bases=(SharedOptimConfig,))
OptimConfig.__module__ = __name__


@dataclass
class TrainingConfig:
    plugin: Optional[list[str]] = opt(
        None, "Python modules imported before any other flag is read, e.g. an optimizer of your own that registers "
        "itself (megatron_md/plugins.py); each launched rank imports them too.", nargs="+")
    micro_batch_size: int = opt(1, "Sequences per micro-batch per data-parallel rank.", valid=">=1")
    global_batch_size: Optional[int] = opt(None, "Sequences per step (default: micro x DP).", valid=">=1")
    train_iters: int = opt(100, "Optimizer steps (0 with --save writes a seed checkpoint).", valid=">=0")
    train_samples: Optional[int] = opt(
        None, "Train for this many samples instead of --train-iters (samples // global batch steps); the LR "
        "schedule then counts samples (--lr-warmup-samples, --lr-decay-samples).", valid=">=1")
    eval_interval: Optional[int] = opt(None, "Evaluate every N steps (unset: only at the end).", valid=">=1")
    eval_iters: int = opt(4, "Validation batches per evaluation.", valid=">=0")
    seed: int = opt(1234, "Random seed.", valid=">=0")
    bf16: bool = opt(False, "bf16 parameters with fp32 master weights.")
    device: str = opt("auto", "cuda, cpu, or auto (cpu when CUDA is absent).", ["auto", "cuda", "cpu"])
    max_consecutive_skips: int = opt(
        10, "Stop after this many consecutive steps skipped for non-finite loss or gradient.", valid=">=1"
    )
    inject_nan_at: Optional[int] = opt(None, "Testing aid: make the loss NaN from this iteration on.", valid=">=1")
    inject_nan_iters: int = opt(1, "Testing aid: for this many iterations.", valid=">=1")
    nproc_per_node: int = opt(1, "Processes to launch on this node (torch elastic) when >1.", valid=">=1")
    exit_interval: Optional[int] = opt(None, "Stop cleanly (with a save) after this iteration.", valid=">=1")
    exit_signal_handler: bool = opt(
        True, "On SIGTERM or SIGUSR1 every rank finishes the step, saves (--save) and exits 0 (preemption).")
    exit_duration_in_mins: Optional[float] = opt(
        None, "Stop cleanly (with a save) after the step during which this many minutes since start-up "
        "passed; set it a checkpoint's write time below the job's time limit.", valid=">0")
    rampup_batch_size: Optional[list[str]] = opt(
        None, "Batch-size ramp-up 'START INCREMENT SAMPLES': begin at START sequences per step and grow by "
        "INCREMENT over the first SAMPLES samples up to --global-batch-size (megatron-core's calculator).",
        nargs=3)
    profile: bool = opt(False, "Record a torch profiler trace (CPU and CUDA activity) into <run-dir>/profile.")
    profile_step_start: int = opt(10, "--profile: first step recorded.", valid=">=1")
    profile_step_end: int = opt(12, "--profile: step after the last one recorded.", valid=">=1")
    profile_ranks: Optional[list[str]] = opt(None, "--profile: global ranks that record a trace (default 0).", nargs="+")
    # Megatron-LM's process knobs (training/housekeeping.py)
    manual_gc: bool = opt(False, "Python's automatic garbage collection off; collect every --manual-gc-interval "
                                 "steps and around evaluations instead (no rank pauses mid-step).")
    manual_gc_interval: int = opt(0, "--manual-gc: collect every N steps (0: never between steps).", valid=">=0")
    manual_gc_eval: bool = opt(True, "--manual-gc: collect before and after each evaluation.")
    empty_unused_memory_level: int = opt(
        0, "Return the CUDA allocator's unused cache: 1 after each forward-backward, 2 after the optimizer step "
        "too (0: never; at most 2).", valid=">=0")
    deterministic_mode: bool = opt(False, "torch's deterministic algorithms (and megatron-core's deterministic_mode).")
    calculate_per_token_loss: bool = opt(
        False, "Weight every token of the global batch equally: the gradient is the sum over tokens divided by "
        "the batch's token count, not a mean of per-micro-batch means (they differ when micro-batches hold "
        "different numbers of loss tokens).")
    distributed_timeout_minutes: float = opt(
        10.0, "Timeout of the process groups' collectives, in minutes.", valid=">0")


@dataclass
class DataConfig:
    data_path: Optional[list[str]] = opt(
        None, "Indexed dataset prefix, or a blend 'W1 P1 W2 P2 ...'.", nargs="+"
    )
    split: str = opt("969,30,1", "Train,valid,test proportions.")
    train_data_path: Optional[list[str]] = opt(
        None, "The training split's prefix or blend, instead of --data-path and --split.", nargs="+")
    valid_data_path: Optional[list[str]] = opt(
        None, "The validation split's prefix or blend (with --train-data-path; unset: no validation).", nargs="+")
    test_data_path: Optional[list[str]] = opt(
        None, "The test split's prefix or blend (with --train-data-path).", nargs="+")
    num_workers: int = opt(
        2, "DataLoader worker processes reading and collating samples ahead of the step (0: in the trainer's "
        "process). Only the first rank of each tensor-parallel group reads; it broadcasts to the others.",
        valid=">=0")
    eod_mask_loss: bool = opt(False, "No loss on end-of-document tokens.")
    reset_position_ids: bool = opt(False, "Positions restart at 0 after each end-of-document token.")
    reset_attention_mask: bool = opt(
        False, "Tokens attend only within their own document (a per-sample attention mask, s x s).")
    eval_same_batches: bool = opt(
        False, "Every evaluation reads the same first --eval-iters global batches of the validation split "
        "(comparable across evaluations). Default: as Megatron-LM, each evaluation moves on through the split.")
    mock_data: bool = opt(False, "Random tokens instead of a dataset.")
    tokenizer_type: Optional[str] = opt(
        None, "Tokenizer (unset: from the files: --vocab-file/--merge-file are GPT2BPETokenizer, a directory "
        "or .json --tokenizer-model HuggingFaceTokenizer, any other file SentencePieceTokenizer).",
        ["SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer"],
    )
    tokenizer_model: Optional[str] = opt(
        None, "SentencePiece .model, Hugging Face tokenizer.json, or a local Hugging Face tokenizer directory."
    )
    vocab_file: Optional[str] = opt(None, "GPT2BPETokenizer: the vocab.json.")
    merge_file: Optional[str] = opt(None, "GPT2BPETokenizer: the merges.txt.")
    data_cache_path: Optional[str] = opt(None, "Where GPTDataset caches its indices.")


@dataclass
class CheckpointConfig:
    save: Optional[str] = opt(None, "Checkpoint directory to write.")
    load: Optional[str] = opt(None, "Checkpoint directory to resume from.")
    save_interval: Optional[int] = opt(
        None, "Save every N steps (and always at the end, with --save); 0: never periodically, as Megatron-LM.",
        valid=">=0")
    pretrained_checkpoint: Optional[str] = opt(
        None, "Start from these model weights (no optimizer, iteration 0), e.g. a seed checkpoint."
    )
    no_load_optim: bool = opt(False, "Resume weights but not optimizer state.")
    no_load_rng: bool = opt(False, "Do not restore RNG states.")
    no_verify_checkpoint: bool = opt(
        False, "Load without checking the checkpoint's files against the sizes and checksums in its "
        "checksums.json (written at save; a mismatch otherwise stops the load before anything is read)."
    )
    ckpt_format: str = opt("torch_dist", "Checkpoint format.", ["torch_dist"])
    async_save: bool = opt(
        False, "Write checkpoints in a background process: training resumes once the tensors are copied to "
        "host memory; the checkpoint is published (checksums, latest file) when the write finishes.")
    ckpt_fully_parallel_save: bool = opt(
        True, "Split the writing of replicated tensors across data-parallel ranks instead of DP rank 0 "
        "writing them all (megatron's FullyParallelSaveStrategyWrapper).")
    ckpt_fully_parallel_load: bool = opt(
        False, "Each data-parallel rank reads a share of the checkpoint and the ranks exchange it "
        "(megatron's FullyParallelLoadStrategyWrapper), instead of every rank reading all it needs.")
    keep_last_n_checkpoints: Optional[int] = opt(
        None, "After each successful save, delete all but the newest N checkpoints under --save (unset: "
        "keep all). The newest verified checkpoint is never deleted.", valid=">=1")
    dist_ckpt_optim_fully_reshardable: bool = opt(
        False, "Save the distributed Adam state (--optimizer adam --use-distributed-optimizer) in megatron's "
        "'fully_reshardable' format: gathered on DP rank 0 at save, loadable at any TP/PP/EP/DP layout. "
        "The default 'dp_reshardable' format saves every rank's shard in parallel and reshards across DP only."
    )


@dataclass
class LoggingConfig:
    log_interval: int = opt(10, "Steps between log lines and metrics.jsonl records.", valid=">=1")
    run_dir: Optional[str] = opt(None, "Run directory (default runs/<time>-<model>).")
    tensorboard_dir: Optional[str] = opt(None, "TensorBoard dir (default <run-dir>/tensorboard).")
    wandb_project: Optional[str] = opt(None, "W&B project (else WANDB_PROJECT); a project means online unless a mode says otherwise.")
    wandb_exp_name: Optional[str] = opt(None, "W&B run name (else WANDB_NAME, else the run directory's name).")
    wandb_save_dir: Optional[str] = opt(None, "W&B files (else WANDB_DIR, else <run-dir>).")
    wandb_mode: Optional[str] = opt(
        None, "W&B mode (else WANDB_MODE; else online with a project, offline without).", ["offline", "online", "disabled"]
    )
    progress_bar: Optional[bool] = opt(None, "Show a progress bar (default: when stderr is a tty).")
    log_max_logit: bool = opt(
        True, "Log the largest attention logit (max_logit, max_logit/L<i>) on logged steps; measured every step "
        "with --qk-clip. --no-log-max-logit turns it off without --qk-clip (docs/qk_clip.md gives its cost).")
    timing_log_level: int = opt(
        0, "megatron-core's timers: 0 none beyond the iteration time (nothing added to a step), 1 the step's phases "
        "(forward-backward, gradient sync, optimizer, QK-clip), 2 also forward/backward compute, pipeline "
        "send/recv, the data wait (batch-generator) and the MD, Newton-Schulz-engine and Manifold Muon phases. "
        "Timers synchronise the device at each start and stop.", valid=">=0")
    timing_log_option: str = opt(
        "minmax", "Timers over ranks in the log: the slowest (max), the fastest and slowest (minmax), or every "
        "rank (all); metrics.jsonl, TensorBoard and W&B get the slowest.", ["max", "minmax", "all"])
    diagnostics_interval: int = opt(
        100, "Every N steps log per-matrix σ_max/σ_min/‖Off(WᵀW)‖/‖W‖, MD gains, attention max logit "
        "and entropy (0: off; rounded up to a multiple of --log-interval).", valid=">=0"
    )
    log_update_norms: bool = opt(
        False, "With --diagnostics-interval, also log each hidden matrix's relative update over the diagnostics "
        "step, ‖W_t − W_{t−1}‖_F/‖W_{t−1}‖_F (diag/<matrix>/rel_update): which matrices an LR moves most. Holds "
        "one copy of the hidden matrices, in their own dtype, through that one step.")


@dataclass
class TargetConfig:
    """The hardware a run is sized for. ``megatron-md plan`` reads it (a recipe's fit is tested against it);
    the trainer only records it with the config and never acts on it."""

    target_device: Optional[str] = opt(
        None, "The device this run is sized for, read by `megatron-md plan` only (the trainer ignores it): a name "
        "such as H100-80GB, H200, A100-40GB (case-insensitive; `megatron-md plan --list-devices`) or cpu.")
    target_device_memory: Optional[str] = opt(
        None, "Memory of one target device, with a unit (79GiB, 81082MiB, 80GB); default: the named device's "
        "total as CUDA reports it. Needed for cpu (host memory per rank).")
    target_world_size: Optional[int] = opt(
        None, "Devices the run is sized for (GPUs, or CPU ranks): `megatron-md plan`'s default --world-size.", valid=">=1")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "target": TargetConfig,
}


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimConfig = field(default_factory=OptimConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    preset: Optional[str] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        cfg = cls(preset=d.get("preset"))
        apply_overrides(cfg, {k: v for k, v in d.items() if k != "preset"}, source="dict")
        return cfg


# ----------------------------------------------------------------------------- field index

def _nested(klass) -> dict[str, type]:
    """The fields of ``klass`` that are sections themselves (OptimConfig's family sections)."""
    return {f.name: f.default_factory for f in dataclasses.fields(klass)
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}


def section_classes() -> list[tuple[str, type]]:
    """Every section of the run config as (path, class), nested ones as "optimizer.manifold", in --help order."""
    out = []
    for name, klass in SECTIONS.items():
        out.append((name, klass))
        out += [(f"{name}.{sub}", k) for sub, k in _nested(klass).items()]
    return out


def knobs(klass) -> list[dataclasses.Field]:
    """The fields of a section that are settings (one flag each), without its nested sections."""
    nested = _nested(klass)
    return [f for f in dataclasses.fields(klass) if f.name not in nested]


def section_of(cfg, path: str):
    """The section object at ``path`` ("optimizer.manifold") of a RunConfig."""
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def setting(cfg, name: str):
    """The value of the setting ``name`` (a field / flag name) wherever its section sits."""
    return getattr(section_of(cfg, FIELDS[name][0]), name)


_SECTION_NAMES = {path.rsplit(".", 1)[-1] for path, _ in section_classes()}


def _field_index() -> dict[str, tuple[str, dataclasses.Field]]:
    index = {}
    for section, klass in section_classes():
        for f in knobs(klass):
            assert f.name not in index, f"duplicate config field {f.name}"
            assert f.name not in _SECTION_NAMES - {"optimizer"}, f"field {f.name} shadows a section"
            index[f.name] = (section, f)
    return index


FIELDS = _field_index()


def _base_type(tp) -> type:
    if isinstance(tp, str):
        tp = eval(tp, {"Optional": Optional, "list": list})  # noqa: S307 (our own annotations)
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin is list:
        return list
    return tp


def _coerce(name: str, value: Any, source: str) -> Any:
    _, f = FIELDS[name]
    if value is None:
        return None
    base = _base_type(f.type)
    try:
        if base is bool:
            if isinstance(value, str):
                if value.lower() in ("true", "1", "yes"):
                    return True
                if value.lower() in ("false", "0", "no"):
                    return False
                raise ValueError(value)
            return bool(value)
        if base is list:
            return [str(v) for v in (value.split() if isinstance(value, str) else value)]
        if base is int and isinstance(value, float) and value != int(value):
            raise ValueError(value)
        value = base(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{source}: {flag(name)} expects {base.__name__}, got {value!r}"
        ) from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{source}: {flag(name)} must be one of {choices}, got {value!r}")
    return value


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def apply_overrides(cfg: RunConfig, overrides: dict, source: str) -> None:
    """Set fields from a flat {field: value} or sectioned {section: {field: value}} mapping (sections nest:
    {optimizer: {md: {md_sphere: row}}}; flat names work at any level)."""
    for key, value in overrides.items():
        if key in _SECTION_NAMES and isinstance(value, dict):
            apply_overrides(cfg, value, source)
            continue
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise ValueError(f"{source}: unknown setting {key!r} (no flag {flag(name)})")
        section, _ = FIELDS[name]
        setattr(section_of(cfg, section), name, _coerce(name, value, source))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field; defaults are SUPPRESS so we know what the user typed."""
    for section, klass in section_classes():
        group = parser.add_argument_group(section)
        for f in knobs(klass):
            base = _base_type(f.type)
            default = f.default
            help_text = f.metadata.get("help", "")
            help_text = help_text() if callable(help_text) else help_text  # e.g. --optimizer's, plugins included
            if default not in (None, dataclasses.MISSING):
                help_text += f" [default: {default}]"
            if base is bool and f.name.startswith("no_"):
                # BooleanOptionalAction reads any "--no-..." spelling as False, so --no-load-optim would
                # turn the option off; these negative-named switches are plain store_true flags.
                group.add_argument(flag(f.name), dest=f.name, action="store_true", default=argparse.SUPPRESS,
                                   help=help_text)
            elif base is bool:
                group.add_argument(
                    flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS, help=help_text,
                )
            else:
                group.add_argument(
                    flag(f.name), dest=f.name, default=argparse.SUPPRESS,
                    type=str if base is list else base, help=help_text,
                    choices=f.metadata.get("choices"), nargs=f.metadata.get("nargs"),
                )


def resolve(preset: Optional[str], yaml_path: Optional[str], cli: dict, sources: Optional[dict] = None) -> RunConfig:
    """Build a RunConfig from preset, YAML and CLI values, then derive dependent sizes. ``sources``, when given,
    receives {field: where its value came from} for every field not left at its default."""
    from megatron_md.models.presets import get_preset

    file_values = load_yaml(yaml_path) if yaml_path else {}
    preset = cli.pop("model", None) or preset or file_values.pop("preset", None)
    file_values.pop("preset", None)
    cfg = RunConfig(preset=preset)
    src = sources if sources is not None else {}
    if preset:
        apply_overrides(cfg, get_preset(preset), f"preset {preset}")
        src.update(dict.fromkeys(get_preset(preset), f"preset {preset}"))
    apply_overrides(cfg, file_values, f"--config {yaml_path}")
    explicit = set(cli) | _keys(file_values)
    src.update(dict.fromkeys(_keys(file_values), f"--config {yaml_path}"))
    name = cli.get("optimizer") or cfg.optimizer.optimizer
    family = FAMILIES.get(name)
    recipe = family.recipe_for(cli.get("geometry") or cfg.optimizer.manifold.geometry) if family else {}
    for k, v in recipe.items():  # the family's recipe, unless set explicitly
        if k not in explicit:
            apply_overrides(cfg, {k: v}, f"{name} recipe")
            src[k] = f"{name} recipe"
    apply_overrides(cfg, cli, "command line")
    src.update(dict.fromkeys(cli, "command line"))
    if {"train_samples", "train_iters"} <= set(cli) and cli["train_samples"] is not None:
        # (only as typed: a saved run_config.yaml holds both, and its train_iters is re-derived at validation)
        raise ValueError("--train-samples and --train-iters: give one (the steps are train-samples // global batch)")
    derive_sizes(cfg.model, explicit)
    return cfg


def describe_sources(sources: dict) -> list[str]:
    """One line per preset or recipe that set fields (the rest are Megatron-LM's defaults or what was typed)."""
    by: dict[str, list[str]] = {}
    for k, where in sources.items():
        if where.startswith("preset ") or where.endswith(" recipe"):
            by.setdefault(where, []).append(k)
    return [f"{where} set {', '.join(sorted(keys))}" for where, keys in by.items()]


def _keys(d: dict) -> set[str]:
    out = set()
    for k, v in d.items():
        if k in _SECTION_NAMES and isinstance(v, dict):
            out |= _keys(v)
        else:
            out.add(k.replace("-", "_"))
    return out


def dump_json(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=False)
