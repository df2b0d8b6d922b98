"""The MD and Muon mathematics on tensor-parallel shards: reductions and orthogonalisation.

A TP-sharded matrix is split along ``partition_dim`` (0: rows, megatron's column-parallel
layers; 1: columns, row-parallel layers). Every reduction whose axis crosses the shards is
all-reduced over the TP group, and msign runs on the gathered full matrix (``duplicated``:
every TP rank computes the same full result and keeps its slice; ``orthogonalize.py`` instead gives each
matrix one owner), so the update does not depend on the TP size. Knows groups and shards, not models.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_md.optim.sphere import Reducer
from megatron_md.parallel.orthogonalize import msign_kernel


class ShardedReducer(Reducer):
    """Sums over a matrix whose axis ``partition_dim`` is split across ``group``."""

    def __init__(self, group, partition_dim: int | None):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.dim = partition_dim if self.size > 1 else None

    def complete(self, partial: torch.Tensor, axis: str) -> torch.Tensor:
        crosses = self.dim is not None and (axis == "all" or (axis == "rows") == (self.dim == 0))
        if not crosses:
            return partial
        partial = partial.contiguous()
        dist.all_reduce(partial, group=self.group)
        return partial

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, int]:
        m, n = (int(x) for x in local_shape)
        if self.dim == 0:
            m *= self.size
        elif self.dim == 1:
            n *= self.size
        return m, n


def gather_shards(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def local_slice(full: torch.Tensor, group, dim: int) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return full.chunk(size, dim=dim)[rank].contiguous()


def duplicated_orthogonalizer(
    group, partition_dim: int | None, steps: int, coefficients: str, dtype: torch.dtype = torch.float32,
    matmul_precision: str | None = None,
) -> Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]:
    """``(U_block, global_shape) -> msign(U_block)`` computed on the gathered full block by every TP rank
    (``--muon-tp-mode duplicated``; the engine in ``orthogonalize.py`` gives each matrix one owner instead)."""
    size = dist.get_world_size(group) if group is not None else 1
    kernel = msign_kernel(steps, coefficients, dtype, matmul_precision)

    def local(X: torch.Tensor) -> torch.Tensor:
        return kernel.fn([X.unsqueeze(0)], [])[0][0][0]

    def orthogonalize(block: torch.Tensor, global_shape: tuple[int, int]) -> torch.Tensor:
        if size == 1 or partition_dim is None:
            return local(block)
        full = gather_shards(block, group, partition_dim)
        return local_slice(local(full), group, partition_dim)

    return orthogonalize
