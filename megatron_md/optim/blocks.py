"""Blocks of a matrix: a plain matrix is one block; Megatron's fused QKV is three (Q, K, V), each projected
and orthogonalised on its own (docs/optimizers.md §1.2), or one block per attention head (§1.2.3). Pure
torch; TP shards report global block shapes through a ``Reducer``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


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
    """A row subset of a matrix (``rows=None``: the whole matrix) and the block's GLOBAL shape.

    ``grouped = (per_group, offset, count)`` when the rows are ``count`` consecutive rows at ``offset`` of
    every run of ``per_group`` rows (Megatron's fused QKV): the block is then a strided view, no copy.
    ``span = (start, stop)``: the local rows ``start:stop``, one attention head (a view). A head lies whole on
    this rank (TP shards whole query groups), so sums over its rows never cross shards.
    """

    rows: torch.Tensor | None
    shape: tuple[int, int]
    grouped: tuple[int, int, int] | None = None
    span: tuple[int, int] | None = None


def matrix_blocks(
    local_shape: Sequence[int],
    split_shapes: Sequence[int] | None = None,
    reducer: Any = None,
    device: torch.device | str | None = None,
    head_dim: int | None = None,
    per_head: bool = False,
) -> list[Block]:
    """The blocks of a (local) matrix; ``reducer.global_shape`` (``sphere.Reducer``) gives a TP shard's global
    block shapes. ``per_head`` (fused QKV only): one block per ``head_dim`` rows, i.e. every Q, K and V head
    (``head_dim`` None: kv_channels, the K block's rows per query group)."""
    m, n = local_shape
    glob = reducer.global_shape if reducer is not None else (lambda shape: (int(shape[0]), int(shape[1])))
    if split_shapes is None:
        return [Block(None, glob((m, n)))]
    q, k, v = (int(x) for x in split_shapes)
    if per_head:
        hd = k if head_dim is None else int(head_dim)
        if hd <= 0 or q % hd or k % hd or v % hd:
            raise ValueError(f"head_dim {hd} must divide the Q, K and V rows per query group {q}, {k}, {v}")
        if m % (q + k + v):
            raise ValueError(f"{m} QKV rows are not a multiple of the query-group size {q}+{k}+{v}")
        shape = (hd, glob((m, n))[1])  # heads are whole here; only the columns may be sharded
        return [Block(None, shape, span=(s, s + hd)) for s in range(0, m, hd)]
    return [Block(idx, glob((idx.numel(), n)), (q + k + v, off, cnt))
            for idx, off, cnt in zip(qkv_row_index(m, split_shapes, device), (0, q, q + k), (q, k, v))]


def block_view(t: torch.Tensor, blk: Block) -> torch.Tensor:
    """The block as a ``[..., groups, count, n]`` strided view of ``t`` (a grouped block only; ``t`` may be a
    stack ``[k, m, n]`` of matrices)."""
    per, off, cnt = blk.grouped
    return t.view(*t.shape[:-2], t.shape[-2] // per, per, t.shape[-1])[..., off:off + cnt, :]


def head_dim_of(blocks: Sequence[Block]) -> int | None:
    """The rows per head when ``blocks`` are the per-head blocks of ``matrix_blocks``, else None."""
    span = blocks[0].span
    return None if span is None else span[1] - span[0]


def heads_view(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[m, n]`` as ``[m / head_dim, head_dim, n]``: every head a batch entry, no copy."""
    return t.view(-1, head_dim, *t.shape[1:])


# The block helpers take a matrix [m, n] or a stack [k, m, n] of same-layout matrices (the batched engine's):
# rows are always the second-to-last axis.


def get_block(t: torch.Tensor, blk: Block) -> torch.Tensor:
    if blk.span is not None:
        return t[..., blk.span[0]:blk.span[1], :]
    if blk.rows is None:
        return t
    if blk.grouped is not None:
        return block_view(t, blk).reshape(*t.shape[:-2], -1, t.shape[-1])
    return t.index_select(-2, blk.rows)


def set_block_(t: torch.Tensor, blk: Block, value: torch.Tensor) -> None:
    if blk.span is not None:
        view = t[..., blk.span[0]:blk.span[1], :]
        if value.data_ptr() != view.data_ptr():
            view.copy_(value)
    elif blk.rows is None:
        if value is not t:
            t.copy_(value)
    elif blk.grouped is not None:
        view = block_view(t, blk)
        if value.data_ptr() != view.data_ptr():  # a one-group block is a view of t already
            view.copy_(value.view(view.shape))
    else:
        t.index_copy_(-2, blk.rows, value)


def add_block_(t: torch.Tensor, blk: Block, value: torch.Tensor, alpha: float) -> None:
    """``t[block] += alpha · value`` in place."""
    if blk.span is not None:
        t[..., blk.span[0]:blk.span[1], :].add_(value, alpha=alpha)
    elif blk.rows is None:
        t.add_(value, alpha=alpha)
    elif blk.grouped is not None:
        view = block_view(t, blk)
        view.add_(value.view(view.shape), alpha=alpha)
    else:
        t.index_add_(-2, blk.rows, value, alpha=alpha)
