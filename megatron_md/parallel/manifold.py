"""Manifold Muon on tensor-parallel shards: each matrix's dual solve runs once, on its owner.

Momentum stays local (elementwise, parameter-shaped, checkpointed by megatron). The weights and the
momentum update of every matrix go to one owner rank of its TP group through the orthogonalisation engine,
which solves same-shape matrices together (``optim.manifold_muon.solve_full_``) and returns each rank its
slice of the new weights plus the new warm-start duals (kept whole on every rank, so any rank's checkpoint
holds them). The result does not depend on the TP size.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_md.optim.manifold_muon import (
    ManifoldHyperParams,
    dual_keys,
    momenta_,
    msigns_per_step,
    project_param_,
    qkv_blocks,
    solve_full_,
    solve_stacked,
)
from megatron_md.parallel.orthogonalize import Kernel, OrthogonalizationEngine, msign_flops
from megatron_md.parallel.tp import gather_shards, local_slice

_LOG_KEYS = ("dual_violation", "dual_iters")


@torch.no_grad()
def project_sharded_(p: torch.Tensor, hp: ManifoldHyperParams, group, dim: int | None) -> None:
    """Put a (possibly sharded) matrix on its manifold; once, at construction, on every TP rank."""
    W = p.data.float() if dim is None else gather_shards(p.data.float(), group, dim)
    project_param_(W, hp)
    W = W.to(p.dtype)
    p.data.copy_(W if dim is None else local_slice(W, group, dim))


def _hp_key(hp: ManifoldHyperParams) -> tuple:
    return tuple((f.name, repr(getattr(hp, f.name))) for f in dataclasses.fields(hp))


def manifold_kernel(hp: ManifoldHyperParams) -> Kernel:
    """The whole solve of a bucket: sharded inputs (W, U), replicated inputs the duals; outputs the new W,
    and the new duals with the step's violation and dual iterations."""
    keys = dual_keys(hp)

    def fn(sharded, replicated):
        W, U = sharded
        if hp.mode == "fast" and hp.manifold != "none":  # the whole bucket in one stacked solve
            blocks = qkv_blocks(W[0], hp) if hp.split_qkv else None
            new_W, duals, violation, iters = solve_stacked(W, U, dict(zip(keys, replicated)), hp, blocks)
            return [new_W], [t.to(W.dtype) for t in [duals[k] for k in keys] + [violation, iters]]
        Ws, Us = list(W.unbind(0)), list(U.unbind(0))
        states = []
        for j in range(W.size(0)):
            st = {k: replicated[i][j].clone() for i, k in enumerate(keys)}
            st.update({k: torch.zeros((), dtype=torch.float32, device=W.device) for k in _LOG_KEYS})
            states.append(st)
        solve_full_(Ws, Us, states, hp)
        outs = [torch.stack([st[k] for st in states]).to(W.dtype) for k in keys + list(_LOG_KEYS)]
        return [W], outs

    def outputs(full_shape, rep_shapes):
        return [full_shape], list(rep_shapes) + [(), ()]

    calls, steps = msigns_per_step(hp)
    return Kernel(("manifold",) + _hp_key(hp), fn, outputs, lambda m, n: calls * msign_flops(m, n, steps))


@torch.no_grad()
def submit_manifold_steps(items: list[tuple], hp: ManifoldHyperParams, engine: OrthogonalizationEngine) -> list:
    """Momentum of each ``(p, grad, state, group, dim)`` and its solve queued on ``engine`` (run it, then
    ``finish_manifold_steps``): each matrix solved once, on its owner, same-shape matrices stacked."""
    kernel, keys = manifold_kernel(hp), dual_keys(hp)
    Us = momenta_([grad for _, grad, _, _, _ in items], [state for _, _, state, _, _ in items], hp)
    pending = []
    for (p, _, state, group, dim), U in zip(items, Us):
        ticket = engine.submit([p.data.float(), U], group, dim, kernel, [state[k] for k in keys])
        pending.append((p, state, keys, ticket))
    return pending


@torch.no_grad()
def finish_manifold_steps(pending: list) -> None:
    """Write each rank's slice of the new weights, the new duals and the step's logging scalars: one
    ``torch._foreach_copy_`` per dtype for all matrices (the duals and logging scalars are fp32 state
    tensors that already exist, the weights the params)."""
    dst: dict[torch.dtype, list] = {}
    src: dict[torch.dtype, list] = {}
    for p, state, keys, t in pending:
        pairs = [(p.data, t.out_sharded[0].view_as(p.data))]
        for k, v in zip(keys + list(_LOG_KEYS), t.out_replicated):
            old = state.get(k)
            if old is None or old.shape != v.shape or old.dtype != torch.float32:  # state is fp32, its own tensor
                state[k] = torch.empty(v.shape, dtype=torch.float32, device=v.device)
            pairs.append((state[k], v))
        for d, v in pairs:
            dst.setdefault(d.dtype, []).append(d)
            src.setdefault(d.dtype, []).append(v)
    for dtype, ds in dst.items():
        torch._foreach_copy_(ds, src[dtype])


@torch.no_grad()
def manifold_steps_sharded_(items: list[tuple], hp: ManifoldHyperParams, engine: OrthogonalizationEngine,
                            duplicated: bool = False) -> None:
    """Steps of several matrices sharing ``hp`` in one engine run. ``duplicated``: every TP rank gathers and
    solves every matrix itself (``--muon-tp-mode duplicated``)."""
    if duplicated:
        return _duplicated(items, hp)
    pending = submit_manifold_steps(items, hp, engine)
    engine.run()
    finish_manifold_steps(pending)


def _duplicated(items: list[tuple], hp: ManifoldHyperParams) -> None:
    Ws, Us = [], []
    Ms = momenta_([grad for _, grad, _, _, _ in items], [state for _, _, state, _, _ in items], hp)
    for (p, grad, state, group, dim), U in zip(items, Ms):
        W = p.data.float().clone()
        Ws.append(W if dim is None else gather_shards(W, group, dim))
        Us.append(U if dim is None else gather_shards(U, group, dim))
    solve_full_(Ws, Us, [state for _, _, state, _, _ in items], hp)
    for (p, _, _, group, dim), W in zip(items, Ws):
        W = W.to(p.dtype)
        p.data.copy_(W if dim is None else local_slice(W, group, dim))
