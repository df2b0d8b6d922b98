"""Approximate matrix sign (polar factor) by odd quintic Newton-Schulz iterations, and Muon scale factors.

``msign(X) = U Vᵀ`` for ``X = U Σ Vᵀ``. The iteration ``X <- aX + (bA + cA²)X`` with ``A = XXᵀ`` applies the
odd polynomial ``p(σ) = aσ + bσ³ + cσ⁵`` to every singular value while keeping the singular vectors, so
after normalising ``‖X‖_op <= 1`` a few steps push all singular values towards 1 (docs/optimizers.md §3.1).
Pure torch, no process groups: tensor-parallel callers orthogonalise full (gathered) blocks themselves.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

Coeffs = tuple[float, float, float]

# Keller Jordan's single tuple, applied every step; output singular values land in roughly (0.5, 1.5).
_SIMPLE: list[Coeffs] = [(3.4445, -4.7750, 2.0315)]

# emerging-optimizers / Megatron "quintic" (the Megatron default); cycled when steps > 5.
_QUINTIC: list[Coeffs] = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]

# Polar Express (Amsel et al. 2025) as used by the Manifold Muon references. Every tuple but the final
# (1.875, -1.25, 0.375) is shrunk by the safety factors (1.01, 1.01³, 1.01⁵) so rounding never pushes a
# singular value past the polynomial's stable range; the final tuple repeats for any further steps.
_PE_RAW: list[Coeffs] = [
    (8.28721, -23.59589, 17.30039),
    (4.10706, -2.94785, 0.54484),
    (3.94869, -2.90890, 0.55182),
    (3.31842, -2.48849, 0.51005),
    (2.30065, -1.66890, 0.41881),
    (1.89130, -1.26800, 0.37680),
    (1.87500, -1.25000, 0.37500),
]
_PE_SAFETY = 1.01
_POLAR_EXPRESS: list[Coeffs] = [
    (a / _PE_SAFETY, b / _PE_SAFETY**3, c / _PE_SAFETY**5) for a, b, c in _PE_RAW
] + [(1.875, -1.25, 0.375)]

COEFFICIENT_SETS: dict[str, list[Coeffs]] = {
    "simple": _SIMPLE,
    "quintic": _QUINTIC,
    "polar_express": _POLAR_EXPRESS,
}
# Steps used when the caller passes steps=None.
DEFAULT_STEPS: dict[str, int] = {"simple": 5, "quintic": 5, "polar_express": 10}

# On CPU, torch's batched GEMM (bmm/baddbmm) was measured slower than a loop of 2-D GEMMs once a matrix has
# more than 2^15 elements (2 threads, fp32: 128 x 256x256 343 vs 216 ms, 12 x 4096x512 1047 vs 796 ms; 128 x
# 256x128 58 vs 78 ms, 64 x 64x128 3.7 vs 12 ms), so there the orthogonalisation engine runs a bucket of bigger
# matrices one by one, and the batched MD step does not stack them (md_batched.bucket_key).
CPU_BATCH_MAX_ELEMENTS = 1 << 15


def coefficient_schedule(coefficients: str | Sequence[Coeffs], steps: int) -> list[Coeffs]:
    """The (a, b, c) tuple of every step: "simple"/"quintic"/custom lists cycle, Polar Express repeats its last."""
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(
                f"unknown msign coefficients {coefficients!r}; choose one of {sorted(COEFFICIENT_SETS)}"
            )
        table = COEFFICIENT_SETS[coefficients]
        repeat_last = coefficients == "polar_express"
    else:
        table = [tuple(float(v) for v in t) for t in coefficients]  # type: ignore[misc]
        if not table or any(len(t) != 3 for t in table):
            raise ValueError("custom msign coefficients must be a non-empty list of (a, b, c) tuples")
        repeat_last = False
    if repeat_last:
        return [table[min(i, len(table) - 1)] for i in range(steps)]
    return [table[i % len(table)] for i in range(steps)]


def msign(
    X: torch.Tensor,
    steps: int | None = 5,
    coefficients: str | Sequence[Coeffs] = "quintic",
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Approximate polar factor of a 2-D ``[m, n]`` or batched 3-D ``[B, m, n]`` tensor.

    The input is normalised by its Frobenius norm (per matrix), so the result does not depend on the
    input's scale. Computed in ``dtype`` (fp32 by default), returned in ``X.dtype``. ``steps=None`` takes
    the set's usual count (5, or 10 for Polar Express). A zero matrix maps to zero.
    """
    if X.ndim not in (2, 3):
        raise ValueError(f"msign expects a 2-D or batched 3-D tensor, got shape {tuple(X.shape)}")
    if steps is None:
        steps = DEFAULT_STEPS.get(coefficients, 5) if isinstance(coefficients, str) else 5
    if steps < 0:
        raise ValueError(f"msign steps must be >= 0, got {steps}")
    schedule = coefficient_schedule(coefficients, steps)

    Y = X.to(dtype)
    # Work on the wide orientation: the Gram matrix XXᵀ is then min(m, n) square, the cheaper side.
    transposed = Y.size(-2) > Y.size(-1)
    if transposed:
        Y = Y.mT
    norm = torch.linalg.matrix_norm(Y, ord="fro", keepdim=True)
    if coefficients == "polar_express":
        norm = norm * _PE_SAFETY  # PE's input safety margin: ‖X‖_op strictly below 1
    Y = Y / (norm + eps)
    # Fused multiply-adds: B = bA + cA², Y = aY + BY (addmm for 2-D, baddbmm for batched).
    fma = torch.addmm if Y.ndim == 2 else torch.baddbmm
    for a, b, c in schedule:
        A = Y @ Y.mT
        B = fma(A, A, A, beta=b, alpha=c)
        Y = fma(Y, B, Y, beta=a, alpha=1.0)
    if transposed:
        Y = Y.mT
    return Y.to(X.dtype)


def scale_factor(m: int, n: int, mode: str = "shape_up") -> float:
    """Factor multiplying ``msign(U)`` of an ``m x n`` (global) matrix in the Muon update (docs/optimizers.md §3.2).

    ``shape_up`` gives ``‖s·msign(U)‖_F = sqrt(max(m, n))``, the flat-sphere radius, so the relative
    update of an MD matrix equals the learning rate.
    """
    if m <= 0 or n <= 0:
        raise ValueError(f"scale_factor needs positive dimensions, got {m}x{n}")
    if mode == "shape_up":
        return math.sqrt(max(m, n) / min(m, n))
    if mode == "spectral":
        return math.sqrt(max(m, n))
    if mode == "unit_rms_norm":
        return math.sqrt(m / n)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, m / n))
    if mode == "none":
        return 1.0
    raise ValueError(
        f"unknown scale_mode {mode!r}; choose shape_up, spectral, unit_rms_norm, shape_scaling or none"
    )
