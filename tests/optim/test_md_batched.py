"""The batched MD step (optim/md_batched.py) against the per-matrix reference (optim/md.py).

Same matrices, same gradients, both paths: parameters and every state entry equal to fp32 rounding after several
steps, for every configuration the batched path takes; the rest must not be batched. Plus what batching is for (a
step's op count does not grow with the number of same-shape matrices, and a steady-state step makes no
device->host sync) and what the stacked state must not break (checkpoints, edits of the state between steps).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_md.optim.md_variants import AdamMD, LionMD, MuonMD, NormMD, SoapMD

# two same-shape plain matrices, a transposed one, two fused QKV matrices (Q/K/V blocks), a lone small one
SHAPES = [(32, 16), (32, 16), (16, 32), (48, 16), (48, 16), (8, 8)]
QKV = {(48, 16): (16, 16, 16)}

CONFIGS = [
    {},
    {"sphere": "row"},
    {"sphere": "col", "gains": "col"},
    {"sphere": "embed", "gains": "embed"},
    {"gains": "row"},
    {"gains": "flat"},
    {"gains": "none"},
    {"gain_param": "direct"},
    {"gain_param": "offset", "weight_decay": 0.1},
    {"gain_param": "exp", "gains_no_clamp": True},
    {"gains_bias_correction": False, "gains_min": 0.5},
    {"radius_scale": 0.5, "gains_weight_decay": 0.01},
]
OPTIMIZERS = {"muon": (MuonMD, {}), "muon_no_nesterov": (MuonMD, {"nesterov": False}), "adam": (AdamMD, {}),
              "lion": (LionMD, {})}


def _params(shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(*s, generator=gen))
        if s in QKV:
            p.qkv_split_shapes = QKV[s]
        ps.append(p)
    return ps


def _run(cls, kw, per_matrix, steps=4, shapes=SHAPES):
    ps = _params(shapes)
    opt = cls(ps, lr=0.02, gains_lr=0.05, **kw)
    opt.per_matrix = per_matrix
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return ps, opt


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # fp32 rounding: a stacked reduction may sum in another order; the differences stay at ~1e-7 of the scale
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6 * scale)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_batched_equals_per_matrix(name, config):
    cls, base_kw = OPTIMIZERS[name]
    ref, ref_opt = _run(cls, {**base_kw, **config}, per_matrix=True)
    out, opt = _run(cls, {**base_kw, **config}, per_matrix=False)
    assert opt._slabs and not ref_opt._slabs
    for p, q in zip(out, ref):
        _close(p.detach(), q.detach())
        assert opt.state[p].keys() == ref_opt.state[q].keys()
        for key, value in ref_opt.state[q].items():
            _close(opt.state[p][key], value)


def test_same_shapes_share_a_stack_and_state_entries_are_its_views():
    ps, opt = _run(MuonMD, {}, per_matrix=False)
    # (32,16) x2, (16,32), (48,16) x2 with Q/K/V blocks, (8,8): four shapes, four stacks
    assert len(opt._slabs) == 4
    stacks = {t.untyped_storage().data_ptr() for slab in opt._slabs.values() for t in slab.data.values()}
    for p in ps:
        for key, value in opt.state[p].items():
            assert value.untyped_storage().data_ptr() in stacks, key


@pytest.mark.parametrize("cls, kw", [
    (MuonMD, {"sphere": "rowcol"}), (MuonMD, {"gains": "lowrank"}), (MuonMD, {"tangent_grad": True}),
    (MuonMD, {"normalize_update": True}), (MuonMD, {"sphere_kind": "spectral"}), (MuonMD, {"ball": True}),
    (NormMD, {}), (SoapMD, {}),
], ids=["sinkhorn", "lowrank", "tangent", "normalize", "spectral", "ball", "norm_base", "soap_base"])
def test_other_configurations_keep_the_per_matrix_path(cls, kw):
    _, opt = _run(cls, kw, per_matrix=False, steps=2, shapes=[(32, 16), (32, 16)])
    assert not opt._slabs


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def _count_step(n_layers: int, per_matrix: bool) -> _Count:
    shapes = [(48, 16), (16, 16), (64, 16), (16, 32)] * n_layers  # qkv, proj, fc1, fc2 per layer
    ps, opt = _run(MuonMD, {}, per_matrix=per_matrix, steps=2, shapes=shapes)
    for p in ps:
        p.grad = torch.randn(p.shape)
    with _Count() as count:
        opt.step()
    return count


def test_op_count_does_not_grow_with_the_number_of_matrices_and_no_sync():
    two, eight = _count_step(2, False), _count_step(8, False)
    # the engine's msign hands each matrix its own output view; everything else is per stack
    assert eight.ops == two.ops, (two.ops, eight.ops)
    assert eight.syncs == 0
    per_two, per_eight = _count_step(2, True), _count_step(8, True)
    assert per_eight.ops > 3 * per_two.ops // 2  # the reference does grow, so the first assertion can fail
    assert per_eight.syncs > 0


def test_checkpoint_round_trip_and_resume_is_bit_exact():
    straight, _ = _run(MuonMD, {}, per_matrix=False, steps=4)
    ps, opt = _run(MuonMD, {}, per_matrix=False, steps=2)
    saved = {"params": [p.detach().clone() for p in ps], "opt": opt.state_dict()}
    saved = copy.deepcopy(saved)
    fresh = _params()
    new = MuonMD(fresh, lr=0.02, gains_lr=0.05)
    with torch.no_grad():
        for p, w in zip(fresh, saved["params"]):
            p.copy_(w)
    new.load_state_dict(saved["opt"])
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in fresh]
        if step < 2:
            continue
        for p, g in zip(fresh, grads):
            p.grad = g
        new.step()
    for p, q in zip(fresh, straight):
        assert torch.equal(p.detach(), q.detach())


def test_state_written_between_steps_is_taken_up():
    """A write into the state from outside the step (a checkpoint load copying in place) must reach the stack."""
    results = []
    for per_matrix in (True, False):
        ps, opt = _run(MuonMD, {}, per_matrix=per_matrix, steps=2)
        for p in ps[:2]:
            opt.state[p]["momentum_buffer"].zero_()
            opt.state[p]["rho_row"].add_(0.25)
        gen = torch.Generator().manual_seed(7)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        results.append([p.detach().clone() for p in ps])
    for a, b in zip(*results):
        _close(b, a)


def test_matrices_at_different_steps_fall_back_to_one_by_one():
    ps, opt = _run(MuonMD, {}, per_matrix=False, steps=1, shapes=[(32, 16), (32, 16)])
    ref, ref_opt = _run(MuonMD, {}, per_matrix=True, steps=1, shapes=[(32, 16), (32, 16)])
    for params, o in ((ps, opt), (ref, ref_opt)):
        params[1].grad = None  # the second matrix skips a step: its gain step count falls behind
        params[0].grad = torch.ones(32, 16)
        o.step()
        for p in params:
            p.grad = torch.full((32, 16), 0.5)
        o.step()
    assert not opt._slabs
    for p, q in zip(ps, ref):
        _close(p.detach(), q.detach())


@pytest.mark.parametrize("kw", [{"sphere": "row", "gains": "rowcol", "weight_decay": 0.1}, {"sphere": "row", "gains": "none"}],
                         ids=["rowcol-decay", "no-gains"])
def test_a_big_matrix_takes_one_compiled_pass_equal_to_the_eager_ones(kw, monkeypatch):
    """At real vocabularies the LM head and the embedding (one matrix each, above adam.COMPILE_MIN_ELEMENTS) take
    AdamBase.step_rows_stacked_: Ĝ, the moments, recovery, decay, step and row norms in one compiled kernel.
    Parameters and state equal the eager kernels' to fp32 rounding after 3 steps."""
    from torch._dynamo.utils import counters

    from megatron_md.optim import adam, bases

    fused = []
    kernel = bases.adam_step_rows_
    monkeypatch.setattr(bases, "adam_step_rows_", lambda *a, **k: fused.append(kernel(*a, **k)) or fused[-1])

    shape = (adam.COMPILE_MIN_ELEMENTS // 256, 256)
    runs, seen = {}, dict(counters["stats"])
    for mode in ("auto", "off"):
        adam.set_compile(mode)
        try:
            (p,), opt = _run(AdamMD, kw, per_matrix=False, steps=3, shapes=[shape])
        finally:
            adam.set_compile("auto")
            counters["stats"].clear()  # the graphs compiled here are not test_adam.py's to count
            counters["stats"].update(seen)
        if mode == "auto" and adam._state["failed"]:
            pytest.skip("torch.compile unavailable here (the eager fallback is tested in test_adam.py)")
        runs[mode] = (p.detach(), opt.state[p])
    assert len(fused) == 3 and all(r is not None for r in fused)  # the auto run's 3 steps, none in the "off" one
    (p, state), (q, ref) = runs["auto"], runs["off"]
    _close(p, q)
    for key, value in ref.items():
        _close(state[key], value)
