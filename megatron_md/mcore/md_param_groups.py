"""MD's param groups in megatron-core: which params MD leaves to AdamW, and the per-module groups (sphere,
gains, base update, LR band) merged into megatron's config overrides (docs/optimizers.md §1.8)."""

from __future__ import annotations

import torch
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

from megatron_md.mcore.md_config import MDOptimizerConfig, hidden_only


def routes_to_adamw(config: MDOptimizerConfig):
    """Which params MD leaves to AdamW: 1-D ones, learned positions, unconstrained embedding/head."""
    plain = ["position_embeddings.weight"]
    if config.md.md_embedding_sphere == "none":
        plain.append("word_embeddings.weight")
    if config.md.md_output_sphere == "none":
        plain.append("output_layer.weight")

    def routed(p: torch.Tensor) -> bool:
        key = getattr(p, "md_key", None) or ""
        return p.ndim != 2 or any(key.endswith(s) for s in plain)

    return routed


def md_param_overrides(config: MDOptimizerConfig) -> dict:
    """Per-module MD groups: sphere, gains, base update and LR band (merged with megatron's)."""
    lr, min_ratio = config.lr, (config.min_lr / config.lr if config.lr else 0.0)
    md = config.md

    def band(max_lr: float, role: str = "") -> dict:
        # megatron matches saved and current param groups on load by a fixed tuple of keys that
        # does not include ours (sphere, gains, base); without a distinguishing entry the
        # embedding and LM-head groups collide. ``is_decoupled_lr`` is in that tuple and unused
        # by megatron-core's scheduler, so it carries the MD role.
        tag = {"is_decoupled_lr": f"md:{role}"} if role else {}
        floor = config.min_lr if md.min_lr_mode == "absolute" else max_lr * min_ratio
        return {"max_lr": max_lr, "min_lr": floor, **tag}

    matrix_lr = config.md.matrix_lr if config.md.matrix_lr is not None else lr
    embedding_lr = config.md.embedding_lr if config.md.embedding_lr is not None else lr
    output_lr = md.output_lr if md.output_lr is not None else lr
    # out-projections get their own group when something differs for them: the 1/sqrt(2L) radius, or "embed"
    out_proj = config.md.md_out_proj_radius or "embed" in (config.md.md_sphere, config.md.md_gains)
    hidden = ParamKey(predicate=ParamPredicate(
        name=f"md_hidden{'_no_out' if out_proj else ''}", fn=lambda p: _is_hidden_matrix(p) and not (out_proj and _is_out_proj(p))
    ))
    keep = {"preserve_init": True} if config.md.md_preserve_init else {}  # hidden matrices only: they have gains
    keep.update(hidden_only(config))
    router = ParamKey(name="*router.weight")
    embedding = ParamKey(name="*word_embeddings.weight")
    output = ParamKey(name="*output_layer.weight")
    out = {
        hidden: {**band(matrix_lr, "hidden"), "md_role": "hidden", **keep},
        router: {**band(matrix_lr, "router"), "md_role": "router", "sphere": config.md.md_router_sphere,
                 "scale_mode": "shape_scaling", "md_base": md.md_router_base},
    }
    if out_proj:
        # Paper option: out-projections live on a sphere of radius sqrt(max(m,n))/sqrt(2L) and
        # their Muon update shrinks by the same factor (docs/optimizers.md §1.2).
        key = ParamKey(predicate=ParamPredicate(name="md_out_proj", fn=lambda p: _is_hidden_matrix(p) and _is_out_proj(p)))
        radius = {"radius_scale": 1.0 / (2 * config.md_num_layers) ** 0.5} if config.md.md_out_proj_radius else {}
        out[key] = {**band(matrix_lr, "out_proj"), "md_role": "hidden", "out_proj": True, **radius, **keep}
    if config.md.md_embedding_sphere != "none":
        out[embedding] = {**band(embedding_lr, "embedding"), "md_role": "embedding", "sphere": config.md.md_embedding_sphere,
                          "gains": md.md_embedding_gains, "md_base": md.md_embeddings_base}
    else:
        out[embedding] = band(embedding_lr)
    if config.md.md_output_sphere != "none":
        out[output] = {**band(output_lr, "output"), "md_role": "output", "sphere": config.md.md_output_sphere,
                       "gains": config.md.md_output_gains, "md_base": md.md_embeddings_base}
    elif md.output_lr is not None:  # the LM head under plain AdamW, in a band of its own
        out[output] = band(output_lr)
    return out


def _is_hidden_matrix(p: torch.Tensor) -> bool:
    key = getattr(p, "md_key", None) or ""
    return p.ndim == 2 and "decoder.layers." in key and not key.endswith("router.weight")


def _is_out_proj(p: torch.Tensor) -> bool:
    key = getattr(p, "md_key", None) or ""
    return key.endswith("linear_proj.weight") or key.endswith("linear_fc2.weight")
