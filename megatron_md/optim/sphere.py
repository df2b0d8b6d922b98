"""The spheres of MD's directions (docs/optimizers.md §1.2): projection, radii, and the tangent space.

``flat``: ``‖Ŵ‖_F = r`` (default ``sqrt(max(M, N))`` of the global block shape); ``row`` / ``col``: every row /
column of unit norm; ``embed``: ``row`` for most matrices and ``col`` for out-projections (resolved by the
caller, ``MDHyperParams.sphere_mode``). Every sum over a matrix axis goes through a ``Reducer`` so the same
code runs on tensor-parallel shards. Nothing here talks to process groups. The other spheres (Sinkhorn,
spectral, orthogonal, ball, per head) are in ``geometry.py``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .blocks import Block, block_view, get_block, head_dim_of, heads_view, set_block_

SPHERES = ("flat", "row", "col")
_NORM_FLOOR = 1e-30  # keeps an all-zero row/matrix at zero instead of NaN when projecting


class Reducer:
    """Local (single-process) sums over a matrix; a TP subclass all-reduces when the axis is sharded.

    Every axis sum ends in ``complete(partial, axis)``: the local partial sums of this piece of the matrix,
    made global (identity here; an all-reduce when ``axis`` crosses the shards).
    """

    def complete(self, partial: torch.Tensor, axis: str) -> torch.Tensor:
        """``axis``: "rows" (summed over axis 0), "cols" (over axis 1) or "all" (a scalar)."""
        return partial

    def sum_over_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over axis 0 of ``[m, n]`` -> ``[n]`` (needs an all-reduce when rows are sharded)."""
        return self.complete(t.sum(dim=0), "rows")

    def sum_over_cols(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over axis 1 of ``[m, n]`` -> ``[m]`` (needs an all-reduce when columns are sharded)."""
        return self.complete(t.sum(dim=1), "cols")

    def sum_all(self, t: torch.Tensor) -> torch.Tensor:
        """Scalar sum (needs an all-reduce whenever the tensor is sharded)."""
        return self.complete(t.sum(), "all")

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, int]:
        """Shape of the full (unsharded) matrix or block whose local piece has ``local_shape``."""
        m, n = local_shape
        return int(m), int(n)


LOCAL_REDUCER = Reducer()


class HeadReducer(Reducer):
    """Sums within attention heads (``[heads, head_dim, n]`` views): a head's rows lie whole on this rank (TP
    shards whole query groups), so only sums over columns may cross shards."""

    def __init__(self, base: Reducer):
        self.base = base

    def complete(self, partial: torch.Tensor, axis: str) -> torch.Tensor:
        # "all" of a head = its local rows' partial sums, completed over the (maybe sharded) columns
        return partial if axis == "rows" else self.base.complete(partial, "cols")

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, int]:
        return int(local_shape[0]), self.base.global_shape(local_shape)[1]


def flat_radius(global_shape: Sequence[int]) -> float:
    """Flat-sphere radius sqrt(max(M, N)) of the GLOBAL (block) shape: entry RMS 1/sqrt(min(M, N))."""
    return math.sqrt(max(global_shape))


def sphere_scale(W: torch.Tensor, mode: str, radius: float | None, reducer: Reducer) -> torch.Tensor:
    """The factor that puts ``W`` on its sphere: a scalar (flat), ``[m, 1]`` (row) or ``[1, n]`` (col).

    Row norms come from ``vector_norm`` along rows (no squared temporary of the matrix); the flat norm sums
    those: on CPU, fp32 ``vector_norm`` over a whole matrix (or down long columns) accumulates naively and was
    measured 3e-5 (4096x512) to 5e-3 (131072x512) relative off, row norms of up to 32768 entries within 1e-6.
    Every partial sum is completed by the reducer.
    """
    if mode == "flat":
        r = flat_radius(reducer.global_shape(W.shape)) if radius is None else radius
        sq = reducer.complete(torch.linalg.vector_norm(W, dim=1).square_().sum(), "all")
        return r / sq.sqrt().clamp_min(_NORM_FLOOR)
    if mode == "row":
        sq = reducer.complete(torch.linalg.vector_norm(W, dim=1).square_(), "cols")
        return ((1.0 if radius is None else radius) / sq.sqrt_().clamp_min_(_NORM_FLOOR)).unsqueeze(1)
    if mode == "col":
        sq = reducer.complete(W.square().sum(dim=0), "rows")
        return ((1.0 if radius is None else radius) / sq.sqrt_().clamp_min_(_NORM_FLOOR)).unsqueeze(0)
    raise ValueError(f"unknown sphere {mode!r}; choose one of {SPHERES}")


def project_(
    W: torch.Tensor, mode: str = "flat", radius: float | None = None, reducer: Reducer = LOCAL_REDUCER
) -> torch.Tensor:
    """Project ``W`` onto its sphere in place and return it.

    flat: ``W <- r W / ‖W‖_F`` with ``r = radius`` (default sqrt(max) of the reducer's global shape);
    row / col: every row / column rescaled to norm ``radius`` (default 1).
    """
    return W.mul_(sphere_scale(W, mode, radius, reducer))


def _block_radius(blk: Block, mode: str, radius_scale: float) -> float | None:
    return radius_scale * flat_radius(blk.shape) if mode == "flat" else None


def blocks_sphere_scale(
    W: torch.Tensor, blocks: Sequence[Block], mode: str, reducer: Reducer = LOCAL_REDUCER, radius_scale: float = 1.0
) -> torch.Tensor:
    """``sphere_scale`` of every block (fused QKV: Q, K, V radii differ) as one broadcastable factor."""
    if len(blocks) == 1 and blocks[0].rows is None:
        return sphere_scale(W, mode, _block_radius(blocks[0], mode, radius_scale), reducer)
    if mode == "col":  # column norms of each row block: no single factor, so project the blocks in place
        for blk in blocks:
            part = get_block(W, blk)
            set_block_(W, blk, part.mul_(sphere_scale(part, mode, None, reducer)))
        return W.new_ones(())
    if mode == "row":  # every row on its own unit sphere, whichever block it is in
        return sphere_scale(W, mode, None, reducer)
    if all(b.grouped is not None for b in blocks):  # flat: one pass for all row norms, summed per block
        rows_sq = torch.linalg.vector_norm(W, dim=1).square_().unsqueeze(1)
        out = torch.empty_like(rows_sq)
        for blk in blocks:
            sq = reducer.complete(block_view(rows_sq, blk).sum(), "all")
            r = _block_radius(blk, mode, radius_scale)
            view = block_view(out, blk)
            view.copy_((r / sq.sqrt().clamp_min(_NORM_FLOOR)).expand(view.shape))  # no host sync
        return out
    out = W.new_empty(W.shape[0], 1)
    for blk in blocks:
        s = sphere_scale(get_block(W, blk), mode, _block_radius(blk, mode, radius_scale), reducer)
        out.index_copy_(0, blk.rows, s.expand(blk.rows.numel(), 1) if s.ndim < 2 else s)
    return out


def project_blocks_(
    W: torch.Tensor, blocks: Sequence[Block], mode: str, reducer: Reducer = LOCAL_REDUCER,
    radius_scale: float = 1.0,
) -> torch.Tensor:
    """Project each block onto its own sphere in place."""
    return W.mul_(blocks_sphere_scale(W, blocks, mode, reducer, radius_scale))


def tangent_(
    G: torch.Tensor, W: torch.Tensor, blocks: Sequence[Block], mode: str, reducer: Reducer = LOCAL_REDUCER
) -> torch.Tensor:
    """Remove from ``G`` its radial component at ``W`` on ``W``'s sphere, in place (``--md-tangent-grad``).

    flat: ``G <- G - (<G, W> / ‖W‖²) W`` per block; row / col: the same per row / per column (of each block).
    """
    if mode == "row":  # rows are independent of the Q/K/V blocks
        coef = reducer.sum_over_cols(G * W).div_(reducer.sum_over_cols(W * W).clamp_min_(_NORM_FLOOR))
        return G.sub_(W * coef.unsqueeze(1))
    if mode not in ("flat", "col"):
        raise ValueError(f"unknown sphere {mode!r}; choose one of {SPHERES}")
    hd = head_dim_of(blocks)
    if hd is not None:  # per-head spheres: all heads at once on [heads, head_dim, n] views
        red, G3, W3 = HeadReducer(reducer), heads_view(G, hd), heads_view(W, hd)
        dims, axis = ((-2, -1), "all") if mode == "flat" else ((-2,), "rows")
        num = red.complete((G3 * W3).sum(dim=dims, keepdim=True), axis)
        coef = num.div_(red.complete((W3 * W3).sum(dim=dims, keepdim=True), axis).clamp_min_(_NORM_FLOOR))
        G3.sub_(W3 * coef)
        return G
    for blk in blocks:
        Gb, Wb = get_block(G, blk), get_block(W, blk)
        if mode == "flat":
            coef = reducer.sum_all(Gb * Wb) / reducer.sum_all(Wb * Wb).clamp_min(_NORM_FLOOR)
        else:
            coef = reducer.sum_over_rows(Gb * Wb).div_(reducer.sum_over_rows(Wb * Wb).clamp_min_(_NORM_FLOOR))
        set_block_(G, blk, Gb.sub_(Wb * coef))
    return G
