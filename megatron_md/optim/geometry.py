"""More spheres for MD directions (docs/optimizers.md §1.2.1-1.2.4), beside the plain ones of ``sphere.py``.

- Sinkhorn spheres ``rowcol`` / ``invrowcol`` / ``equi``: column and row normalisation alternated.
- Sphere kinds on the flat sphere: ``spectral`` (``‖Ŵ‖_op = r``) and ``orthogonal`` (``Ŵ ← r·msign(Ŵ)``).
- ``ball``: a norm above the radius is shrunk onto it, one below is left alone.
- Per-head spheres of a fused QKV matrix (``blocks.matrix_blocks(per_head=True)``).

Every projection is ``Π(W) = diag(a)·W·diag(b)`` with factors from axis sums completed by a ``Reducer``, so
it runs on tensor-parallel shards; only the orthogonal kind needs its block whole and refuses a shard. The
plain spheres (l2 flat/row/col, no ball, no heads) keep their own code paths in ``sphere.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .blocks import Block, get_block, head_dim_of, heads_view, set_block_
from .msign import msign
from .sphere import _NORM_FLOOR, LOCAL_REDUCER, HeadReducer, Reducer, flat_radius, project_blocks_

SINKHORN = ("rowcol", "invrowcol", "equi")
SPHERE_KINDS = ("l2", "spectral", "orthogonal")
# Norm floor inside a Sinkhorn sweep: the factors are squared, so 1/eps² must stay finite in fp32.
SINKHORN_EPS = 1e-8
_GOLDEN = 0.6180339887498949


@dataclass(frozen=True)
class Geometry:
    """A group's sphere: ``mode`` (flat, row, col or a Sinkhorn mode; ``embed`` already resolved), ``kind``
    (how a flat sphere measures the norm), ``ball``, the radius factor, the iteration count of the Sinkhorn
    sweeps and of the power iteration, and the Newton-Schulz settings of the orthogonal kind."""

    mode: str
    kind: str = "l2"
    ball: bool = False
    radius_scale: float = 1.0
    iters: int = 10
    ns_steps: int = 5
    ns_coefficients: str = "quintic"

    def plain(self, blocks: Sequence[Block]) -> bool:
        """True: ``sphere.py``'s own paths apply (and give the same results as before these options)."""
        return (self.kind == "l2" and not self.ball and self.mode in ("flat", "row", "col")
                and head_dim_of(blocks) is None)

    def radius(self, shape: Sequence[int]) -> float:
        """Flat l2: ``radius_scale·sqrt(max(M, N))``; spectral / orthogonal: ``radius_scale`` (the spectral
        norm); row, column and Sinkhorn spheres: unit rows / columns (``radius_scale`` does not apply)."""
        if self.kind != "l2":
            return self.radius_scale
        return self.radius_scale * flat_radius(shape) if self.mode == "flat" else 1.0


def _shrink(norm: torch.Tensor, radius: float, ball: bool) -> torch.Tensor:
    """The factor that takes ``norm`` to ``radius`` (sphere) or to ``min(norm, radius)`` (ball)."""
    return norm.clamp_min(radius if ball else _NORM_FLOOR).reciprocal_().mul_(radius)


def _rows_sq(X: torch.Tensor, red: Reducer) -> torch.Tensor:  # [..., r, 1]
    return red.complete(torch.linalg.vector_norm(X, dim=-1, keepdim=True).square_(), "cols")


def _cols_sq(X: torch.Tensor, red: Reducer) -> torch.Tensor:  # [..., 1, c]
    return red.complete(X.square().sum(dim=-2, keepdim=True), "rows")


def _total_sq(X: torch.Tensor, red: Reducer) -> torch.Tensor:  # [..., 1, 1]; row norms first (see sphere_scale)
    return red.complete(torch.linalg.vector_norm(X, dim=-1, keepdim=True).square_().sum(dim=-2, keepdim=True), "all")


# Products with a vector: torch.mv on a matrix (fp32 gemv, never TF32), broadcast sums on a batch of heads.
def _matvec(X: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.mv(X, v) if X.ndim == 2 else (X * v.unsqueeze(-2)).sum(dim=-1)


def _rmatvec(X: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.mv(X.T, u) if X.ndim == 2 else (X * u.unsqueeze(-1)).sum(dim=-2)


def spectral_norm(X: torch.Tensor, reducer: Reducer = LOCAL_REDUCER, iters: int = 10) -> torch.Tensor:
    """Largest singular value of ``X`` (``[r, c]`` or a batch ``[..., r, c]``) as ``[..., 1, 1]``, by ``iters``
    power iterations. The start vector is fixed (``frac(j·0.618) - 0.5``): every rank and every run gets the
    same estimate, a lower bound that converges like ``(σ2/σ1)^(2·iters)``."""
    v = torch.arange(X.shape[-1], device=X.device, dtype=X.dtype).mul_(_GOLDEN).frac_().sub_(0.5)
    sigma = X.new_zeros(X.shape[:-2] + (1,))
    for _ in range(iters):
        u = reducer.complete(_matvec(X, v), "cols")
        u = u / reducer.complete(u.square().sum(dim=-1, keepdim=True), "rows").sqrt_().clamp_min_(_NORM_FLOOR)
        v = reducer.complete(_rmatvec(X, u), "rows")
        sigma = reducer.complete(v.square().sum(dim=-1, keepdim=True), "cols").sqrt_()  # ‖Xᵀu‖, u a unit vector
        v = v / sigma.clamp_min(_NORM_FLOOR)
    return sigma.unsqueeze(-1)


def _sinkhorn_factor(sq: torch.Tensor, prev: torch.Tensor | None, ball: bool) -> torch.Tensor:
    """One half-sweep's factor from the squared norms ``sq`` of the matrix scaled by the OTHER factor.
    Sphere: unit norms (recomputed from scratch, so a zero row's factor stays at 1/eps). Ball: a running
    product that only shrinks norms above 1 (``min(prev, 1/norm)``), so no entry ever grows."""
    if not ball:
        return sq.sqrt_().clamp_min_(SINKHORN_EPS).reciprocal_()
    inv = sq.sqrt_().clamp_min_(_NORM_FLOOR).reciprocal_()
    return inv.clamp_max_(1.0) if prev is None else torch.minimum(inv, prev)


def sinkhorn_factors(X: torch.Tensor, mode: str, iters: int, ball: bool = False,
                     reducer: Reducer = LOCAL_REDUCER) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column factors ``a [..., r, 1]``, ``b [..., 1, c]`` of ``diag(a)·X·diag(b)``: ``iters`` sweeps
    (``equi``: one) of column normalisation then row normalisation (``invrowcol``: rows first). The last
    half-sweep's axis ends at unit norms exactly; the other converges to the balanced norm (``sqrt(r/c)`` for
    columns after rows). Works on ``S = X ⊙ X`` and the factors only; ``X`` is not changed."""
    S = X.square()
    flat = X.ndim == 2
    a = b = None
    order = ("row", "col") if mode == "invrowcol" else ("col", "row")
    for _ in range(1 if mode == "equi" else iters):
        for axis in order:
            if axis == "col":  # column norms² of diag(a)·X
                w = None if a is None else a.square()
                sq = S.sum(dim=-2, keepdim=True) if w is None else (
                    torch.mv(S.T, w.view(-1)).view(1, -1) if flat else (S * w).sum(dim=-2, keepdim=True))
                b = _sinkhorn_factor(reducer.complete(sq, "rows"), b, ball)
            else:  # row norms² of X·diag(b)
                w = None if b is None else b.square()
                sq = S.sum(dim=-1, keepdim=True) if w is None else (
                    torch.mv(S, w.view(-1)).view(-1, 1) if flat else (S * w).sum(dim=-1, keepdim=True))
                a = _sinkhorn_factor(reducer.complete(sq, "cols"), a, ball)
    return a, b


def _orthogonal_(X: torch.Tensor, geo: Geometry, red: Reducer, radius: float) -> None:
    """``X ← radius·msign(X)`` in place (the group's Newton-Schulz settings); needs the whole block."""
    local = tuple(int(s) for s in X.shape[-2:])
    whole = red.global_shape(local)
    if whole != local:
        raise ValueError(
            f"sphere_kind='orthogonal' replaces a block by its polar factor and needs the whole block on one "
            f"rank; this one is a tensor-parallel shard {local} of {whole}: use tensor-model-parallel size 1, "
            f"split_heads (heads are never split across ranks), or sphere_kind 'l2' / 'spectral'")
    X.copy_(msign(X, steps=geo.ns_steps, coefficients=geo.ns_coefficients).mul_(radius))


def _block_factors(X: torch.Tensor, geo: Geometry, red: Reducer,
                   shape: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(row factor ``[..., r, 1]`` or scalar ``[..., 1, 1]``, column factor ``[..., 1, c]``) of one block or
    a batch of heads; the orthogonal kind rewrites ``X`` instead and returns (None, None)."""
    radius = geo.radius(shape)
    if geo.kind == "orthogonal":
        _orthogonal_(X, geo, red, radius)
        return None, None
    if geo.kind == "spectral":
        return _shrink(spectral_norm(X, red, geo.iters), radius, geo.ball), None
    if geo.mode in SINKHORN:
        return sinkhorn_factors(X, geo.mode, geo.iters, geo.ball, red)
    if geo.mode == "flat":
        return _shrink(_total_sq(X, red).sqrt_(), radius, geo.ball), None
    if geo.mode == "row":
        return _shrink(_rows_sq(X, red).sqrt_(), radius, geo.ball), None
    if geo.mode == "col":
        return None, _shrink(_cols_sq(X, red).sqrt_(), radius, geo.ball)
    raise ValueError(f"unknown sphere {geo.mode!r}")


def sphere_factors(W: torch.Tensor, blocks: Sequence[Block], geo: Geometry,
                   reducer: Reducer = LOCAL_REDUCER) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``Π(W) = row ⊙ W ⊙ col``: a scalar (0-dim) or ``[m, 1]`` row factor and a ``[1, n]`` column factor
    (None where absent). What no single factor can hold (column factors of several blocks or heads, the
    orthogonal kind) is applied to ``W`` in place here."""
    hd = head_dim_of(blocks)
    if hd is not None:  # every head at once on a [heads, head_dim, n] view
        X = heads_view(W, hd)
        row, col = _block_factors(X, geo, HeadReducer(reducer), blocks[0].shape)
        if col is not None:
            X.mul_(col)
        return (None if row is None else row.expand(X.shape[0], hd, 1).reshape(-1, 1)), None
    if len(blocks) == 1 and blocks[0].rows is None:
        row, col = _block_factors(W, geo, reducer, blocks[0].shape)
        return (row.reshape(()) if row is not None and geo.mode == "flat" else row), col
    out = None
    for blk in blocks:
        X = get_block(W, blk)  # a copy for Q/K/V blocks: written back when changed
        row, col = _block_factors(X, geo, reducer, blk.shape)
        if col is not None or geo.kind == "orthogonal":
            set_block_(W, blk, X if col is None else X.mul_(col))
        if row is not None:
            out = W.new_ones(W.shape[0], 1) if out is None else out
            set_block_(out, blk, row.expand(X.shape[0], 1))
    return out, None


def project_direction_(W: torch.Tensor, blocks: Sequence[Block], geo: Geometry,
                       reducer: Reducer = LOCAL_REDUCER) -> torch.Tensor:
    """Put ``W`` on its sphere (or into its ball) in place, each block or head on its own, and return it."""
    if geo.plain(blocks):
        return project_blocks_(W, blocks, geo.mode, reducer, geo.radius_scale)
    row, col = sphere_factors(W, blocks, geo, reducer)
    if row is not None:
        W.mul_(row)
    if col is not None:
        W.mul_(col)
    return W
