"""The options of one MD param group (``MDHyperParams``): a leaf of ``optim/``, imported by the MD step (md.py), the
gains (gains.py) and the base updates (bases.py), importing none of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .geometry import SINKHORN, SPHERE_KINDS, Geometry
from .msign import scale_factor

SPHERES = ("flat", "row", "col", "embed", *SINKHORN)
GAIN_MODES = ("rowcol", "row", "col", "flat", "embed", "lowrank", "none")
GAIN_PARAMS = ("softplus", "direct", "offset", "exp")  # gains.gain_param's parametrisations


@dataclass
class MDHyperParams:
    """Options of one MD param group (the optimizers build one per group per step)."""

    lr: float
    gains_lr: float = 1e-3
    sphere: str = "flat"
    gains: str = "rowcol"
    gain_param: str = "softplus"
    weight_decay: float = 0.0
    gains_betas: tuple[float, float] = (0.9, 0.99)
    gains_eps: float = 1e-8
    gains_weight_decay: float | None = None  # None: same as weight_decay (docs/optimizers.md §1.7)
    # Gain options of docs/optimizers.md §1.13 (gains.py)
    gains_bias_correction: bool = True  # False: the gains' Adam without the 1-β^t factors
    gains_min: float | None = None  # floor on φ(ρ) after each gain step; None: 1e-5 for direct, else off
    gains_no_clamp: bool = False  # recover Ŵ with the true gains, not each floored at 1e-8
    split_qkv_gains: bool = False  # fused QKV: one column-gain vector per Q/K/V block
    gains_rank: int = 4  # lowrank: k of Γ = max(1 + A·B, floor), capped at min(m, n)
    gains_lowrank_init_std: float | None = None  # lowrank: std of A's draw; None: 1/sqrt(k)
    gains_lowrank_min: float = 1e-2  # lowrank: the floor of Γ (0: 1e-8)
    gains_lowrank_seed: int = 0  # lowrank: added to the per-matrix seed of A's draw
    qkv_split_shapes: tuple[int, int, int] | None = None
    radius_scale: float = 1.0  # flat-sphere radius multiplier (paper option: 1/sqrt(2L) on out-projections)
    out_proj: bool = False  # the group holds out-projections (attention proj, fc2): "embed" means col for them
    preserve_init: bool = False  # seed the gains with the initial norms instead of projecting the weights
    tangent_grad: bool = False  # --hs-p: drop Ĝ's radial component at Ŵ before the base update
    normalize_update: bool = False  # --hs-u: put the base update on Ŵ's sphere before the step
    sphere_kind: str = "l2"  # flat sphere's norm: l2 (Frobenius), spectral, orthogonal (Ŵ = r·msign(Ŵ))
    sphere_iters: int = 10  # Sinkhorn sweeps (rowcol, invrowcol) and power iterations (spectral)
    ball: bool = False  # shrink onto the sphere only from outside: ‖Ŵ‖ <= r instead of = r
    split_heads: bool = False  # fused QKV: a sphere per attention head instead of per Q/K/V block
    split_heads_update: bool = False  # fused QKV: Newton-Schulz per attention head (Muon base)
    head_dim: int | None = None  # rows per head for split_heads*; None: kv_channels from qkv_split_shapes
    # Muon base
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: str = "quintic"
    scale_mode: str = "shape_up"
    # Adam base (and SOAP's inner Adam)
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    # Lion base: sign of lerp(M, Ĝ, 1-β1); M <- lerp(M, Ĝ, 1-β2)
    lion_betas: tuple[float, float] = (0.9, 0.99)
    # SOAP base: Kronecker-factor EMA and how often the eigenbasis is refreshed
    soap_shampoo_beta: float = 0.95
    # AdEMAMix base: slow EMA (β3) added with weight α; both warm up over that many base steps (0: off)
    ademamix_beta3: float = 0.999
    ademamix_alpha: float = 5.0
    ademamix_beta3_warmup: int = 0
    ademamix_alpha_warmup: int = 0
    md_base: str | None = None  # the group's base update by its BASES name (trainer groups); None: the optimizer's

    @classmethod
    def from_group(cls, group: dict) -> "MDHyperParams":
        """The group's MD options; other keys of the group (megatron's LR bands, roles) are not ours."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in group.items() if k in names})

    @property
    def sphere_mode(self) -> str:
        """The sphere of this group's matrices: ``embed`` resolved to ``col`` for out-projections, else ``row``."""
        return ("col" if self.out_proj else "row") if self.sphere == "embed" else self.sphere

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.sphere_mode, self.sphere_kind, self.ball, self.radius_scale, self.sphere_iters,
                        self.ns_steps, self.ns_coefficients)

    @property
    def gains_mode(self) -> str:
        """The gains of this group's matrices: ``embed`` resolved like ``sphere_mode``."""
        return ("col" if self.out_proj else "row") if self.gains == "embed" else self.gains

    def validate(self) -> None:
        if self.sphere not in SPHERES:
            raise ValueError(f"unknown sphere {self.sphere!r}; choose one of {SPHERES}")
        if self.gains not in GAIN_MODES:
            raise ValueError(f"unknown gains mode {self.gains!r}; choose one of {GAIN_MODES}")
        if self.preserve_init and self.gains_mode == "none":
            raise ValueError("preserve_init keeps the initial magnitudes in the gains, so it needs gains; "
                             "choose gains other than 'none' or drop preserve_init")
        _need(self.gain_param in GAIN_PARAMS,
              f"unknown gain_param {self.gain_param!r}; choose softplus, direct, offset or exp")
        _check_gain_options(self)
        b1, b2 = self.gains_betas
        for name, value in (("gains_betas[0]", b1), ("gains_betas[1]", b2), ("ademamix_beta3", self.ademamix_beta3)):
            _need(0.0 <= value < 1.0, f"{name} must be in [0, 1), got {value}")
        _need(self.gains_eps >= 0, f"gains_eps must be >= 0, got {self.gains_eps}")
        _need(self.gains_weight_decay is None or self.gains_weight_decay >= 0,
              f"gains_weight_decay must be >= 0 or None (= weight_decay), got {self.gains_weight_decay}")
        _need(self.ademamix_alpha >= 0, f"ademamix_alpha must be >= 0, got {self.ademamix_alpha}")
        for name in ("ademamix_beta3_warmup", "ademamix_alpha_warmup"):
            value = getattr(self, name)
            _need(isinstance(value, int) and value >= 0, f"{name} must be an integer >= 0 (0: off), got {value!r}")
        scale_factor(1, 1, self.scale_mode)
        split = self.qkv_split_shapes
        if split is not None and (len(split) != 3 or min(split) <= 0):
            raise ValueError(f"qkv_split_shapes must be three positive row counts, got {split}")
        self._validate_geometry()

    def _validate_geometry(self) -> None:
        kind = self.sphere_kind
        if kind not in SPHERE_KINDS:
            raise ValueError(f"unknown sphere_kind {kind!r}; choose one of {SPHERE_KINDS}")
        if kind != "l2" and self.sphere != "flat":
            raise ValueError(f"sphere_kind={kind!r} fixes a norm of the whole matrix (block, head), so it needs "
                             f"sphere='flat', got sphere={self.sphere!r}")
        if not isinstance(self.sphere_iters, int) or self.sphere_iters < 1:
            raise ValueError(f"sphere_iters (Sinkhorn sweeps, power iterations) must be an integer >= 1, "
                             f"got {self.sphere_iters!r}")
        if self.ball and kind == "orthogonal":
            raise ValueError("ball shrinks a norm down to the radius, but sphere_kind='orthogonal' sets every "
                             "singular value, which has no inside; drop ball or use sphere_kind 'l2' or 'spectral'")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim <= 0):
            raise ValueError(f"head_dim must be a positive integer (kv_channels), got {self.head_dim!r}")
        if self.tangent_grad and (kind != "l2" or self.sphere in SINKHORN):
            raise ValueError(f"tangent_grad removes the radial part on the l2 flat, row and column spheres only; "
                             f"sphere={self.sphere!r} with sphere_kind={kind!r} has no tangent projection here")
        if self.preserve_init and kind == "orthogonal":
            raise ValueError("preserve_init keeps the initial magnitudes in the gains, but sphere_kind='orthogonal' "
                             "changes the singular values, which no gains can hold; drop one of them")

    @property
    def effective_gains_weight_decay(self) -> float:
        return self.weight_decay if self.gains_weight_decay is None else self.gains_weight_decay


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_gain_options(hp: MDHyperParams) -> None:
    """The gain options of docs/optimizers.md §1.13, each refusal naming its option."""
    _need(hp.gains_min is None or hp.gains_min >= 0, f"gains_min must be >= 0 (0: no floor), got {hp.gains_min}")
    _need(isinstance(hp.gains_rank, int) and hp.gains_rank >= 1, f"gains_rank must be an integer >= 1, got "
          f"{hp.gains_rank!r}")
    _need(hp.gains_lowrank_init_std is None or hp.gains_lowrank_init_std > 0,
          f"gains_lowrank_init_std must be > 0 or None (1/sqrt(rank)), got {hp.gains_lowrank_init_std}")
    _need(hp.gains_lowrank_min >= 0, f"gains_lowrank_min must be >= 0, got {hp.gains_lowrank_min}")
    _need(isinstance(hp.gains_lowrank_seed, int), f"gains_lowrank_seed must be an integer, got "
          f"{hp.gains_lowrank_seed!r}")
    if hp.gains_mode == "lowrank":
        _need(not hp.preserve_init, "preserve_init needs row, column or flat gains to hold the initial norms; "
              "gains='lowrank' starts at exactly 1 (drop preserve_init or choose other gains)")
        _need(not hp.gains_min, "gains_min floors φ(ρ) of row/column/flat gains; lowrank gains have their own "
              "floor, gains_lowrank_min")
    _need(not hp.split_qkv_gains or hp.gains in ("rowcol", "col"),
          f"split_qkv_gains gives each Q/K/V block its own column gains, so it needs column gains (gains "
          f"'rowcol' or 'col'); the group has gains={hp.gains!r}")
