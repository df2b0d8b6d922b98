"""Megatron-LM's own ``torch_dist`` GPT checkpoints, read by ``--pretrained-checkpoint`` and ``--load``.

The layout is that of Megatron-LM's ``save_checkpoint``/``generate_state_dict`` in SOURCE (below):
``ROOT/latest_checkpointed_iteration.txt`` (an iteration, or ``release``) and ``ROOT/iter_XXXXXXX/`` (or
``ROOT/release/``) written by megatron-core's ``dist_checkpointing.save``. Its common (non-tensor) state holds
``args`` (Megatron-LM's argparse Namespace), ``checkpoint_version`` (3.0), ``iteration``,
``num_floating_point_operations_so_far`` and, when saved with an optimizer, ``opt_param_scheduler``; older
megatron-core versions put it in ``common.pt``, newer ones in a ``common_state`` object among the ``.distcp``
files: ``dist_checkpointing.load_common_state_dict`` reads both. The sharded part is ``model.*`` (GPTModel's
``sharded_state_dict``: the module names our GPTModel has, each tensor keyed globally, so ``model0``,
``model1``... of a virtual pipeline load alike), ``optimizer.*`` and ``rng_state``. Such a checkpoint has no
``run_config.yaml`` and no ``checksums.json``: it is recognised by ``args`` + ``checkpoint_version`` in its
common state without a ``run_config.yaml`` beside it.

What is read: the weights (resharded to this run's TP/PP/EP by dist_checkpointing), the iteration and
``args.consumed_train_samples`` (``--load``), and for ``--load`` without ``--no-load-optim`` the Adam state
and the LR scheduler, when this run's optimizer is megatron-core's Adam in the same form (distributed or not,
bf16 or not) as the checkpoint's. Never read: Megatron-LM's RNG state (its ``rng_state`` object is laid out
per TP x PP rank, ours per global rank), its rerun-state-machine state. The architecture saved in ``args`` is
compared with this run's before any tensor is read (:func:`differences`); every difference is named.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

# The layout read here, as written by Megatron-LM at this commit.
SOURCE_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
SOURCE = f"https://github.com/NVIDIA/Megatron-LM/blob/{SOURCE_COMMIT}/megatron/training/checkpointing.py"
LATEST = "latest_checkpointed_iteration.txt"


class NotMegatronLM(ValueError):
    """A checkpoint this module cannot read (another format); says which."""


# ----------------------------------------------------------------------------- finding and recognising


def checkpoint_dir(root: str | Path) -> Path | None:
    """The directory ``root``'s tracker file names (``iter_XXXXXXX`` or Megatron-LM's ``release``); None: no tracker."""
    f = Path(root) / LATEST
    if not f.is_file():
        return None
    text = f.read_text().strip()
    if text == "release":
        return Path(root) / "release"
    if not text.isdigit():
        raise ValueError(f"{f}: expected an iteration number or 'release', found {text!r}")
    return Path(root) / f"iter_{int(text):07d}"


@lru_cache(maxsize=8)
def _common(path: str, mtime: float) -> dict | None:
    """The common state of the torch_dist checkpoint at ``path`` (None: not a torch_dist checkpoint)."""
    import megatron.core  # noqa: F401  (registers argparse.Namespace and its kin as safe to unpickle)
    from megatron.core import dist_checkpointing

    if not dist_checkpointing.check_is_distributed_checkpoint(path):
        return None
    return dist_checkpointing.load_common_state_dict(path)


def common_state(path: str | Path) -> dict | None:
    p = Path(path)
    meta = p / "metadata.json"
    return _common(str(p), meta.stat().st_mtime if meta.exists() else 0.0)


def find(root: str | Path | None) -> tuple[Path, dict] | None:
    """(checkpoint directory, common state) when ``root`` holds a Megatron-LM checkpoint, else None."""
    if not root:
        return None
    path = checkpoint_dir(root)
    if path is None or not path.is_dir():
        return None
    if (path / "run_config.yaml").exists():
        # Megatron-Bridge writes a run_config.yaml too, of its ConfigContainer (Hydra-style `_target_` entries):
        # refused by name rather than read as ours (its model fields are not our settings)
        if "_target_:" in (path / "run_config.yaml").read_text():
            raise NotMegatronLM(
                f"{root}: {path.name} is a Megatron-Bridge checkpoint (its run_config.yaml is Bridge's ConfigContainer); "
                "megatron_md does not read that layout: export it to Hugging Face with Megatron-Bridge and use "
                "`megatron-md convert import`")
        return None
    if not (path / "metadata.json").exists():
        if list(path.glob("mp_rank_*")):
            raise NotMegatronLM(
                f"{root}: {path.name} is in Megatron-LM's legacy 'torch' format (mp_rank_*/model_optim_rng.pt); only "
                "'torch_dist' checkpoints are read here: load it in Megatron-LM with --ckpt-format torch_dist and "
                "save it again (or use Megatron-LM's tools/checkpoint/convert.py)")
        return None
    common = common_state(path)
    if common is None or "args" not in common or "checkpoint_version" not in common:
        return None
    return path, common


# ----------------------------------------------------------------------------- the architecture


def saved_arg(args, name, default=None):
    """``args.name``, or ``default`` where Megatron-LM saved none (or None)."""
    value = getattr(args, name, default)
    return default if value is None else value


def _pattern(freq, layers: int) -> list[int]:
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(layers)]
    return [int(x) for x in freq]


def checkpoint_arch(args) -> dict:
    """The settings that shape a parameter or the forward function, as Megatron-LM's args give them (after its
    validate_args: ffn_hidden_size and kv_channels filled in; num_query_groups applies only with
    --group-query-attention)."""
    h, heads, layers = args.hidden_size, args.num_attention_heads, args.num_layers
    swiglu = bool(saved_arg(args, "swiglu", False))
    pos = saved_arg(args, "position_embedding_type", "learned_absolute")
    if saved_arg(args, "use_rotary_position_embeddings", False):
        pos = "rope"
    arch = {
        "num_layers": layers,
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_query_groups": args.num_query_groups if saved_arg(args, "group_query_attention", False) else heads,
        "kv_channels": saved_arg(args, "kv_channels", h // heads),
        "ffn_hidden_size": saved_arg(args, "ffn_hidden_size", int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h),
        "normalization": saved_arg(args, "normalization", "LayerNorm"),
        "norm_epsilon": saved_arg(args, "norm_epsilon", 1e-5),
        "apply_layernorm_1p": bool(saved_arg(args, "apply_layernorm_1p", False)),
        "swiglu": swiglu,
        "activation": next((a for a in ("squared_relu", "quick_geglu", "openai_gelu") if saved_arg(args, a, False)),
                           "silu" if swiglu else "gelu"),
        "position_embedding_type": pos,
        "untie_embeddings_and_output_weights": bool(saved_arg(args, "untie_embeddings_and_output_weights", False)),
        "disable_bias_linear": not saved_arg(args, "add_bias_linear", True),
        "add_qkv_bias": bool(saved_arg(args, "add_qkv_bias", False)) and not saved_arg(args, "add_bias_linear", True),
        "qk_layernorm": bool(saved_arg(args, "qk_layernorm", False)),
        "multi_latent_attention": bool(saved_arg(args, "multi_latent_attention", False)),
        "mtp_num_layers": saved_arg(args, "mtp_num_layers", 0) or 0,
        "hybrid_layer_pattern": saved_arg(args, "hybrid_layer_pattern", None) or saved_arg(args, "hybrid_override_pattern", None),
        "num_experts": saved_arg(args, "num_experts", None),
        "make_vocab_size_divisible_by": saved_arg(args, "make_vocab_size_divisible_by", 128),
        "padded_vocab_size": saved_arg(args, "padded_vocab_size", None),
        "sandwich_norm": False, "layer_scale": False, "embedding_scale": False,  # megatron_md's own options
    }
    if pos == "learned_absolute":
        arch["max_position_embeddings"] = saved_arg(args, "max_position_embeddings", args.seq_length)
    if pos == "rope":
        arch.update(rotary_base=saved_arg(args, "rotary_base", 10000), rotary_percent=saved_arg(args, "rotary_percent", 1.0),
                    rotary_interleaved=bool(saved_arg(args, "rotary_interleaved", False)),
                    use_rope_scaling=bool(saved_arg(args, "use_rope_scaling", False)),
                    rotary_seq_len_interpolation_factor=saved_arg(args, "rotary_seq_len_interpolation_factor", None))
    if arch["num_experts"]:
        arch.update(
            moe_ffn_hidden_size=saved_arg(args, "moe_ffn_hidden_size", arch["ffn_hidden_size"]),
            moe_router_topk=saved_arg(args, "moe_router_topk", 2),
            moe_layer_freq=_pattern(saved_arg(args, "moe_layer_freq", 1), layers),
            moe_shared_expert_intermediate_size=saved_arg(args, "moe_shared_expert_intermediate_size", None),
            moe_shared_expert_gate=bool(saved_arg(args, "moe_shared_expert_gate", False)),
            moe_router_score_function=saved_arg(args, "moe_router_score_function", "softmax"),
            moe_router_pre_softmax=bool(saved_arg(args, "moe_router_pre_softmax", False)),
            moe_router_enable_expert_bias=bool(saved_arg(args, "moe_router_enable_expert_bias", False)))
    return arch


def run_arch(cfg, padded_vocab: int | None = None) -> dict:
    """The same settings for this run (``padded_vocab``: the embedding rows this run built, when known)."""
    from megatron_md.models.presets import moe_layer_pattern

    m = cfg.model
    heads = m.num_attention_heads
    arch = {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": heads,
        "num_query_groups": m.num_query_groups or heads, "kv_channels": m.kv_channels or m.hidden_size // heads,
        "ffn_hidden_size": m.ffn_hidden_size, "normalization": m.normalization, "norm_epsilon": m.norm_epsilon,
        "apply_layernorm_1p": m.apply_layernorm_1p, "swiglu": m.swiglu, "activation": "silu" if m.swiglu else "gelu",
        "position_embedding_type": m.position_embedding_type,
        "untie_embeddings_and_output_weights": m.untie_embeddings_and_output_weights,
        "disable_bias_linear": m.disable_bias_linear, "add_qkv_bias": m.add_qkv_bias and m.disable_bias_linear,
        "qk_layernorm": m.qk_layernorm,
        "multi_latent_attention": False, "mtp_num_layers": 0, "hybrid_layer_pattern": None,
        "num_experts": m.num_experts, "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "padded_vocab_size": padded_vocab,
        "sandwich_norm": m.sandwich_norm, "layer_scale": m.layer_scale, "embedding_scale": m.embedding_scale,
    }
    if m.position_embedding_type == "learned_absolute":
        arch["max_position_embeddings"] = m.max_position_embeddings or m.seq_length
    if m.position_embedding_type == "rope":
        arch.update(rotary_base=m.rotary_base, rotary_percent=m.rotary_percent, rotary_interleaved=False,
                    use_rope_scaling=False, rotary_seq_len_interpolation_factor=None)
    if m.num_experts:
        arch.update(
            moe_ffn_hidden_size=m.moe_ffn_hidden_size, moe_router_topk=m.moe_router_topk,
            moe_layer_freq=moe_layer_pattern(m), moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=m.moe_shared_expert_gate,
            moe_router_score_function=m.moe_router_score_function, moe_router_pre_softmax=m.moe_router_pre_softmax,
            moe_router_enable_expert_bias=m.moe_router_enable_expert_bias)
    return arch


# Where a difference is not fixed by setting the flag of the same name.
HINTS = {
    "num_query_groups": "--num-query-groups (Megatron-LM's applies only with --group-query-attention)",
    "activation": "megatron_md has GeLU and --swiglu only",
    "multi_latent_attention": "megatron_md builds no multi-latent attention",
    "mtp_num_layers": "megatron_md has no multi-token prediction",
    "hybrid_layer_pattern": "megatron_md builds GPT models, not hybrid (Mamba) ones",
    "rotary_interleaved": "megatron_md's RoPE is not interleaved",
    "use_rope_scaling": "megatron_md has no Llama-3 RoPE scaling",
    "rotary_seq_len_interpolation_factor": "megatron_md has no RoPE interpolation",
    "padded_vocab_size": "the vocabulary: the tokenizer (or --vocab-size), --make-vocab-size-divisible-by and the "
                         "TP size pad it",
    "moe_layer_freq": "--moe-layer-freq",
}


def differences(args, cfg, padded_vocab: int | None = None) -> list[str]:
    """Every architecture setting in which a Megatron-LM checkpoint's ``args`` and this run differ, each as
    ``name: checkpoint X, this run Y (the flag)``. The padded vocabulary is compared only when both are known."""
    saved, now = checkpoint_arch(args), run_arch(cfg, padded_vocab)
    out = []
    for name in [*saved, *(k for k in now if k not in saved)]:
        a, b = saved.get(name), now.get(name)
        if name == "padded_vocab_size" and (a is None or b is None):
            continue
        if name == "make_vocab_size_divisible_by" and padded_vocab is not None:
            continue  # the padded size itself is compared: the divisor alone need not match
        if isinstance(a, float) or isinstance(b, float):
            same = a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9)
        else:
            same = a == b
        if not same:
            out.append(f"{name}: checkpoint {a}, this run {b} ({HINTS.get(name, '--' + name.replace('_', '-'))})")
    return out


def check_fits(root, cfg, flag: str, padded_vocab: int | None = None) -> bool:
    """Raise ValueError naming every architecture difference of the Megatron-LM checkpoint at ``root`` (False:
    ``root`` holds no Megatron-LM checkpoint)."""
    found = find(root)
    if found is None:
        return False
    path, common = found
    diffs = differences(common["args"], cfg, padded_vocab)
    if diffs:
        raise ValueError(f"--{flag.replace('_', '-')} {root}: the Megatron-LM checkpoint {path.name} holds another "
                         f"model than this run builds: {'; '.join(diffs)}. Set these as the checkpoint was saved "
                         f"(`megatron-md convert megatron-lm --load {root} --output DIR` writes its run_config.yaml)")
    return True


# ----------------------------------------------------------------------------- loading


def _layout(args) -> dict:
    tp, pp = saved_arg(args, "tensor_model_parallel_size", 1), saved_arg(args, "pipeline_model_parallel_size", 1)
    return {"tp": tp, "pp": pp, "ep": saved_arg(args, "expert_model_parallel_size", 1),
            "etp": saved_arg(args, "expert_tensor_parallel_size", tp), "dp": saved_arg(args, "data_parallel_size", 1)}


def _check_optimizer(root, args, common, cfg, optimizer) -> None:
    """Refuse Megatron-LM optimizer state this run's optimizer cannot take, before any tensor is read."""
    from megatron_md.training.checkpoints.checkpointing import CheckpointMismatch

    way_out = "pass --no-load-optim (or use --pretrained-checkpoint) to keep the weights and start the optimizer afresh"
    if saved_arg(args, "no_save_optim", False) or "opt_param_scheduler" not in common:
        raise CheckpointMismatch(f"--load {root}: the Megatron-LM checkpoint holds no optimizer state (saved with "
                                 f"--no-save-optim); {way_out}")
    theirs = saved_arg(args, "optimizer", "adam")
    from megatron.core.optimizer import DistributedOptimizer

    from megatron_md.mcore.families import family_of

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    ours_dist = all(isinstance(o, DistributedOptimizer) for o in inner)
    problems = []
    ours = cfg.optimizer.optimizer
    if family_of(cfg).reads_megatron_lm_state != theirs:
        problems.append(f"--optimizer: checkpoint {theirs}, this run {ours} (only Adam's state is read from a "
                        "Megatron-LM checkpoint)")
    if bool(saved_arg(args, "use_distributed_optimizer", False)) != ours_dist:
        problems.append(f"--use-distributed-optimizer: checkpoint {bool(saved_arg(args, 'use_distributed_optimizer', False))}"
                        f", this run {ours_dist}")
    if bool(saved_arg(args, "bf16", False)) != cfg.training.bf16 or saved_arg(args, "fp16", False):
        problems.append(f"--bf16: checkpoint {bool(saved_arg(args, 'bf16', False))}"
                        f"{' (fp16)' if saved_arg(args, 'fp16', False) else ''}, this run {cfg.training.bf16}")
    if problems:
        raise CheckpointMismatch(f"--load {root}: the optimizer state of this Megatron-LM checkpoint does not fit "
                                 f"this run's optimizer: {'; '.join(problems)}; {way_out}")


def load(root, path: Path, common: dict, model, optimizer=None, scheduler=None, *, load_optim: bool,
         cfg=None, fully_parallel: bool = False, log=print, hooks=None) -> dict:
    """Load a Megatron-LM checkpoint (found by :func:`find`) in place; returns the common state in our shape
    (``iteration``, ``consumed_samples``, ``path``, ``extra``). ``cfg``: this run's RunConfig; the architecture is
    compared again here with the vocabulary the model was built with. ``hooks``: the optimizer family's run hooks
    (required with an optimizer: without Megatron-LM's state they make theirs from the weights)."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    from megatron_md.mcore import multi_tensor
    from megatron_md.mcore.optimizer_checkpoint import after_load, prepare_for_load
    from megatron_md.training.checkpoints import checkpointing as ckpt

    args = common["args"]
    built = unwrap_model(model)
    diffs = differences(args, cfg, getattr(built, "vocab_size", None)) if cfg is not None else []
    if diffs:
        raise ckpt.CheckpointMismatch(f"{root}: the Megatron-LM checkpoint holds another model: {'; '.join(diffs)}")
    with_optim = load_optim and optimizer is not None
    meta = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    sharding = meta.get("distrib_optim_sharding_type", "dp_reshardable")
    if with_optim:
        _check_optimizer(root, args, common, cfg, optimizer)
        saved = {"layout": _layout(args), "optim_sharding": sharding}
        ckpt.check_optimizer_reshard(root, saved, optimizer)
        prepare_for_load(optimizer)
    log(f"{root}: a Megatron-LM checkpoint ({path.name}; the layout of {SOURCE}): it has no checksums.json, so "
        f"nothing was verified; RNG state not restored{'' if with_optim else ', optimizer state not loaded'}")
    hooks = ckpt._hooks(optimizer, hooks)
    state = ckpt._sharded_state(model, optimizer, is_loading=True, with_optim=with_optim, with_rng=False,
                                optim_sharding=sharding, avoid_prefix=meta.get("chained_optim_avoid_prefix", False),
                                hooks=hooks)
    for key in state.pop("optimizer_extras", []):  # a Megatron-LM checkpoint holds none of our families' extras
        state.pop(key)
    loaded = dist_checkpointing.load(state, str(path), sharded_strategy=ckpt.load_strategy(path, fully_parallel))
    built.load_state_dict(loaded["model"])
    if with_optim:
        import torch

        with torch.no_grad():  # fp32 distributed Adam's main params are views of the model's (leaf) params
            optimizer.load_state_dict(loaded["optimizer"])
        after_load(optimizer)
        multi_tensor.use_foreach(optimizer)
        if scheduler is not None:
            scheduler.load_state_dict(common["opt_param_scheduler"])
    note = None
    if not with_optim and optimizer is not None:
        optimizer.reload_model_params()  # fp32 master copies of the new weights
        note = hooks.from_weights(optimizer)  # the family's state from the loaded weights (what it kept, moved)
    return {"iteration": int(common.get("iteration", 0)), "consumed_samples": int(saved_arg(args, "consumed_train_samples", 0)),
            "path": str(path), "extra": {}, "megatron_lm": True, "rng_restored": False, "weights_note": note}
