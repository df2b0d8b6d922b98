"""Before a checkpoint is loaded: does it fit this run? Compare its recorded run config with this run's.

A checkpoint saved with another ``--hidden-size`` (or any other setting that shapes a parameter) would
otherwise end in megatron-core's ``CheckpointingException`` traceback on every rank. Here each such flag is
named with both values, before any process starts. Layout differences (TP, PP, EP, expert TP, DP) are
what resharding on load is for, so they are reported as allowed, not refused.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from megatron_md.training.checkpoints import megatron_lm
from megatron_md.training.checkpoints.integrity import iter_dir, latest_iteration

# Settings that shape the model's parameters: a checkpoint saved with another value cannot be loaded.
SHAPE = {
    "model": ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "ffn_hidden_size", "make_vocab_size_divisible_by", "position_embedding_type", "normalization",
              "swiglu", "untie_embeddings_and_output_weights", "disable_bias_linear", "qk_layernorm",
              "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "moe_router_enable_expert_bias",  # the bias is a saved buffer
              "apply_layernorm_1p", "moe_layer_freq"),  # the norm weights are stored as scale - 1
}
# Settings the load reshards across (the optimizer state too, within what docs/checkpoints.md lists).
RESHARDABLE = {
    "parallel": ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size"),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def saved_run_config(root: str | Path) -> dict | None:
    """The run config recorded beside the latest checkpoint under ``root`` (None: none recorded)."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = iter_dir(root, iteration) / "run_config.yaml"
    if not path.is_file():
        return None
    return yaml.safe_load(path.read_text()) or {}


def compare(saved: dict, cfg) -> tuple[list[str], list[str]]:
    """(refused, allowed): the shape and the layout flags in which a checkpoint's recorded config and this
    run's ``cfg`` differ, each as "--flag A there, B here"."""
    refused, allowed = [], []
    for table, out in ((SHAPE, refused), (RESHARDABLE, allowed)):
        for section, names in table.items():
            was, now = saved.get(section) or {}, getattr(cfg, section)
            for name in names:
                if name in was and was[name] != getattr(now, name):
                    out.append(f"{_flag(name)} {was[name]} there, {getattr(now, name)} here")
    return refused, allowed


def check_checkpoint_fits(cfg) -> list[str]:
    """Raise ValueError (one line) naming every shape flag in which the checkpoint to load differs from this
    run; return the layout differences the load will reshard."""
    allowed = []
    for flag_name in ("load", "pretrained_checkpoint"):
        root = getattr(cfg.checkpoint, flag_name)
        if megatron_lm.check_fits(root, cfg, flag_name):  # Megatron-LM's layout: its saved args are compared
            continue
        saved = saved_run_config(root) if root else None
        if saved is None:
            continue
        refused, reshard = compare(saved, cfg)
        if refused:
            also = f" (the layout differences are fine, the load reshards them: {'; '.join(reshard)})" if reshard else ""
            raise ValueError(f"{_flag(flag_name)} {root}: the checkpoint holds another model: {'; '.join(refused)}; "
                             f"set these as it was saved, or train without {_flag(flag_name)}{also}")
        allowed += reshard
    return allowed
