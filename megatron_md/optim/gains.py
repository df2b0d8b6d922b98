"""The gains of MD decoupling (docs/optimizers.md §1.3, §1.7, §1.13): the parametrisation γ = φ(ρ), the gain
algebra the MD step runs (recover Ŵ, gain gradients, Ĝ) and the gain state.

Layouts: row and/or column vectors, one scalar (``flat``), column gains per Q/K/V block of a fused QKV matrix
(``split_qkv_gains``) and the low-rank multiplier ``Γ = max(1 + A·B, floor)`` (``gains="lowrank"``). The step
sees every layout as a pair ``(g_row, g_col)`` that broadcasts onto the matrix:

- ``g_row``: ``[m]`` row gains, a 0-dim flat gain, or the ``[m, n]`` low-rank multiplier;
- ``g_col``: ``[n]`` column gains, or per-block column gains as a ``[q+k+v, n]`` pattern that repeats every
  query group of Megatron's interleaved QKV rows (so it broadcasts through a view, never as ``m x n``).

Raw state keys: ``rho_<axis>``, ``exp_avg_<axis>``, ``exp_avg_sq_<axis>`` for the axes of ``GAIN_AXES`` and
``LOWRANK_AXES``; split column gains keep the key ``rho_col``, one ``[3n]`` vector (Q, then K, then V).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .sphere import LOCAL_REDUCER, Reducer

from .hyperparams import MDHyperParams

MaybeTensor = torch.Tensor | None
GAIN_AXES = ("row", "col", "flat")  # gain vectors: state keys rho_<axis>, exp_avg_<axis>, exp_avg_sq_<axis>
LOWRANK_AXES = ("lowrank_a", "lowrank_b")  # the factors A [m, k] and B [k, n] of low-rank gains, same keys
DIRECTION_CLAMP = 1e-8  # floor of each gain when undoing the gains (unless gains_no_clamp)
DIRECT_FLOOR = 1e-5  # gains_min when unset and the parametrisation is "direct"


# ----------------------------------------------------------------------------------------------------
# Gain parametrisation γ = φ(ρ)


@dataclass(frozen=True)
class GainParam:
    """``phi`` maps raw state to gains, ``phi_inv`` inverts it, ``phi_prime`` is dφ/dρ (for the chain rule)."""

    name: str
    phi: Callable[[torch.Tensor], torch.Tensor]
    phi_inv: Callable[[torch.Tensor], torch.Tensor]
    phi_prime: Callable[[torch.Tensor], torch.Tensor]


def _softplus_inv(x: torch.Tensor) -> torch.Tensor:
    # log(exp(x) - 1) written so it neither overflows for large x nor cancels for small x.
    return x + torch.log1p(-torch.exp(-x))


def gain_param(kind: str = "softplus") -> GainParam:
    """The parametrisation named ``kind``: "softplus" (default, ρ0 = ln(e-1)), "direct" (γ = ρ), "offset"
    (γ = 1 + ρ, ρ0 = 0), "exp". Floors are not part of φ: see ``rho_floor``."""
    if kind == "softplus":
        return GainParam("softplus", F.softplus, _softplus_inv, torch.sigmoid)
    if kind == "direct":  # a copy, so that callers never hold the state tensor itself
        return GainParam("direct", torch.clone, torch.clone, torch.ones_like)
    if kind == "offset":
        return GainParam("offset", lambda r: 1.0 + r, lambda x: x - 1.0, torch.ones_like)
    if kind == "exp":
        return GainParam("exp", torch.exp, torch.log, torch.exp)
    raise ValueError(f"unknown gain_param {kind!r}; choose softplus, direct, offset or exp")


def effective_gains_min(hp: MDHyperParams) -> float:
    """``gains_min``, or when unset 1e-5 for ``direct`` (keeps its gains positive) and 0 (off) otherwise."""
    if hp.gains_min is not None:
        return hp.gains_min
    return DIRECT_FLOOR if hp.gain_param == "direct" else 0.0


def rho_floor(hp: MDHyperParams) -> float | None:
    """Lower bound of ρ that keeps ``φ(ρ) >= gains_min`` (φ is increasing), or None when there is no floor."""
    floor = effective_gains_min(hp)
    if floor <= 0 or hp.gains_mode == "lowrank":
        return None
    return float(gain_param(hp.gain_param).phi_inv(torch.tensor(floor, dtype=torch.float64)))


# ----------------------------------------------------------------------------------------------------
# Gain algebra on (g_row, g_col)


def _scaled(t: torch.Tensor, row: MaybeTensor, col: MaybeTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``diag(row) · t · diag(col)`` by broadcasting, never materialising the m x n outer product.
    ``row``/``col`` may be vectors, ``[m,1]``/``[1,n]`` factors, scalars, the low-rank ``[m, n]`` multiplier or a
    per-block column pattern (``g_col`` of the module docstring); a new tensor unless ``out`` is given."""
    if isinstance(col, torch.Tensor) and col.ndim == 2 and col.shape[0] not in (1, t.shape[0]):
        # per-block column gains: view the rows as [query groups, pattern rows, n] so the pattern broadcasts
        per = col.shape[0]
        grouped = t.view(-1, per, t.shape[1])
        if isinstance(row, torch.Tensor) and row.ndim >= 1:
            row = row.reshape(-1, per, row.shape[1] if row.ndim == 2 else 1)
        res = _scaled(grouped, row, None, None if out is None else out.view(grouped.shape))
        return res.mul_(col).view(t.shape)
    r = row.unsqueeze(1) if isinstance(row, torch.Tensor) and row.ndim == 1 else row
    c = col.unsqueeze(0) if isinstance(col, torch.Tensor) and col.ndim == 1 else col
    if r is None and c is None:
        return t.clone() if out is None else out.copy_(t)
    first, second = (r, c) if r is not None else (c, None)
    res = torch.mul(t, first, out=out) if out is not None else t * first
    return res.mul_(second) if second is not None else res


def recover_direction(W: torch.Tensor, g_row: MaybeTensor, g_col: MaybeTensor,
                      out: torch.Tensor | None = None, clamp: bool = True) -> torch.Tensor:
    """Ŵ = W ⊘ (γ_r γ_cᵀ), each gain floored at 1e-8 unless ``clamp`` is False (``gains_no_clamp``: the true
    gains, so that the division inverts the re-fusion even for a gain at or below zero); a new tensor unless
    ``out`` is given."""
    inv = [None if g is None else (g.clamp_min(DIRECTION_CLAMP) if clamp else g).reciprocal() for g in (g_row, g_col)]
    return _scaled(W, *inv, out=out)


def gain_grads(
    G: torch.Tensor, W_hat: torch.Tensor, g_row: MaybeTensor, g_col: MaybeTensor, reducer: Reducer = LOCAL_REDUCER
) -> tuple[MaybeTensor, MaybeTensor]:
    """∂L/∂γ_r = rowsum(G ⊙ Ŵ ⊙ γ_cᵀ), ∂L/∂γ_c = colsum(G ⊙ Ŵ ⊙ γ_r) (before the φ' factor); a flat gain
    (0-dim ``g_row``): ∂L/∂γ = Σ G ⊙ Ŵ, shape ``[1]``. Row and column vectors only (the textbook form)."""
    GW = G * W_hat
    d_row = d_col = None
    if g_row is not None and g_row.ndim == 0:
        return reducer.sum_all(GW).reshape(1), None
    if g_row is not None:
        d_row = reducer.sum_over_cols(GW if g_col is None else GW * g_col.unsqueeze(0))
    if g_col is not None:
        d_col = reducer.sum_over_rows(GW if g_row is None else GW * g_row.unsqueeze(1))
    return d_row, d_col


def gain_grads_fused(
    G: torch.Tensor, W: torch.Tensor, g_row: MaybeTensor, g_col: MaybeTensor, reducer: Reducer = LOCAL_REDUCER,
    split: Sequence[int] | None = None,
) -> tuple[MaybeTensor, MaybeTensor, torch.Tensor | None]:
    """``gain_grads`` from the FUSED weight: ``Ŵ ⊙ γ_cᵀ = W ⊘ γ_r``, so ∂L/∂γ_r = rowsum(G ⊙ W) / γ_r and
    ∂L/∂γ_c = colsum(G ⊙ W) / γ_c — one product instead of recovering Ŵ and two scaled copies. Per-block column
    gains (``split`` = the Q/K/V row counts): the column sums run over each block's rows, ``[3n]``. Also returns
    that product's buffer (free for reuse; None without gains)."""
    if g_row is None and g_col is None:
        return None, None, None
    GW = G * W
    if g_row is not None and g_row.ndim == 0:  # flat: Σ G ⊙ Ŵ = Σ G ⊙ W / γ
        return reducer.sum_all(GW).div_(g_row).reshape(1), None, GW
    d_row = None if g_row is None else reducer.sum_over_cols(GW).div_(g_row)
    if g_col is not None and g_col.ndim == 2:
        per_row = GW.view(-1, g_col.shape[0], GW.shape[1]).sum(0)  # summed over query groups: [q+k+v, n]
        sums = torch.stack([part.sum(0) for part in per_row.split(list(split), 0)])
        first_rows = g_col[[0, split[0], split[0] + split[1]]]  # each block's gains, [3, n]
        return d_row, reducer.complete(sums, "rows").div_(first_rows).reshape(-1), GW
    d_col = None if g_col is None else reducer.sum_over_rows(GW).div_(g_col)
    return d_row, d_col, GW


def direction_grad(G: torch.Tensor, g_row: MaybeTensor, g_col: MaybeTensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Ĝ = ∂L/∂Ŵ = G ⊙ (γ_r γ_cᵀ); a new tensor unless ``out`` is given."""
    return _scaled(G, g_row, g_col, out=out)


# ----------------------------------------------------------------------------------------------------
# Low-rank gains: Γ = max(1 + A·B, floor)


def lowrank_multiplier(state: dict, hp: MDHyperParams) -> torch.Tensor:
    """``Γ = max(1 + A·B, gains_lowrank_min)`` elementwise, ``[m, n]``. The floor keeps the division that
    recovers Ŵ bounded (an entry of ``1 + A·B`` near zero would blow the direction up); it is the same on the
    recovery and the re-fusion, so the two stay inverse."""
    G = state["rho_lowrank_a"] @ state["rho_lowrank_b"]
    return G.add_(1.0).clamp_min_(max(hp.gains_lowrank_min, DIRECTION_CLAMP))


def lowrank_grads(G: torch.Tensor, W: torch.Tensor, gamma: torch.Tensor, state: dict,
                  reducer: Reducer = LOCAL_REDUCER) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """∂L/∂A = (G ⊙ Ŵ)·Bᵀ, ∂L/∂B = Aᵀ·(G ⊙ Ŵ) with ``G ⊙ Ŵ = G ⊙ W ⊘ Γ``; also that product's buffer.

    Through the floor the gradient is passed straight (as if Γ = 1 + A·B): a clamped entry would otherwise get
    no gradient and could not leave the floor."""
    P = torch.mul(G, W).div_(gamma)
    d_a = reducer.complete(P @ state["rho_lowrank_b"].t(), "cols")
    d_b = reducer.complete(state["rho_lowrank_a"].t() @ P, "rows")
    return d_a, d_b, P


def lowrank_seed(p: torch.Tensor, hp: MDHyperParams) -> int:
    """Seed of A's draw: ``gains_lowrank_seed`` plus a hash of the matrix's stable name (its ``md_key``
    attribute, which the trainer sets from the global layer and expert index) or, untagged, of its shape. The
    same on every rank and every layout, and on a resume."""
    key = getattr(p, "md_key", None) or "x".join(str(s) for s in p.shape)
    return (hp.gains_lowrank_seed + zlib.crc32(key.encode())) % (1 << 63)


# ----------------------------------------------------------------------------------------------------
# State


def _add_axis(state: dict, axis: str, value: torch.Tensor) -> None:
    state[f"rho_{axis}"] = value
    state[f"exp_avg_{axis}"] = torch.zeros_like(value)
    state[f"exp_avg_sq_{axis}"] = torch.zeros_like(value)


def init_gain_state(p: torch.Tensor, state: dict, hp: MDHyperParams, seed: tuple[MaybeTensor, MaybeTensor] | None,
                    split: Sequence[int] | None, reducer: Reducer = LOCAL_REDUCER) -> None:
    """Gains at exactly 1 (ρ0 = φ⁻¹(1); low-rank: B = 0), or at ``seed`` (``preserve_init``), zero moments.
    ``split``: Q/K/V row counts when the column gains are per block."""
    m, n = p.shape
    mode = hp.gains_mode
    if mode == "lowrank":
        if tuple(reducer.global_shape((m, n))) != (m, n):
            raise ValueError("gains='lowrank' needs whole matrices: its random factor A would depend on the "
                             "tensor-parallel layout; use row/col gains or tensor-parallel size 1")
        k = min(hp.gains_rank, m, n)
        std = hp.gains_lowrank_init_std if hp.gains_lowrank_init_std is not None else k ** -0.5
        gen = torch.Generator().manual_seed(lowrank_seed(p, hp))  # CPU draw: the same numbers on any device
        # A random, B zero: Γ = 1 at the start, and B's first gradient Aᵀ(G ⊙ Ŵ) differs per component
        _add_axis(state, "lowrank_a", torch.randn(m, k, generator=gen).mul_(std).to(p.device))
        _add_axis(state, "lowrank_b", torch.zeros(k, n, dtype=torch.float32, device=p.device))
        return
    gp = gain_param(hp.gain_param)
    rho0 = gp.phi_inv(torch.ones((), dtype=torch.float32)).item()
    sizes = {"row": m, "col": 3 * n if split is not None else n, "flat": 1}
    for axis in GAIN_AXES:
        if mode in ("rowcol", axis) and not (axis == "flat" and mode != "flat"):
            _add_axis(state, axis, torch.full((sizes[axis],), rho0, dtype=torch.float32, device=p.device))
    floor = rho_floor(hp)
    for axis, g in zip(("flat" if mode == "flat" else "row", "col"), seed or (None, None)):
        if g is not None:
            rho = state[f"rho_{axis}"].copy_(gp.phi_inv(g.to(torch.float32).reshape(-1)))
            if floor is not None:
                rho.clamp_min_(floor)


def current_gains(state: dict, hp: MDHyperParams, split: Sequence[int] | None = None
                  ) -> tuple[MaybeTensor, MaybeTensor]:
    """(g_row, g_col) of the module docstring from the state; None for an axis without gains. ``split``: the
    Q/K/V row counts when the column gains are per block."""
    if "rho_lowrank_a" in state:
        return lowrank_multiplier(state, hp), None
    gp = gain_param(hp.gain_param)
    if "rho_flat" in state:
        return gp.phi(state["rho_flat"]).reshape(()), None
    g_row, g_col = (gp.phi(state[k]) if k in state else None for k in ("rho_row", "rho_col"))
    if g_col is not None and split is not None:
        per_block = g_col.view(3, -1)
        g_col = torch.cat([per_block[i].expand(c, -1) for i, c in enumerate(split)])
    return g_row, g_col
