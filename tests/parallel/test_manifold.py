"""Manifold Muon through the orthogonalisation engine (one process): the bucket kernel's stacked solve
equals ManifoldMuon's step, and the step reads no tensor value on the host off CPU."""

from __future__ import annotations

import copy

import torch

from mdtest import OpCounter

from megatron_md.optim import ManifoldMuon, manifolds as M
from megatron_md.optim.manifold_muon import ManifoldHyperParams, init_state
from megatron_md.parallel.manifold import manifold_steps_sharded_
from megatron_md.parallel.orthogonalize import OrthogonalizationEngine


def test_engine_step_equals_the_optimizer_and_has_no_host_sync(monkeypatch):
    monkeypatch.setattr(M, "host_branches", lambda device: False)  # the path taken on GPUs
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s) * 0.05) for s in ((128, 32), (128, 32), (32, 128))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ManifoldMuon(ref, lr=0.05, manifold="dgram", mode="fast", retraction="ns")
    hp = ManifoldHyperParams(lr=0.05, manifold="dgram", mode="fast", retraction="ns")
    with torch.no_grad():
        for p, q in zip(params, ref):
            p.copy_(q)  # the optimizer projected its copies at construction
    states = [{} for _ in params]
    for p, st in zip(params, states):
        init_state(p, st, hp)
    engine = OrthogonalizationEngine()
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        grads = [torch.randn(p.shape, generator=g) * 1e-2 for p in params]
        for q, gr in zip(ref, grads):
            q.grad = gr.clone()
        opt.step()
        with OpCounter() as count:
            manifold_steps_sharded_([(p, gr, st, None, None) for p, gr, st in zip(params, grads, states)], hp, engine)
        assert count.ops["_local_scalar_dense"] == 0, count.ops
        assert engine.stats.kernel_calls == 2 * (step + 1)  # one stacked solve per shape
    for p, q, st in zip(params, ref, states):
        assert torch.equal(p, q)
        for key in ("dual", "dual_violation", "dual_iters", "momentum_buffer"):
            assert torch.equal(st[key], opt.state[q][key]), key
    assert copy.deepcopy(states[0])["dual"].abs().sum() > 0
