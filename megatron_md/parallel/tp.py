"""The MD and Muon mathematics on tensor-parallel shards: reductions and orthogonalisation.

A TP-sharded matrix is split along ``partition_dim`` (0: rows, megatron's column-parallel
layers; 1: columns, row-parallel layers). Every reduction whose axis crosses the shards is
all-reduced over the TP group, and msign runs on the gathered full matrix (``duplicated``:
every TP rank computes the same full result and keeps its slice), so the update does not
depend on the TP size. Knows groups and shards, not models.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_md.optim.md import Reducer
from megatron_md.optim.msign import msign


class ShardedReducer(Reducer):
    """Sums over a matrix whose axis ``partition_dim`` is split across ``group``."""

    def __init__(self, group, partition_dim: int | None):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.dim = partition_dim if self.size > 1 else None

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def sum_over_rows(self, t: torch.Tensor) -> torch.Tensor:
        s = t.sum(dim=0)
        return self._all_reduce(s) if self.dim == 0 else s

    def sum_over_cols(self, t: torch.Tensor) -> torch.Tensor:
        s = t.sum(dim=1)
        return self._all_reduce(s) if self.dim == 1 else s

    def sum_all(self, t: torch.Tensor) -> torch.Tensor:
        s = t.sum()
        return self._all_reduce(s) if self.dim is not None else s

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
    group, partition_dim: int | None, steps: int, coefficients: str
) -> Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]:
    """``(U_block, global_shape) -> msign(U_block)`` computed on the gathered full block."""
    size = dist.get_world_size(group) if group is not None else 1

    def orthogonalize(block: torch.Tensor, global_shape: tuple[int, int]) -> torch.Tensor:
        if size == 1 or partition_dim is None:
            return msign(block, steps=steps, coefficients=coefficients)
        full = gather_shards(block, group, partition_dim)
        return local_slice(msign(full, steps=steps, coefficients=coefficients), group, partition_dim)

    return orthogonalize
