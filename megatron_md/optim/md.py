"""Magnitude-Direction (MD) decoupling mathematics, shared by MuonMD and AdamMD (ALGORITHMS.md §2).

A managed matrix is stored fused, ``W = diag(γ_r) · Ŵ · diag(γ_c)``: the direction ``Ŵ`` lives on a sphere,
the gains ``γ = φ(ρ)`` live in optimizer state. One step (``md_step_``) follows §2.3 in order.

Every reduction over a matrix axis goes through a ``Reducer`` so the same code runs on tensor-parallel
shards: a TP subclass all-reduces the partial sums when the reduced axis is sharded and reports the
global shape (radii and scale factors always use global shapes). Nothing here talks to process groups.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .msign import msign, scale_factor

MaybeTensor = torch.Tensor | None
SPHERES = ("flat", "row", "col")
GAIN_MODES = ("rowcol", "row", "col", "none")
DIRECTION_CLAMP = 1e-8  # divisor floor when undoing the gains
_NORM_FLOOR = 1e-30  # keeps an all-zero row/matrix at zero instead of NaN when projecting


class Reducer:
    """Local (single-process) sums over a matrix; a TP subclass all-reduces when the axis is sharded."""

    def sum_over_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over axis 0 of ``[m, n]`` -> ``[n]`` (needs an all-reduce when rows are sharded)."""
        return t.sum(dim=0)

    def sum_over_cols(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over axis 1 of ``[m, n]`` -> ``[m]`` (needs an all-reduce when columns are sharded)."""
        return t.sum(dim=1)

    def sum_all(self, t: torch.Tensor) -> torch.Tensor:
        """Scalar sum (needs an all-reduce whenever the tensor is sharded)."""
        return t.sum()

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, int]:
        """Shape of the full (unsharded) matrix or block whose local piece has ``local_shape``."""
        m, n = local_shape
        return int(m), int(n)


LOCAL_REDUCER = Reducer()


def matrix_params(param_group: dict, owner: str) -> list[torch.Tensor]:
    """The group's params as a list, refusing anything that is not a 2-D weight matrix."""
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    for p in params:
        if p.ndim != 2:
            raise ValueError(
                f"{owner} manages 2-D weight matrices only, got a parameter of shape {tuple(p.shape)}; put "
                "1-D parameters (norm gains, biases) in a plain torch.optim.AdamW next to it"
            )
    return params


# ----------------------------------------------------------------------------------------------------
# Gain parametrisation γ = φ(ρ)


@dataclass(frozen=True)
class GainParam:
    """``phi`` maps raw state to gains, ``phi_inv`` inverts it, ``phi_prime`` is dφ/dρ (for the chain rule)."""

    name: str
    phi: Callable[[torch.Tensor], torch.Tensor]
    phi_inv: Callable[[torch.Tensor], torch.Tensor]
    phi_prime: Callable[[torch.Tensor], torch.Tensor]
    rho_floor: float | None = None  # "direct": ρ is clamped here after each gain step


def _softplus_inv(x: torch.Tensor) -> torch.Tensor:
    # log(exp(x) - 1) written so it neither overflows for large x nor cancels for small x.
    return x + torch.log1p(-torch.exp(-x))


def gain_param(kind: str = "softplus", gmin: float = 1e-5) -> GainParam:
    """The parametrisation named ``kind``: "softplus" (default, ρ0 = ln(e-1)), "direct" (γ = ρ >= gmin), "exp"."""
    if kind == "softplus":
        return GainParam("softplus", F.softplus, _softplus_inv, torch.sigmoid)
    if kind == "direct":
        # The floor keeps gains positive (the authors' ablation saw gains reach 0 / flip sign without it).
        # ρ itself is clamped after each update, so φ is the identity wherever it is evaluated and φ' = 1.
        return GainParam(
            "direct",
            lambda r: r.clamp_min(gmin),
            lambda x: x.clamp_min(gmin),
            torch.ones_like,
            rho_floor=gmin,
        )
    if kind == "exp":
        return GainParam("exp", torch.exp, torch.log, torch.exp)
    raise ValueError(f"unknown gain_param {kind!r}; choose softplus, direct or exp")


# ----------------------------------------------------------------------------------------------------
# Hyper-parameters of one param group


@dataclass
class MDHyperParams:
    """Options of one MD param group (the optimizers build one per group per step)."""

    lr: float
    gains_lr: float = 1e-3
    sphere: str = "flat"
    gains: str = "rowcol"
    gain_param: str = "softplus"
    gmin: float = 1e-5
    weight_decay: float = 0.0
    gains_betas: tuple[float, float] = (0.9, 0.99)
    gains_eps: float = 1e-8
    gains_weight_decay: float | None = None  # None: same as weight_decay (ALGORITHMS.md §2.5)
    qkv_split_shapes: tuple[int, int, int] | None = None
    radius_scale: float = 1.0  # flat-sphere radius multiplier (paper option: 1/sqrt(2L) on out-projections)
    # Muon base
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: str = "quintic"
    scale_mode: str = "shape_up"
    # Adam base
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    extra: dict = field(default_factory=dict)  # unknown group keys, for future base updates

    @classmethod
    def from_group(cls, group: dict) -> "MDHyperParams":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in group.items() if k in names}
        extra = {k: v for k, v in group.items() if k not in names and k != "params"}
        return cls(**known, extra=extra)

    def validate(self) -> None:
        if self.sphere not in SPHERES:
            raise ValueError(f"unknown sphere {self.sphere!r}; choose one of {SPHERES}")
        if self.gains not in GAIN_MODES:
            raise ValueError(f"unknown gains mode {self.gains!r}; choose one of {GAIN_MODES}")
        gain_param(self.gain_param, self.gmin)
        scale_factor(1, 1, self.scale_mode)
        split = self.qkv_split_shapes
        if split is not None and (len(split) != 3 or min(split) <= 0):
            raise ValueError(f"qkv_split_shapes must be three positive row counts, got {split}")

    @property
    def effective_gains_weight_decay(self) -> float:
        return self.weight_decay if self.gains_weight_decay is None else self.gains_weight_decay


# ----------------------------------------------------------------------------------------------------
# Blocks: a plain matrix is one block; fused QKV is three (Q, K, V), each projected/orthogonalised alone


def qkv_row_index(
    num_rows: int, split_shapes: Sequence[int], device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row indices of the Q, K and V blocks of a fused ``linear_qkv`` weight in Megatron's layout.

    Megatron interleaves per query group: ``[q rows of group 0, k rows, v rows, q rows of group 1, ...]``
    with ``split_shapes = [heads/groups * kv_ch, kv_ch, kv_ch]``. Works on a row-sharded TP piece too
    (each rank holds whole query groups).
    """
    q, k, v = (int(s) for s in split_shapes)
    per_group = q + k + v
    if num_rows % per_group:
        raise ValueError(f"{num_rows} QKV rows are not a multiple of the query-group size {q}+{k}+{v}")
    starts = torch.arange(num_rows // per_group, device=device).unsqueeze(1) * per_group

    def rows(offset: int, count: int) -> torch.Tensor:
        return (starts + offset + torch.arange(count, device=device)).reshape(-1)

    return rows(0, q), rows(q, k), rows(q + k, v)


@dataclass
class Block:
    """A row subset of a matrix (``rows=None``: the whole matrix) and the block's GLOBAL shape."""

    rows: torch.Tensor | None
    shape: tuple[int, int]


def matrix_blocks(
    local_shape: Sequence[int],
    split_shapes: Sequence[int] | None = None,
    reducer: Reducer = LOCAL_REDUCER,
    device: torch.device | str | None = None,
) -> list[Block]:
    m, n = local_shape
    if split_shapes is None:
        return [Block(None, reducer.global_shape((m, n)))]
    return [Block(idx, reducer.global_shape((idx.numel(), n))) for idx in qkv_row_index(m, split_shapes, device)]


def get_block(t: torch.Tensor, blk: Block) -> torch.Tensor:
    return t if blk.rows is None else t.index_select(0, blk.rows)


def set_block_(t: torch.Tensor, blk: Block, value: torch.Tensor) -> None:
    if blk.rows is None:
        if value is not t:
            t.copy_(value)
    else:
        t.index_copy_(0, blk.rows, value)


# ----------------------------------------------------------------------------------------------------
# Sphere projection and gain algebra


def flat_radius(global_shape: Sequence[int]) -> float:
    """Flat-sphere radius sqrt(max(M, N)) of the GLOBAL (block) shape: entry RMS 1/sqrt(min(M, N))."""
    return math.sqrt(max(global_shape))


def project_(
    W: torch.Tensor, mode: str = "flat", radius: float | None = None, reducer: Reducer = LOCAL_REDUCER
) -> torch.Tensor:
    """Project ``W`` onto its sphere in place and return it.

    flat: ``W <- r W / ‖W‖_F`` with ``r = radius`` (default sqrt(max) of the reducer's global shape);
    row / col: every row / column rescaled to norm ``radius`` (default 1).
    """
    sq = W.square()
    if mode == "flat":
        r = flat_radius(reducer.global_shape(W.shape)) if radius is None else radius
        W.mul_(r / reducer.sum_all(sq).sqrt().clamp_min(_NORM_FLOOR))
    elif mode == "row":
        r = 1.0 if radius is None else radius
        W.mul_(r / reducer.sum_over_cols(sq).sqrt().clamp_min(_NORM_FLOOR).unsqueeze(1))
    elif mode == "col":
        r = 1.0 if radius is None else radius
        W.mul_(r / reducer.sum_over_rows(sq).sqrt().clamp_min(_NORM_FLOOR).unsqueeze(0))
    else:
        raise ValueError(f"unknown sphere {mode!r}; choose one of {SPHERES}")
    return W


def project_blocks_(
    W: torch.Tensor, blocks: Sequence[Block], mode: str, reducer: Reducer = LOCAL_REDUCER,
    radius_scale: float = 1.0,
) -> torch.Tensor:
    """Project each block onto its own sphere (fused QKV: Q, K, V radii differ)."""
    for blk in blocks:
        part = get_block(W, blk)
        project_(part, mode, radius_scale * flat_radius(blk.shape) if mode == "flat" else None, reducer)
        set_block_(W, blk, part)
    return W


def _gain_outer(g_row: MaybeTensor, g_col: MaybeTensor) -> MaybeTensor:
    """Γ = γ_r γ_cᵀ as a broadcastable tensor (None when there are no gains)."""
    if g_row is not None and g_col is not None:
        return g_row.unsqueeze(1) * g_col.unsqueeze(0)
    if g_row is not None:
        return g_row.unsqueeze(1)
    if g_col is not None:
        return g_col.unsqueeze(0)
    return None


def recover_direction(W: torch.Tensor, g_row: MaybeTensor, g_col: MaybeTensor) -> torch.Tensor:
    """Ŵ = W ⊘ (γ_r γ_cᵀ) (divisor clamped at 1e-8); always a new tensor."""
    gamma = _gain_outer(g_row, g_col)
    return W.clone() if gamma is None else W / gamma.clamp_min(DIRECTION_CLAMP)


def gain_grads(
    G: torch.Tensor, W_hat: torch.Tensor, g_row: MaybeTensor, g_col: MaybeTensor, reducer: Reducer = LOCAL_REDUCER
) -> tuple[MaybeTensor, MaybeTensor]:
    """∂L/∂γ_r = rowsum(G ⊙ Ŵ ⊙ γ_cᵀ), ∂L/∂γ_c = colsum(G ⊙ Ŵ ⊙ γ_r) (before the φ' factor)."""
    GW = G * W_hat
    d_row = d_col = None
    if g_row is not None:
        d_row = reducer.sum_over_cols(GW if g_col is None else GW * g_col.unsqueeze(0))
    if g_col is not None:
        d_col = reducer.sum_over_rows(GW if g_row is None else GW * g_row.unsqueeze(1))
    return d_row, d_col


def direction_grad(G: torch.Tensor, g_row: MaybeTensor, g_col: MaybeTensor) -> torch.Tensor:
    """Ĝ = ∂L/∂Ŵ = G ⊙ (γ_r γ_cᵀ); always a new tensor."""
    gamma = _gain_outer(g_row, g_col)
    return G.clone() if gamma is None else G * gamma


def refuse(W_hat: torch.Tensor, g_row: MaybeTensor, g_col: MaybeTensor) -> torch.Tensor:
    """W = diag(γ_r) · Ŵ · diag(γ_c)."""
    gamma = _gain_outer(g_row, g_col)
    return W_hat if gamma is None else W_hat * gamma


def adam_(
    theta: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int | float,
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
) -> None:
    """Bias-corrected Adam with decoupled weight decay, in place (ALGORITHMS.md §1.3); step counts from 1."""
    if weight_decay:
        theta.mul_(1.0 - lr * weight_decay)
    theta.sub_(adam_direction(grad, exp_avg, exp_avg_sq, step, betas, eps), alpha=lr)


def adam_direction(
    grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int | float,
    betas: tuple[float, float], eps: float,
) -> torch.Tensor:
    """Update the moments in place and return m̂ / (sqrt(v̂) + eps)."""
    b1, b2 = betas
    exp_avg.lerp_(grad, 1.0 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    denom = (exp_avg_sq / (1.0 - b2**step)).sqrt_().add_(eps)
    return (exp_avg / (1.0 - b1**step)).div_(denom)


# ----------------------------------------------------------------------------------------------------
# Base updates on the direction gradient Ĝ (pluggable: Lion, SOAP, ... implement the same protocol)

Orthogonalize = Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]


@dataclass
class MatrixLayout:
    """What a base update may need beyond Ĝ: the blocks and how to orthogonalise one (TP glue overrides).

    ``orthogonalize(U_block, global_block_shape)`` returns a NEW tensor ≈ msign(U_block), unscaled.
    """

    blocks: list[Block]
    orthogonalize: Orthogonalize


class BaseUpdate:
    """Turns the direction gradient Ĝ into an update U, applied as ``Ŵ <- Π(Ŵ - lr·U)``."""

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        raise NotImplementedError

    def update(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams, layout: MatrixLayout) -> torch.Tensor:
        raise NotImplementedError


class MuonBase(BaseUpdate):
    """EMA momentum (+ Nesterov), per-block msign and the block's scale factor (§2.3 steps 5-6)."""

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def update(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams, layout: MatrixLayout) -> torch.Tensor:
        buf = state["momentum_buffer"]
        buf.lerp_(g_hat, 1.0 - hp.momentum)
        U = g_hat.lerp(buf, hp.momentum) if hp.nesterov else buf
        if len(layout.blocks) == 1 and layout.blocks[0].rows is None:
            shape = layout.blocks[0].shape
            return layout.orthogonalize(U, shape).mul_(scale_factor(*shape, hp.scale_mode) * hp.radius_scale)
        out = torch.empty_like(U)
        for blk in layout.blocks:
            O = layout.orthogonalize(get_block(U, blk), blk.shape)
            set_block_(out, blk, O.mul_(scale_factor(*blk.shape, hp.scale_mode) * hp.radius_scale))
        return out


class AdamBase(BaseUpdate):
    """Bias-corrected Adam on Ĝ, no scale factor (MD-Adam, §2.3 last paragraph)."""

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["step"] = torch.tensor(0.0)

    def update(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams, layout: MatrixLayout) -> torch.Tensor:
        state["step"] += 1
        return adam_direction(g_hat, state["exp_avg"], state["exp_avg_sq"], state["step"].item(), hp.betas, hp.eps)


# ----------------------------------------------------------------------------------------------------
# Per-matrix state and the MD step


def init_md_state(p: torch.Tensor, state: dict, hp: MDHyperParams, base: BaseUpdate) -> None:
    """Gains at exactly 1 (ρ0 = φ⁻¹(1)) with zero Adam moments, plus the base update's state."""
    gp = gain_param(hp.gain_param, hp.gmin)
    m, n = p.shape
    rho0 = gp.phi_inv(torch.ones((), dtype=torch.float32))
    for axis, size in (("row", m), ("col", n)):
        if hp.gains in ("rowcol", axis):
            state[f"rho_{axis}"] = torch.full((size,), rho0.item(), dtype=torch.float32, device=p.device)
            state[f"exp_avg_{axis}"] = torch.zeros(size, dtype=torch.float32, device=p.device)
            state[f"exp_avg_sq_{axis}"] = torch.zeros(size, dtype=torch.float32, device=p.device)
    state["gain_step"] = torch.tensor(0.0)
    base.init_state(p, state)


def current_gains(state: dict, hp: MDHyperParams) -> tuple[MaybeTensor, MaybeTensor]:
    """(γ_r, γ_c) = φ(ρ) from the state; None for an axis without gains."""
    gp = gain_param(hp.gain_param, hp.gmin)
    return tuple(gp.phi(state[k]) if k in state else None for k in ("rho_row", "rho_col"))  # type: ignore


def default_orthogonalize(hp: MDHyperParams) -> Orthogonalize:
    return lambda U, block_shape: msign(U, steps=hp.ns_steps, coefficients=hp.ns_coefficients)


def resolve_split_shapes(p: torch.Tensor, hp: MDHyperParams) -> tuple[int, int, int] | None:
    """The group's qkv_split_shapes, else the param's ``qkv_split_shapes`` attribute, else None."""
    split = hp.qkv_split_shapes if hp.qkv_split_shapes is not None else getattr(p, "qkv_split_shapes", None)
    return None if split is None else tuple(int(s) for s in split)  # type: ignore[return-value]


@torch.no_grad()
def md_step_(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    hp: MDHyperParams,
    base: BaseUpdate,
    reducer: Reducer = LOCAL_REDUCER,
    orthogonalize: Orthogonalize | None = None,
    blocks: list[Block] | None = None,
) -> None:
    """One MD step on matrix ``p`` in place, ALGORITHMS.md §2.3 in order. ``state`` must be initialised."""
    gp = gain_param(hp.gain_param, hp.gmin)
    if blocks is None:
        blocks = matrix_blocks(p.shape, resolve_split_shapes(p, hp), reducer, p.device)
    G = grad.to(torch.float32)

    # 1-2. gains and the direction they hide
    g_row, g_col = current_gains(state, hp)
    W_hat = recover_direction(p.to(torch.float32), g_row, g_col)

    # 3. gain gradients with the OLD gains, through φ'
    d_row, d_col = gain_grads(G, W_hat, g_row, g_col, reducer)
    if d_row is not None:
        d_row.mul_(gp.phi_prime(state["rho_row"]))
    if d_col is not None:
        d_col.mul_(gp.phi_prime(state["rho_col"]))

    # 4. direction gradient
    G_hat = direction_grad(G, g_row, g_col)

    # 5-6. base update (momentum + msign + scale for Muon, Adam for AdamMD)
    layout = MatrixLayout(blocks, orthogonalize or default_orthogonalize(hp))
    U = base.update(G_hat, state, hp, layout)

    # 7. direction step, then back onto the sphere (decoupled WD first; MD runs use 0)
    if hp.weight_decay:
        W_hat.mul_(1.0 - hp.lr * hp.weight_decay)
    W_hat.sub_(U, alpha=hp.lr)
    project_blocks_(W_hat, blocks, hp.sphere, reducer, hp.radius_scale)

    # 8. Adam on the raw gains
    if d_row is not None or d_col is not None:
        state["gain_step"] += 1
        step = state["gain_step"].item()
        for axis, d in (("row", d_row), ("col", d_col)):
            if d is None:
                continue
            rho = state[f"rho_{axis}"]
            adam_(rho, d, state[f"exp_avg_{axis}"], state[f"exp_avg_sq_{axis}"], step, hp.gains_lr,
                  hp.gains_betas, hp.gains_eps, hp.effective_gains_weight_decay)
            if gp.rho_floor is not None:
                rho.clamp_min_(gp.rho_floor)

    # 9. re-fuse into the stored weight
    p.copy_(refuse(W_hat, *current_gains(state, hp)))
