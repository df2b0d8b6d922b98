"""The optimizer families' typed config sections: one dataclass per family (or per base update), one field per
knob, each field one flag with the name users type (``--md-sphere``, ``--manifold-mode``, ...).

``OptimConfig`` (training/config.py) holds the settings every optimizer shares plus one section of each class
in ``SECTIONS``; each family reads its own sections and hands them on to its megatron config as the same typed
objects, never copied field by field. Imports neither torch nor megatron-core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_md.fields import opt



def gains_holding_norms(sphere: str) -> tuple[str, ...]:
    """The --md-gains that can hold a matrix's norms on ``sphere`` (``embed`` read as row), as --md-preserve-init
    and a weights-only load need: one factor per row, per column or per matrix; Sinkhorn spheres need both."""
    sphere = "row" if sphere == "embed" else sphere
    return {"flat": ("rowcol", "row", "col", "flat", "embed"), "row": ("rowcol", "row", "embed"),
            "col": ("rowcol", "col")}.get(sphere, ("rowcol",))

@dataclass
class MuonConfig:
    """Muon's momentum and Newton-Schulz settings: megatron's Muon, MD's Muon base and Manifold Muon."""

    muon_momentum: float = opt(0.9, "Muon momentum (MD and Manifold Muon: 0.95 by their recipes).", valid="[0,1)")
    muon_nesterov: bool = opt(False, "Nesterov momentum for Muon (on in MD's and Manifold Muon's recipes).")
    muon_scale_mode: str = opt(
        "spectral", "Muon update scale.", ["spectral", "unit_rms_norm", "shape_scaling"]
    )
    muon_num_ns_steps: int = opt(5, "Newton-Schulz iterations.", valid=">=1")
    muon_tp_mode: str = opt(
        "auto",
        "How Newton-Schulz treats TP-sharded matrices. layer_sharded (MD, Manifold Muon): one owner per matrix in "
        "its TP group, batched by shape; duplicated: every TP rank runs every matrix; distributed, blockwise: "
        "megatron Muon only ('blockwise' makes the update depend on TP size). auto: layer_sharded for MD and "
        "Manifold Muon, duplicated for muon.",
        ["auto", "layer_sharded", "duplicated", "distributed", "blockwise"],
    )
    muon_extra_scale_factor: float = opt(1.0, "Extra multiplier on the Muon update.", valid=">0")
    muon_fp32_matmul_prec: str = opt(
        "auto",
        "fp32 matmul precision of megatron Muon's Newton-Schulz; 'medium' runs it in bf16. auto: medium on CUDA, "
        "highest on CPU (bf16 matmuls there are ~100x slower than fp32 without native bf16 units).",
        ["auto", "medium", "high", "highest"],
    )


@dataclass
class MDConfig:
    """MD decoupling: learning-rate bands, spheres, gains and the options of the MD paper's code."""

    matrix_lr: Optional[float] = opt(None, "MD: peak LR of hidden matrices (the angular step; default --lr).", valid=">0")
    embedding_lr: Optional[float] = opt(None, "MD: peak LR of the word embedding (default --lr).", valid=">0")
    gains_lr: float = opt(1e-3, "MD: peak LR of the row/column gains (Adam on raw gains).", valid=">=0")
    output_lr: Optional[float] = opt(None, "MD: peak LR of the LM head (default --lr).", valid=">0")
    min_lr_mode: str = opt(
        "relative", "MD: each LR band's final LR: relative (the same fraction --min-lr/--lr of its own peak) or "
        "absolute (--min-lr itself for every band).", ["relative", "absolute"])
    md_sphere: str = opt(
        "flat", "MD: sphere of hidden matrices (embed: row, column for out-projections; rowcol / invrowcol: Sinkhorn "
        "alternation of unit rows and columns, ending on columns / rows; equi: one such sweep).",
        ["flat", "row", "col", "embed", "rowcol", "invrowcol", "equi"])
    md_sphere_kind: str = opt(
        "l2", "MD: what the flat sphere fixes: l2 (the Frobenius norm), spectral (the largest singular value, by "
        "power iteration) or orthogonal (the direction is its own polar factor: all singular values equal).",
        ["l2", "spectral", "orthogonal"])
    md_sphere_iters: int = opt(10, "MD: Sinkhorn sweeps (rowcol, invrowcol) and power iterations (spectral).",
                               valid=">=1")
    md_ball: bool = opt(False, "MD: a ball instead of a sphere: shrink a direction onto the radius only when it is "
                        "outside, never grow it.")
    md_split_heads: bool = opt(False, "MD: each attention head's Q, K and V rows on a sphere of their own.")
    md_split_heads_update: bool = opt(False, "MD (Muon base): Newton-Schulz on each attention head's Q, K and V rows "
                                      "apart.")
    md_gains: str = opt("rowcol", "MD: gains of hidden matrices (flat: one per matrix; embed: row, column for "
                        "out-projections; lowrank: an elementwise multiplier max(1 + A B, floor) of rank "
                        "--md-gains-rank).", ["rowcol", "row", "col", "flat", "embed", "lowrank", "none"])
    md_gains_rank: int = opt(4, "MD lowrank gains: the rank k of A [m, k] B [k, n] (capped at min(m, n)).", valid=">=1")
    md_gains_lowrank_init_std: Optional[float] = opt(
        None, "MD lowrank gains: std of A's normal init (B starts at 0; default 1/sqrt(k)).", valid=">0")
    md_gains_lowrank_min: float = opt(0.01, "MD lowrank gains: floor of the multiplier 1 + A B (0: 1e-8).",
                                      valid=">=0")
    md_gains_lowrank_seed: int = opt(0, "MD lowrank gains: seed of A's init (with each matrix's name).", valid=">=0")
    md_split_qkv_gains: bool = opt(False, "MD: separate column gains for the Q, K and V blocks of fused QKV.")
    md_gains_bias_correction: bool = opt(True, "MD: Adam bias correction of the gains' moments.")
    md_gains_min: Optional[float] = opt(
        None, "MD: floor on every gain phi(rho) after its step (0: none; default 1e-5 for --md-gain-param direct, "
        "none otherwise).", valid=">=0")
    md_gains_no_clamp: bool = opt(
        False, "MD: undo the gains with their true value (default: each gain floored at 1e-8 when dividing).")
    md_gains_beta1: Optional[float] = opt(None, "MD: Adam beta1 of the gains (default --adam-beta1).", valid="[0,1)")
    md_gains_beta2: Optional[float] = opt(None, "MD: Adam beta2 of the gains (default --adam-beta2).", valid="[0,1)")
    md_gains_eps: Optional[float] = opt(None, "MD: Adam epsilon of the gains (default --adam-eps).", valid=">0")
    md_gains_weight_decay: Optional[float] = opt(
        None, "MD: decoupled weight decay of the gains (default --weight-decay).", valid=">=0")
    md_gain_param: str = opt("softplus", "MD: gain parametrisation gamma = phi(rho): softplus, direct (rho, floored "
                             "at 1e-5), offset (1 + rho), exp.", ["softplus", "direct", "offset", "exp"])
    md_preserve_init: bool = opt(
        False, "MD: keep the initial weights: hidden matrices are not projected; their norms go into the gains.")
    md_loaded_weights: str = opt(
        "keep", "MD: weights loaded without optimizer state (--pretrained-checkpoint, --no-load-optim, an imported "
        "model): keep them exactly, their norms in the gains wherever the gains can hold them (keep), or project "
        "them onto their spheres with gains 1 (project).", ["keep", "project"])
    md_tangent_grad: bool = opt(
        False, "MD: drop the direction gradient's radial component before the base update (the authors' --hs-p).")
    md_normalize_update: bool = opt(
        False, "MD: put the base update on the direction's sphere before the step, so the relative step is the "
        "LR exactly (the authors' --hs-u).")
    md_scale_mode: str = opt(
        "shape_up", "MD-Muon update scale (shape_up: relative update = LR).",
        ["shape_up", "spectral", "unit_rms_norm", "shape_scaling", "none"],
    )
    md_ns_coefficients: str = opt("quintic", "MD-Muon Newton-Schulz coefficients.", ["quintic", "simple", "polar_express"])
    md_compile: str = opt(
        "auto", "MD: torch.compile the Adam-base kernel of matrices of >= 4M elements (embedding, LM head; eager "
        "fallback if compiling fails); off: eager everywhere.", ["auto", "off"]
    )
    md_ns_per_matrix: bool = opt(
        False, "MD, Manifold Muon: one Newton-Schulz call per matrix inside each same-shape bucket (debugging: "
        "bitwise the unbatched result; batching changes fp32 rounding only)."
    )
    md_per_matrix_step: bool = opt(
        False, "MD: run the prepare and finish phases one matrix at a time (the reference path) instead of on "
        "stacks of same-shape matrices; the same step to fp32 rounding, with one set of launches per matrix."
    )
    md_embedding_sphere: str = opt("row", "MD: word-embedding sphere (none: plain AdamW).",
                                   ["row", "col", "flat", "none"])
    md_embedding_gains: str = opt("none", "MD: word-embedding gains.", ["none", "rowcol", "row", "col", "flat"])
    md_embeddings_base: str = opt(
        "adam", "MD: base update of the word embedding and LM head on their spheres (muon: the authors' "
        "orthogonal updates on embeddings).", ["adam", "muon"])
    md_router_base: str = opt("muon", "MD: base update of the MoE router (muon with Keller Jordan's scale, or adam).",
                              ["muon", "adam"])
    md_output_sphere: str = opt("row", "MD: LM-head sphere (none: plain AdamW).", ["row", "none"])
    md_output_gains: str = opt("rowcol", "MD: LM-head gains.", ["rowcol", "row", "col", "none"])
    md_router_sphere: str = opt("row", "MD: MoE router sphere.", ["row", "flat"])
    md_out_proj_radius: bool = opt(
        False, "MD: out-projections (attention proj, fc2) on a sphere and update scaled by 1/sqrt(2L)."
    )


@dataclass
class LionConfig:
    """The Lion base update of lion_md."""

    lion_beta1: float = opt(0.9, "lion_md: beta1 (the sign's interpolation).", valid="[0,1)")
    lion_beta2: float = opt(0.99, "lion_md: beta2 (the momentum's EMA).", valid="[0,1)")


@dataclass
class SoapConfig:
    """The SOAP base update of soap_md."""

    soap_shampoo_beta: float = opt(0.95, "soap_md: EMA of the Kronecker factors (inner Adam: --adam-beta1/2).", valid="[0,1)")


@dataclass
class ManifoldConfig:
    """Module-wise Manifold Muon: the geometry of each module and the dual solve."""

    geometry: str = opt(
        "hetero", "manifold_muon: a preset (unconstrained, all-stiefel, all-dgram, hetero, hetero-inv, md, "
        "hetero-md) or rules like 'attention=stiefel,mlp=dgram,experts=md'."
    )
    geometry_auto_sigma_max: Optional[float] = opt(
        None, "--geometry auto:PRESET: move a module to Stiefel once its sigma_max exceeds this.", valid=">0"
    )
    geometry_auto_logit: Optional[float] = opt(
        None, "--geometry auto:PRESET: move a layer's attention to Stiefel once its max logit exceeds this.", valid=">0"
    )
    manifold_mode: str = opt("fast", "manifold_muon dual solve: faithful (reference) or fast.", ["faithful", "fast"])
    manifold_dual_steps: int = opt(20, "manifold_muon faithful: dual-ascent iterations K per step.", valid=">=1")
    manifold_dual_lr: float = opt(0.1, "manifold_muon faithful: dual step alpha (absolute, linearly decayed).", valid=">0")
    manifold_msign_steps: int = opt(10, "manifold_muon faithful: Polar Express steps of msign.", valid=">=1")
    manifold_fast_dual_steps: int = opt(1, "manifold_muon fast: dual iterations (msigns) per step; the dual "
                                        "ascent continues across steps.", valid=">=1")
    manifold_fast_dual_lr: float = opt(0.02, "manifold_muon fast: scale-free dual step (x RMS singular value "
                                       "/ (d_i^2 + d_j^2)).", valid=">0")
    manifold_fast_msign_steps: int = opt(8, "manifold_muon fast: Polar Express steps of msign.", valid=">=1")
    manifold_split_qkv: bool = opt(False, "manifold_muon: constrain Q, K, V separately (default: fused).")
    manifold_retraction: str = opt(
        "auto", "manifold_muon fast: DGram retraction. exact: from an fp64 eigendecomposition of the Gram; ns: "
        "GEMMs only in fp32 (no eigh, no host sync); auto: ns on GPUs, exact on CPU.", ["auto", "exact", "ns"])


@dataclass
class AdEMAMixConfig:
    """The AdEMAMix base update of ademamix_md (its fast EMA and second moment: --adam-beta1/2)."""

    ademamix_beta3: float = opt(0.999, "ademamix_md: beta3 of the slow EMA.", valid="[0,1)")
    ademamix_alpha: float = opt(5.0, "ademamix_md: weight of the slow EMA.", valid=">=0")
    ademamix_beta3_warmup: int = opt(0, "ademamix_md: steps over which beta3 rises to its value (0: none).",
                                     valid=">=0")
    ademamix_alpha_warmup: int = opt(0, "ademamix_md: steps over which alpha rises to its value (0: none).",
                                     valid=">=0")


# section name in OptimConfig -> its class (the order is the order of the --help groups)
SECTIONS: dict[str, type] = {"muon": MuonConfig, "md": MDConfig, "lion": LionConfig, "soap": SoapConfig,
                             "ademamix": AdEMAMixConfig, "manifold": ManifoldConfig}
