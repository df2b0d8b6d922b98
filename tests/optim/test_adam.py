"""The Adam pieces: the compiled kernel for big matrices equals the eager one, and falls back to it."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_md.optim import adam


def _inputs(rows: int):
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(rows, 1024, generator=g) * 1e-3
    m = torch.randn(rows, 1024, generator=g) * 1e-4
    v = torch.rand(rows, 1024, generator=g) * 1e-6
    return grad, m, v


def _eager(grad, m, v, step):
    m, v = m.clone(), v.clone()
    adam.adam_moments_(grad, m, v, 0.9, 0.95)
    return adam.adam_denominator(v, step, 0.95, 1e-8), m, v


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_big_matrix_kernel_equals_eager(mode):
    adam.set_compile(mode)
    try:
        grad, m, v = _inputs(adam.COMPILE_MIN_ELEMENTS // 1024)  # exactly the threshold: compiled in auto
        want, want_m, want_v = _eager(grad, m, v, 3)
        got = adam.adam_moments_and_denominator(grad, m, v, 3, (0.9, 0.95), 1e-8)
        # fp32 rounding of different (fused) formulas: a few ulps of each tensor's magnitude
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(m, want_m, rtol=1e-6, atol=4 * torch.finfo(torch.float32).eps * 1e-3)
        torch.testing.assert_close(v, want_v, rtol=1e-6, atol=4 * torch.finfo(torch.float32).eps * 1e-6)
    finally:
        adam.set_compile("auto")


def test_compile_failure_falls_back_to_eager(monkeypatch, caplog):
    def broken():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(adam, "_compiled", broken)
    monkeypatch.setitem(adam._state, "failed", False)
    grad, m, v = _inputs(adam.COMPILE_MIN_ELEMENTS // 1024)
    want, _, _ = _eager(grad, m, v, 1)
    with caplog.at_level(logging.WARNING):
        got = adam.adam_moments_and_denominator(grad, m, v, 1, (0.9, 0.95), 1e-8)
    assert torch.equal(got, want) and adam._state["failed"]
    assert "using eager kernels" in caplog.text
    monkeypatch.setitem(adam._state, "failed", False)


def test_small_matrices_and_bad_mode():
    grad, m, v = _inputs(4)
    want, _, _ = _eager(grad, m, v, 2)
    assert torch.equal(adam.adam_moments_and_denominator(grad, m, v, 2, (0.9, 0.95), 1e-8), want)
    with pytest.raises(ValueError, match="--md-compile"):
        adam.set_compile("always")


def test_compiled_kernel_is_not_recompiled_per_step():
    """eps·sqrt(1-β2^t) changes each step; as a Python float it would recompile the kernel every step."""
    from torch._dynamo.utils import counters

    adam.set_compile("auto")
    grad, m, v = _inputs(adam.COMPILE_MIN_ELEMENTS // 1024)
    adam.adam_moments_and_denominator(grad, m, v, 1, (0.9, 0.95), 1e-8)
    if adam._state["failed"]:
        pytest.skip("torch.compile unavailable here (the eager fallback is tested above)")
    before = sum(counters["stats"].values())
    for step in range(2, 6):
        adam.adam_moments_and_denominator(grad, m, v, step, (0.9, 0.95), 1e-8)
    assert sum(counters["stats"].values()) - before <= 4 * 2  # lookups only, no new graphs
    assert counters["stats"]["unique_graphs"] <= 1
