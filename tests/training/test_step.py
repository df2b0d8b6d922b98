"""The step's finiteness check: one host sync per step whatever the parameter count, NaN/inf caught."""

from __future__ import annotations

import pytest
import torch

from megatron_md.training.step import all_finite, reduce_loss

_SYNCS = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__", "numpy")


@pytest.fixture
def sync_counter(monkeypatch):
    """Counts calls of the Tensor methods that copy a value to the host (a device sync on GPU)."""
    counts = {"n": 0, "depth": 0}
    for name in _SYNCS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, **k):
            # The CPU runtime's __torch_function__ re-dispatches the (wrapped) method: count the
            # outermost call only.
            counts["n"] += counts["depth"] == 0
            counts["depth"] += 1
            try:
                return _orig(self, *a, **k)
            finally:
                counts["depth"] -= 1

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return counts


def _module(n_params: int) -> torch.nn.Module:
    m = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4, 3)) for _ in range(n_params)])
    for p in m:
        p.grad = torch.randn_like(p)
    return m


def _syncs(counter, model, loss) -> tuple[bool, int]:
    before = counter["n"]
    ok = all_finite(model, loss)
    return ok, counter["n"] - before


def test_all_finite_syncs_once_whatever_the_parameter_count(mcore_world, sync_counter):
    small, large = _module(3), _module(300)
    ok_s, n_s = _syncs(sync_counter, small, 1.0)
    ok_l, n_l = _syncs(sync_counter, large, 1.0)
    assert ok_s and ok_l
    assert n_s == n_l == 1
    for bad in (float("nan"), float("inf"), float("-inf")):
        large[257].grad[1, 2] = bad
        ok, n = _syncs(sync_counter, large, 1.0)
        assert not ok and n == 1
        large[257].grad[1, 2] = 0.0
    assert _syncs(sync_counter, large, 1.0) == (True, 1)
    assert _syncs(sync_counter, large, float("nan")) == (False, 1)  # the loss alone
    assert _syncs(sync_counter, large, None) == (True, 1)  # not the last pipeline stage
    large[0].grad = None  # a parameter without a gradient is skipped
    assert _syncs(sync_counter, large, 1.0) == (True, 1)


def _ddp(num_layers: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_md.models.builder import build_model
    from megatron_md.training.config import resolve

    cfg = resolve("tiny-dense", None, {"seq_length": 16, "num_layers": num_layers, "vocab_size": 128})
    model = build_model(cfg, cfg.model.vocab_size, cpu=True)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, check_for_nan_in_grad=False)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def test_all_finite_on_megatron_ddp_buffers(mcore_world, sync_counter):
    small, large = _ddp(1), _ddp(6)
    n_small = sum(1 for _ in small.parameters())
    n_large = sum(1 for _ in large.parameters())
    assert n_large > 4 * n_small
    for m in (small, large):
        for p in m.parameters():
            p.main_grad.normal_()
    assert _syncs(sync_counter, small, 2.0) == (True, 1)
    assert _syncs(sync_counter, large, 2.0) == (True, 1)
    assert _syncs(sync_counter, [large], 2.0) == (True, 1)  # a list of model chunks
    p = list(large.parameters())[-3]
    p.main_grad.view(-1)[0] = float("nan")
    assert _syncs(sync_counter, large, 2.0) == (False, 1)
    large.zero_grad_buffer()
    assert _syncs(sync_counter, large, 2.0) == (True, 1)
    # A parameter whose gradient lives outside the buffers (the fallback path) is checked too.
    extra = torch.nn.Parameter(torch.zeros(3))
    extra.grad = torch.tensor([0.0, float("inf"), 0.0])
    large.module.register_parameter("extra_outside_buffers", extra)
    assert _syncs(sync_counter, large, 2.0) == (False, 1)


def test_reduce_loss_syncs_once_whatever_the_micro_batch_count(mcore_world, sync_counter):
    def losses(n):
        return [{"lm loss": torch.tensor([2.0 * (i + 1), 4.0])} for i in range(n)]

    before = sync_counter["n"]
    assert reduce_loss(losses(2)) == pytest.approx((2 + 4) / 8)
    assert sync_counter["n"] - before == 1
    before = sync_counter["n"]
    assert reduce_loss(losses(40)) == pytest.approx(sum(2.0 * (i + 1) for i in range(40)) / 160)
    assert sync_counter["n"] - before == 1
    assert reduce_loss([]) == 0.0
