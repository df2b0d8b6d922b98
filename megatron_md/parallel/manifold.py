"""Manifold Muon on tensor-parallel shards: the dual solve needs the whole matrix.

Momentum stays local (elementwise, parameter-shaped, checkpointed by megatron). The momentum
update and the weights are gathered over the TP group, every TP rank solves the same full
problem (megatron's ``duplicated`` mode) and keeps its slice, so the result does not depend on
the TP size.
"""

from __future__ import annotations

import torch

from megatron_md.optim.manifold_muon import (
    ManifoldHyperParams,
    _jobs,
    momentum_,
    project_param_,
    qkv_blocks,
    run_jobs,
)
from megatron_md.optim.manifolds import polar_express
from megatron_md.parallel.tp import gather_shards, local_slice


def _full(t: torch.Tensor, group, dim: int | None) -> torch.Tensor:
    return t if dim is None else gather_shards(t, group, dim)


def _back(p: torch.Tensor, W_full: torch.Tensor, group, dim: int | None) -> None:
    p.copy_(W_full if dim is None else local_slice(W_full, group, dim))


@torch.no_grad()
def project_sharded_(p: torch.Tensor, hp: ManifoldHyperParams, group, dim: int | None) -> None:
    W = _full(p.data.float(), group, dim)
    project_param_(W, hp)
    _back(p.data, W.to(p.dtype), group, dim)


def _prepare(p: torch.Tensor, grad: torch.Tensor, state: dict, hp: ManifoldHyperParams, group,
             dim: int | None) -> tuple[torch.Tensor, list]:
    """Momentum, gather, and either the plain Muon step (manifold "none", done here) or the solve jobs."""
    U = _full(momentum_(grad, state, hp), group, dim)
    W = _full(p.data.float(), group, dim)
    if hp.manifold != "none":
        return W, _jobs(W, U, state, hp)
    fn = polar_express(hp.msign_steps, hp.msign_dtype)  # the reference's plain branch: decoupled WD
    if hp.weight_decay:
        W.mul_(1.0 - hp.lr * hp.weight_decay)
    for _, rows in qkv_blocks(W, hp):
        upd = -hp.lr * fn(U if rows is None else U.index_select(0, rows))
        W.add_(upd) if rows is None else W.index_add_(0, rows, upd)
    return W, []


@torch.no_grad()
def manifold_step_sharded_(
    p: torch.Tensor, grad: torch.Tensor, state: dict, hp: ManifoldHyperParams, group, dim: int | None
) -> None:
    """One Manifold Muon step of a (possibly TP-sharded) matrix in place."""
    manifold_steps_sharded_([(p, grad, state, group, dim)], hp)


@torch.no_grad()
def manifold_steps_sharded_(items: list[tuple], hp: ManifoldHyperParams, batch: int = 16) -> None:
    """Steps of several matrices ``(p, grad, state, group, dim)`` sharing ``hp``: up to ``batch`` gathered
    matrices at a time go to one ``run_jobs`` call, so fast mode stacks the same-shape ones (layers)."""
    for i in range(0, len(items), batch):
        chunk = [(p, *_prepare(p, g, st, hp, group, dim), group, dim) for p, g, st, group, dim in items[i:i + batch]]
        run_jobs([job for _, _, jobs, _, _ in chunk for job in jobs], hp)
        for p, W, _, group, dim in chunk:
            _back(p.data, W.to(p.dtype), group, dim)
