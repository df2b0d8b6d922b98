"""msign (Newton-Schulz polar factor) and the Muon scale factors."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_md.optim.msign import COEFFICIENT_SETS, coefficient_schedule, msign, scale_factor


def _with_singular_values(m: int, n: int, sv: torch.Tensor, seed: int = 0):
    """X = U diag(sv) Vᵀ with random orthonormal U, V; returns X, U, V."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return (U * sv.to(torch.float64)) @ V.T, U, V


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (40, 40)])
def test_polar_express_matches_svd_polar_factor(shape):
    m, n = shape
    sv = torch.linspace(0.2, 1.0, min(m, n))  # well conditioned (kappa = 5)
    X, U, V = _with_singular_values(m, n, sv)
    O = msign(X.float(), steps=None, coefficients="polar_express").double()
    polar = U @ V.T
    rel = (O - polar).norm() / polar.norm()
    assert rel < 1e-3, f"Polar Express 10 steps: relative error {rel:.3g} vs the SVD polar factor"


# (lowest, highest output singular value, max relative Frobenius error vs U Vᵀ) for input σ in [0.2, 1]
_NS5_BOUNDS = {"simple": (0.6, 1.2, 0.3), "quintic": (0.95, 1.05, 0.03)}


@pytest.mark.parametrize("coefficients", sorted(_NS5_BOUNDS))
@pytest.mark.parametrize("shape", [(32, 48), (48, 32)])
def test_ns5_keeps_singular_vectors_and_lands_near_one(coefficients, shape):
    """NS5 applies a polynomial to each singular value: same singular vectors, values near 1 (KJ: not exactly)."""
    m, n = shape
    sv = torch.linspace(0.2, 1.0, min(m, n))
    X, U, V = _with_singular_values(m, n, sv, seed=1)
    O = msign(X.float(), steps=5, coefficients=coefficients).double()
    core = U.T @ O @ V  # diagonal iff O shares X's singular vectors
    diag = torch.diagonal(core)
    off = core - torch.diag(diag)
    assert off.abs().max() < 1e-4
    lo, hi, max_rel = _NS5_BOUNDS[coefficients]
    assert diag.min() > lo and diag.max() < hi, (diag.min().item(), diag.max().item())
    polar = U @ V.T
    assert (O - polar).norm() / polar.norm() < max_rel


def test_batched_equals_per_matrix_and_scale_invariant():
    torch.manual_seed(0)
    X = torch.randn(3, 24, 40)
    B = msign(X)
    for i in range(3):
        torch.testing.assert_close(B[i], msign(X[i]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(msign(1e-3 * X), B, rtol=1e-4, atol=1e-5)
    # a tall input is handled by transposition: msign(Xᵀ) = msign(X)ᵀ
    torch.testing.assert_close(msign(X[0].T), B[0].T, rtol=1e-5, atol=1e-6)


def test_zero_input_and_dtype():
    assert torch.count_nonzero(msign(torch.zeros(8, 5))) == 0
    Xb = torch.randn(16, 8).to(torch.bfloat16)
    Ob = msign(Xb)
    assert Ob.dtype == torch.bfloat16
    torch.testing.assert_close(Ob.float(), msign(Xb.float()), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError):
        msign(torch.randn(4))
    with pytest.raises(ValueError):
        msign(torch.randn(4, 4), coefficients="nope")


def test_coefficient_schedules():
    quintic = COEFFICIENT_SETS["quintic"]
    assert coefficient_schedule("quintic", 7) == quintic + quintic[:2]  # cycles like emerging-optimizers
    pe = coefficient_schedule("polar_express", 10)
    a, b, c = pe[0]
    assert math.isclose(a, 8.28721 / 1.01) and math.isclose(b, -23.59589 / 1.01**3)
    assert math.isclose(c, 17.30039 / 1.01**5)
    assert pe[7:] == [(1.875, -1.25, 0.375)] * 3  # the unscaled final tuple repeats
    assert coefficient_schedule("simple", 3) == [(3.4445, -4.7750, 2.0315)] * 3


@pytest.mark.parametrize(
    "m,n,mode,expected",
    [
        (128, 32, "shape_up", 2.0), (32, 128, "shape_up", 2.0), (64, 64, "shape_up", 1.0),
        (128, 32, "spectral", math.sqrt(128)), (32, 128, "spectral", math.sqrt(128)),
        (128, 32, "unit_rms_norm", 2.0), (32, 128, "unit_rms_norm", 0.5),
        (128, 32, "shape_scaling", 2.0), (32, 128, "shape_scaling", 1.0),
        (128, 32, "none", 1.0),
    ],
)
def test_scale_factor(m, n, mode, expected):
    assert math.isclose(scale_factor(m, n, mode), expected)


def test_scale_factor_rejects_unknown_mode():
    with pytest.raises(ValueError):
        scale_factor(4, 4, "bogus")
