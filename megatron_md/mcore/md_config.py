"""MD's megatron-core OptimizerConfig (megatron's fields plus MD's typed sections, handed on whole) and what
every MD group starts from: the Newton-Schulz settings and the group defaults made from the sections."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.optimizer import OptimizerConfig

from megatron_md.mcore.family_configs import AdEMAMixConfig, LionConfig, MDConfig, SoapConfig
from megatron_md.optim.bases import BASES
from megatron_md.optim.gains import GAIN_AXES, LOWRANK_AXES

GAIN_KEYS = (*(f"{k}_{a}" for a in GAIN_AXES + LOWRANK_AXES for k in ("rho", "exp_avg", "exp_avg_sq")), "gain_step")


def side_keys() -> tuple[str, ...]:
    """State that does not have its parameter's shape: megatron's checkpoint cannot hold it (md_checkpoint.py
    does). Read when called, so a plugin's base counts."""
    return GAIN_KEYS + tuple(k for b in BASES.values() for k in b.side_state)


@dataclass
class MDOptimizerConfig(OptimizerConfig):
    """megatron-core's OptimizerConfig plus MD's typed sections, handed on whole (flags: mcore/family_configs.py)."""

    md_base: str = "muon"  # the family's base update of hidden matrices
    md_num_layers: int = 1  # for the 1/sqrt(2L) out-projection radius
    md: MDConfig = field(default_factory=MDConfig)
    lion: LionConfig = field(default_factory=LionConfig)
    soap: SoapConfig = field(default_factory=SoapConfig)
    ademamix: AdEMAMixConfig = field(default_factory=AdEMAMixConfig)
    # the sections of bases that bring their own (a --plugin's): {section name: the run's section object}
    base_options: dict = field(default_factory=dict)


NS_TP_MODES = ("layer_sharded", "duplicated")


def ns_settings(config: OptimizerConfig) -> dict:
    """Newton-Schulz options of MD and Manifold Muon from megatron's Muon flags.

    ``muon_fp32_matmul_prec`` (already resolved from ``auto``): "medium" runs NS in bf16 (megatron's Muon on
    GPUs), "high" in fp32 with TF32 matmuls, "highest" in plain fp32. ``muon_tp_mode``: "layer_sharded"
    (one owner per matrix, the engine) or "duplicated" (every TP rank runs every NS); megatron's other modes
    change the update with the TP size and are refused.
    """
    prec = config.muon_fp32_matmul_prec
    if prec not in ("medium", "high", "highest"):
        raise ValueError(f"--muon-fp32-matmul-prec {prec!r}: MD and Manifold Muon take medium, high or highest")
    if config.muon_tp_mode not in NS_TP_MODES:
        raise ValueError(
            f"--muon-tp-mode {config.muon_tp_mode!r} is megatron Muon's; MD and Manifold Muon orthogonalise "
            f"whole matrices: use one of {NS_TP_MODES} (layer_sharded: one owner per matrix, the default)"
        )
    return {"dtype": torch.bfloat16 if prec == "medium" else torch.float32,
            "matmul_precision": "high" if prec == "high" else None,
            "tp_mode": config.muon_tp_mode}


def group_defaults(config: MDOptimizerConfig) -> dict:
    """MDHyperParams of every MD group from the run's typed sections (groups override per role)."""
    md, a, betas = config.md, config.ademamix, (config.adam_beta1, config.adam_beta2)
    gains_betas = (betas[0] if md.md_gains_beta1 is None else md.md_gains_beta1,
                   betas[1] if md.md_gains_beta2 is None else md.md_gains_beta2)
    return dict(
        lr=config.lr, gains_lr=md.gains_lr, gains_max_lr=md.gains_lr,
        momentum=config.muon_momentum, nesterov=config.muon_nesterov,
        ns_steps=config.muon_num_ns_steps, ns_coefficients=md.md_ns_coefficients,
        scale_mode=md.md_scale_mode, sphere=md.md_sphere, gains=md.md_gains,
        gain_param=md.md_gain_param, weight_decay=config.weight_decay,
        gains_betas=gains_betas, gains_eps=config.adam_eps if md.md_gains_eps is None else md.md_gains_eps,
        gains_weight_decay=md.md_gains_weight_decay, gains_bias_correction=md.md_gains_bias_correction,
        gains_min=md.md_gains_min, gains_no_clamp=md.md_gains_no_clamp, gains_rank=md.md_gains_rank,
        gains_lowrank_init_std=md.md_gains_lowrank_init_std, gains_lowrank_min=md.md_gains_lowrank_min,
        gains_lowrank_seed=md.md_gains_lowrank_seed, sphere_iters=md.md_sphere_iters, ball=md.md_ball,
        betas=betas, eps=config.adam_eps,
        md_base=config.md_base, lion_betas=(config.lion.lion_beta1, config.lion.lion_beta2),
        soap_shampoo_beta=config.soap.soap_shampoo_beta, tangent_grad=md.md_tangent_grad,
        normalize_update=md.md_normalize_update,
        ademamix_beta3=a.ademamix_beta3, ademamix_alpha=a.ademamix_alpha,
        ademamix_beta3_warmup=a.ademamix_beta3_warmup, ademamix_alpha_warmup=a.ademamix_alpha_warmup,
    )


def hidden_only(config: MDOptimizerConfig) -> dict:
    """Options of hidden matrices only (the router, embedding and head keep their row spheres, whole)."""
    md = config.md
    return {"sphere_kind": md.md_sphere_kind, "split_heads": md.md_split_heads,
            "split_heads_update": md.md_split_heads_update, "split_qkv_gains": md.md_split_qkv_gains}
