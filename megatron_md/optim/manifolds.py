"""Manifold Muon on Gram-constrained matrix manifolds (docs/optimizers.md §2), pure torch.

Geometries constrain the Gram matrix ``WᵀW`` of a tall matrix through a self-adjoint projector ``P``:
Stiefel (``P = Id``, ``WᵀW = I``), DGram (``P = Off``: orthogonal columns, free norms), Oblique
(``P = Diag``: unit columns) and the Frobenius sphere (``P(M) = tr(M)/n · I``: ``‖W‖_F = r``).
One step solves ``max ⟨G, A⟩ s.t. ‖A‖_op <= 1, P(WᵀA + AᵀW) = 0`` by gradient descent on the dual
``d(Λ) = ‖G + 2 W P(Λ)‖_*`` (``A(Λ) = msign(G + 2WP(Λ))``), then retracts ``W - lr·A``.

Wide matrices are transposed to tall and back, so for them the constraint is on ``WWᵀ`` (rows).
Every function takes 2-D ``[m, n]`` or batched 3-D ``[B, m, n]`` tensors (the same orientation for all).
The dual variable is ``n x n`` with ``n = min(m, n)`` of the matrix (``n²`` floats per matrix).

Measured (tests/optim/test_manifolds.py, K = 20, α = 0.1, gradient entries ~1e-2, W from a
``N(0, 1/n)`` init projected on the manifold): faithful Polar Express fp32 = the exact-SVD reference to
3 digits; RMS tangent violation of a cold faithful step: Stiefel 64x32 / 32x64 / 96x32 0.032 / 0.035 /
0.0037, DGram 0.25 / 0.23 / 0.29 (the figure depends on shape and on the spread of the DGram column
norms: the dual step is absolute, docs/optimizers.md §2.4). Fast mode (``manifold_muon_fast``: one msign per step, the
dual ascent amortised over steps) on a 768x256 momentum trajectory: violation 0.015 (Stiefel) and 0.030
(DGram) against faithful's 0.006 / 0.016, descent ⟨G, W - W⁺⟩ within 0.5-3% of faithful; on cold
steps within 3% of a converged (K = 2000) solve, where faithful is up to 6% short (DGram).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from .msign import msign

MsignFn = Callable[[torch.Tensor], torch.Tensor]
MANIFOLDS = ("stiefel", "dgram", "oblique", "sphere")
RETRACTIONS = ("exact", "ns")  # DGram fast-mode retraction: fp64 eigh of the Gram, or GEMM-only (retract_gram_ns)
_FLOOR = 1e-12  # norm floor: a zero column / matrix stays zero instead of producing NaN


def polar_express(steps: int = 10, dtype: torch.dtype = torch.float32) -> MsignFn:
    """The references' msign: Polar Express with ``steps`` iterations computed in ``dtype`` (bf16 in [MM-code])."""
    return functools.partial(msign, steps=steps, coefficients="polar_express", dtype=dtype)


def svd_polar(X: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Exact polar factor ``U Vᵀ`` by SVD (the reference msign for tests); returned in ``X.dtype``."""
    U, _, Vh = torch.linalg.svd(X.to(dtype), full_matrices=False)
    return (U @ Vh).to(X.dtype)


def _gram(W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``sym2(WᵀA) = WᵀA + AᵀW``."""
    M = W.mT @ A
    return M + M.mT


def _eye_like(M: torch.Tensor) -> torch.Tensor:
    return torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)


def host_branches(device: torch.device) -> bool:
    """Whether code may branch on a tensor's value on ``device``. On CPU reading a value costs nothing, so
    early exits and fallbacks are taken only when needed; elsewhere it drains the device queue, so the
    same result comes from masks (``torch.where``) instead. Tests patch this to check the masked path."""
    return device.type == "cpu"


def rms(M: torch.Tensor) -> torch.Tensor:
    """Per-matrix RMS over the last two axes (the reference's ``‖H‖_F / sqrt(numel)``)."""
    return M.square().mean(dim=(-2, -1)).sqrt()


# ----------------------------------------------------------------------------------------------------
# Geometries (all methods expect the TALL orientation, m >= n)


class Geometry:
    """A Gram-space constraint ``P(WᵀW) = P(T)``; subclasses give ``P``, the tangent map and a retraction."""

    name = "base"

    def project_gram(self, M: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tangent_dual(self, W: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
        """The multiplier Λ (symmetric, in the range of P) with ``G + 2WΛ`` = the tangent projection of G."""
        raise NotImplementedError

    def tangent(self, W: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
        """Orthogonal (Frobenius) projection of ``G`` onto ``{A : P(WᵀA + AᵀW) = 0}`` at a point ``W``."""
        return G + 2.0 * W @ self.tangent_dual(W, G)

    def retract(self, X: torch.Tensor, W: torch.Tensor | None = None, msign_fn: MsignFn | None = None) -> torch.Tensor:
        """Map ``X = W - lr·A`` back onto the manifold (``W`` = the point before the step, if needed)."""
        raise NotImplementedError

    def dual_init(self, W: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
        """[MM-code]'s Λ₀ = -¼ P(WᵀG + GᵀW): ``G + 2WΛ₀ = G - W·P(sym WᵀG)``, the tangent projection only
        when ``WᵀW = I`` (a DGram point with spread column norms starts far off; see ``tangent_dual``)."""
        return -0.25 * self.project_gram(_gram(W, G))

    def violation(self, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """``H = P(WᵀA + AᵀW)``: the dual (sub)gradient and the tangent-space violation of ``A``."""
        return self.project_gram(_gram(W, A))

    def init_on_manifold(self, W: torch.Tensor, msign_fn: MsignFn | None = None) -> torch.Tensor:
        return self.retract(W, None, msign_fn)


class Stiefel(Geometry):
    """``WᵀW = I``: all singular values 1; retraction = polar factor (msign)."""

    name = "stiefel"

    def project_gram(self, M):
        return M

    def tangent_dual(self, W, G):
        return -0.25 * _gram(W, G)

    def retract(self, X, W=None, msign_fn=None):
        return (msign_fn or polar_express())(X)


class DGram(Geometry):
    """``Off(WᵀW) = 0``: mutually orthogonal columns with free norms (``W = Q·D``).

    The default retraction reproduces [MM-code]: ``(U Vᵀ)·diag(σ)`` from an fp32 SVD, which hands the
    j-th LARGEST singular value to column j, i.e. re-sorts column norms descending at every step.
    ``column_preserving=True`` uses ``msign(X)·diag(‖x_j‖)`` so every column keeps its own norm.
    """

    name = "dgram"

    def __init__(self, column_preserving: bool = False, retraction: str = "exact"):
        if retraction not in RETRACTIONS:
            raise ValueError(f"unknown DGram retraction {retraction!r}; choose one of {RETRACTIONS}")
        self.column_preserving = column_preserving
        self.retraction = retraction

    def project_gram(self, M):
        return M * (1.0 - _eye_like(M))

    def tangent_dual(self, W, G):
        # Normal space is {W S : S symmetric, zero diagonal}; with WᵀW = D², Off(D²S + SD²) = Off(2 sym WᵀG)
        # gives S_ij = 2 sym(WᵀG)_ij / (d_i² + d_j²) and Λ = -S/2 (the reference Λ₀ when D = I).
        d2 = torch.diagonal(W.mT @ W, dim1=-2, dim2=-1)
        denom = (d2.unsqueeze(-1) + d2.unsqueeze(-2)).clamp_min(_FLOOR)
        return -0.5 * self.project_gram(_gram(W, G)) / denom

    def retract(self, X, W=None, msign_fn=None):
        if self.column_preserving:
            return (msign_fn or polar_express())(X) * X.norm(dim=-2, keepdim=True)
        work = torch.float64 if X.dtype == torch.float64 else torch.float32
        U, S, Vh = torch.linalg.svd(X.to(work), full_matrices=False)
        return ((U @ Vh) * S.unsqueeze(-2)).to(X.dtype)

    def retract_gram(self, X: torch.Tensor) -> torch.Tensor:
        """The same retraction from the fp64 eigendecomposition of the ``n x n`` Gram (fast mode): with
        ``XᵀX = V diag(σ²) Vᵀ``, ``U Vᵀ = X V diag(1/σ) Vᵀ``. Three times cheaper than a tall SVD on CPU
        and batched-friendly; directions with σ < 1e-6·σ_max (lost to fp64 squaring) are dropped.
        ``retraction="ns"`` computes it with GEMMs only instead (``retract_gram_ns``)."""
        if self.column_preserving:
            return self.retract(X)
        if self.retraction == "ns":
            return retract_gram_ns(X)
        X64 = X.to(torch.float64)
        lam, V = torch.linalg.eigh(X64.mT @ X64)  # ascending
        lam = lam.clamp_min(0.0)
        sig = lam.sqrt()
        keep = sig > 1e-6 * sig[..., -1:]
        inv = torch.where(keep, 1.0 / sig.clamp_min(_FLOOR), torch.zeros_like(sig))
        polar = X64 @ ((V * inv.unsqueeze(-2)) @ V.mT)
        return (polar * sig.flip(-1).unsqueeze(-2)).to(X.dtype)  # column j gets the j-th largest σ


def retract_gram_ns(X: torch.Tensor, steps: int = 3) -> torch.Tensor:
    """DGram retraction ``polar(X)·diag(σ↓)`` with GEMMs only, in ``X.dtype`` (no eigh, no host sync).

    The polar factor is ``X T`` with ``T = (XᵀX)^(-1/2)``, found in the ``n x n`` Gram space from
    ``T = diag(1/‖x_j‖)`` (unit columns: a point after a small step has nearly orthogonal ones). Each step
    applies ``T ← T (I + ½(I − TᵀGT) + K)``: a cubic Newton–Schulz step towards ``TᵀGT = I`` plus the skew
    ``K_ij = (H − Hᵀ)_ij / (h_i + h_j)``, ``H = TᵀG``, the diagonal Newton step that makes ``(XT)ᵀX``
    symmetric; both converge fast while the columns stay nearly orthogonal, whatever their norms.
    ``σ`` are the diagonal of ``(XT)ᵀX``, sorted descending (its eigenvalues to second order in its
    off-diagonal). Inputs whose normalised Gram has a Gershgorin bound above 2 are scaled into the
    iteration's basin first (they converge more slowly). Accuracy: tests/optim/test_manifolds.py."""
    G = X.mT @ X
    eye = _eye_like(G)
    c = 1.0 / torch.diagonal(G, dim1=-2, dim2=-1).sqrt().clamp_min(_FLOOR)
    bound = (G.abs() * c.unsqueeze(-1) * c.unsqueeze(-2)).sum(dim=-1).amax(dim=-1, keepdim=True)
    T = torch.diag_embed(c * (2.0 / bound.clamp_min(2.0)).sqrt())
    eye15 = (1.5 * eye).expand_as(G)  # fused multiply-adds below: 1.5 I - ½ H T (+ K) in one (b)addmm
    fma = torch.addmm if G.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        H = T.mT @ G
        h = torch.diagonal(H, dim1=-2, dim2=-1)
        K = (H - H.mT).div_((h.unsqueeze(-1) + h.unsqueeze(-2)).clamp_min_(_FLOOR))
        T = T @ fma(K.add_(eye15), H, T, alpha=-0.5)
    T = T @ fma(eye15, T.mT @ G, T, alpha=-0.5)  # a last orthonormalisation (its error is quadratic)
    sig = torch.diagonal(T.mT @ G, dim1=-2, dim2=-1).sort(dim=-1, descending=True).values
    return (X @ T) * sig.unsqueeze(-2)


class Oblique(Geometry):
    """``diag(WᵀW) = 1``: unit-norm columns; retraction = normalise each column."""

    name = "oblique"

    def project_gram(self, M):
        return M * _eye_like(M)

    def tangent_dual(self, W, G):
        c = (W * G).sum(dim=-2) / W.square().sum(dim=-2).clamp_min(_FLOOR)
        return torch.diag_embed(-0.5 * c)

    def retract(self, X, W=None, msign_fn=None):
        return X / X.norm(dim=-2, keepdim=True).clamp_min(_FLOOR)


class Sphere(Geometry):
    """Frobenius sphere ``‖W‖_F = r``: ``P(M) = tr(M)/n · I`` turns the scalar constraint ``⟨W, A⟩ = 0`` into
    the Gram framework. ``radius=None`` keeps the radius of the point before the step (``init_on_manifold``
    then uses MD's flat radius ``sqrt(max(m, n))``)."""

    name = "sphere"

    def __init__(self, radius: float | None = None):
        self.radius = radius

    def project_gram(self, M):
        tr = torch.diagonal(M, dim1=-2, dim2=-1).mean(dim=-1)
        return tr[..., None, None] * _eye_like(M)

    def tangent_dual(self, W, G):
        c = (W * G).sum(dim=(-2, -1), keepdim=True) / W.square().sum(dim=(-2, -1), keepdim=True).clamp_min(_FLOOR)
        return -0.5 * c * torch.eye(W.shape[-1], dtype=W.dtype, device=W.device)

    def retract(self, X, W=None, msign_fn=None):
        if self.radius is not None:
            r = torch.full_like(X[..., :1, :1], self.radius)
        elif W is not None:
            r = W.norm(dim=(-2, -1), keepdim=True)
        else:
            r = torch.full_like(X[..., :1, :1], math.sqrt(max(X.shape[-2:])))
        return X * (r / X.norm(dim=(-2, -1), keepdim=True).clamp_min(_FLOOR))


def get_geometry(manifold: str | Geometry, column_preserving: bool = False, radius: float | None = None,
                 retraction: str = "exact") -> Geometry:
    """Geometry object for a name in ``MANIFOLDS`` (a Geometry passes through)."""
    if isinstance(manifold, Geometry):
        return manifold
    if manifold == "stiefel":
        return Stiefel()
    if manifold == "dgram":
        return DGram(column_preserving, retraction)
    if manifold == "oblique":
        return Oblique()
    if manifold == "sphere":
        return Sphere(radius)
    raise ValueError(f"unknown manifold {manifold!r}; choose one of {MANIFOLDS} (or 'none' for plain Muon)")


# ----------------------------------------------------------------------------------------------------
# Orientation: work tall, hand back in the caller's orientation


def is_wide(W: torch.Tensor) -> bool:
    return W.shape[-2] < W.shape[-1]


def _tall(*ts: torch.Tensor) -> tuple[bool, list[torch.Tensor]]:
    wide = is_wide(ts[0])
    return wide, [t.mT if wide else t for t in ts]


def tangent(W: torch.Tensor, G: torch.Tensor, manifold: str | Geometry) -> torch.Tensor:
    """Tangent projection of ``G`` at ``W`` in the caller's orientation (wide: the ``WWᵀ`` constraint)."""
    wide, (Wt, Gt) = _tall(W, G)
    A = get_geometry(manifold).tangent(Wt, Gt)
    return A.mT if wide else A


def tangent_violation(W: torch.Tensor, A: torch.Tensor, manifold: str | Geometry) -> torch.Tensor:
    """Per-matrix RMS of ``P(WᵀA + AᵀW)`` (tall orientation), computed in fp64."""
    wide, (Wt, At) = _tall(W.double(), A.double())
    return rms(get_geometry(manifold).violation(Wt, At))


def retract(X: torch.Tensor, manifold: str | Geometry, W: torch.Tensor | None = None,
            msign_fn: MsignFn | None = None, **geometry_kw) -> torch.Tensor:
    """Retraction in the caller's orientation."""
    wide, ts = _tall(X, *(() if W is None else (W,)))
    R = get_geometry(manifold, **geometry_kw).retract(ts[0], ts[1] if W is not None else None, msign_fn)
    return R.mT if wide else R


def init_on_manifold(W: torch.Tensor, manifold: str | Geometry, msign_fn: MsignFn | None = None,
                     **geometry_kw) -> torch.Tensor:
    """Project an initial weight onto the manifold (wide matrices transposed, as [MM-code])."""
    wide, (Wt,) = _tall(W)
    if Wt.dtype in (torch.bfloat16, torch.float16):
        Wt = Wt.float()  # SVD / column norms in fp32, stored back in the param's dtype
    R = get_geometry(manifold, **geometry_kw).init_on_manifold(Wt, msign_fn).to(W.dtype)
    return R.mT if wide else R


# ----------------------------------------------------------------------------------------------------
# Dual solve


@torch.no_grad()
def dual_solve(
    W: torch.Tensor,
    G: torch.Tensor,
    manifold: str | Geometry,
    dual_steps: int = 20,
    dual_lr: float = 0.1,
    tol: float = 1e-6,
    msign_fn: MsignFn | None = None,
    dual_init: torch.Tensor | None = None,
    final_msign_fn: MsignFn | None = None,
) -> tuple[torch.Tensor, dict]:
    """Spectral-norm steepest direction on the tangent space of ``W`` for the gradient ``G`` (2-D or 3-D).

    Reference loop ([MM-code] ``manifold_muon``): ``A_k = msign(G + 2WP(Λ_k))``, ``H_k = P(WᵀA_k + A_kᵀW)``;
    stop when RMS(H_k) < tol, else ``Λ ← Λ - dual_lr·(1 - k/K)·H_k``. Batched inputs stop per matrix (a
    converged matrix's Λ is frozen). ``final_msign_fn`` recomputes ``A`` from the final Λ with an accurate
    msign (fast mode, whose loop uses a cheap one). Returns ``A`` and ``info`` = {"iters": per-matrix
    iteration counts, "rms_violation": RMS(H) of the returned A, "dual": final Λ (for warm start)}.
    Wide inputs are solved transposed (``A`` comes back wide; Λ and ``dual_init`` are ``min(m, n)`` square).
    """
    wide, (W, G) = _tall(W, G)
    geo = get_geometry(manifold)
    msign_fn = msign_fn or polar_express()
    P = geo.project_gram
    Lam = geo.dual_init(W, G) if dual_init is None else dual_init.to(W.dtype).clone()
    active = torch.ones(W.shape[:-2], dtype=torch.bool, device=W.device)
    iters = torch.zeros(W.shape[:-2], dtype=torch.int64, device=W.device)
    A = H = None
    for k in range(dual_steps):
        A = msign_fn(G + 2.0 * W @ P(0.5 * (Lam + Lam.mT)))
        H = geo.violation(W, A)
        iters += active
        active = active & (rms(H) >= tol)
        # the early exit only skips iterations that the mask makes no-ops (a converged Λ is frozen)
        if k + 1 < dual_steps and host_branches(W.device) and not bool(active.any()):
            break
        step = dual_lr * (1.0 - k / dual_steps)
        Lam = Lam - step * H * active[..., None, None].to(H.dtype)
    if A is None or final_msign_fn is not None:
        A = (final_msign_fn or msign_fn)(G + 2.0 * W @ P(0.5 * (Lam + Lam.mT)))
        H = geo.violation(W, A)
    return (A.mT if wide else A), {"iters": iters, "rms_violation": rms(H), "dual": Lam}


def _oriented_solve(W, G, geo, lr, solve_kw, retract_msign):
    """Tall orientation, dual solve, step and retraction; hands back (W⁺, A, info) in the caller's orientation."""
    wide, (Wt, Gt) = _tall(W, G)
    A, info = dual_solve(Wt, Gt, geo, **solve_kw)
    Wn = geo.retract(Wt - lr * A, Wt, retract_msign)
    if wide:
        Wn, A = Wn.mT, A.mT
    return Wn, A, info


def _work(W: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dt = torch.float64 if W.dtype == torch.float64 else torch.float32
    return W.to(dt), G.to(dt)


@torch.no_grad()
def manifold_muon(
    W: torch.Tensor,
    G: torch.Tensor,
    manifold: str | Geometry,
    lr: float,
    dual_steps: int = 20,
    dual_lr: float = 0.1,
    tol: float = 1e-6,
    *,
    msign_fn: MsignFn | None = None,
    msign_steps: int = 10,
    msign_dtype: torch.dtype = torch.float32,
    column_preserving: bool = False,
    radius: float | None = None,
    return_info: bool = False,
):
    """One faithful Manifold Muon step ([MM-code] ``manifold_muon``): returns the new ``W`` (same dtype).

    ``manifold="none"`` is the plain Muon step ``W - lr·msign(G)``. ``msign_fn`` replaces the Polar
    Express msign everywhere (loop and Stiefel retraction), e.g. ``svd_polar`` for an exact reference;
    otherwise Polar Express with ``msign_steps`` in ``msign_dtype`` (the reference used bf16).
    ``return_info=True`` returns ``(W⁺, A, info)`` with ``A`` the unit-spectral-norm direction.
    """
    fn = msign_fn or polar_express(msign_steps, msign_dtype)
    Wf, Gf = _work(W, G)
    if manifold == "none":
        A = fn(Gf)
        Wn, info = Wf - lr * A, {"iters": 0, "rms_violation": torch.zeros(()), "dual": None}
    else:
        geo = get_geometry(manifold, column_preserving, radius)
        kw = dict(dual_steps=dual_steps, dual_lr=dual_lr, tol=tol, msign_fn=fn)
        Wn, A, info = _oriented_solve(Wf, Gf, geo, lr, kw, fn)
    Wn = Wn.to(W.dtype)
    return (Wn, A, info) if return_info else Wn


def near_orthogonal_polar(X: torch.Tensor, steps: int = 3, fallback: MsignFn | None = None,
                          tol: float = 1e-3) -> torch.Tensor:
    """Polar factor of a tall ``X`` whose singular values are already near 1 (a Stiefel point plus a small
    step): cubic Newton–Schulz ``X ← X(3I - XᵀX)/2`` from ``X`` itself converges quadratically there
    (σ = 1 ± ε → 1 ± 1.5ε²), where a Frobenius-normalised Polar Express needs ~10 steps. Inputs that are
    not near-orthogonal after ``steps`` (max |XᵀX - I| > ``tol``, or not finite) are recomputed with
    ``fallback`` (the whole batch, when any is). Without ``host_branches`` the fallback is always computed
    and selected by ``torch.where``: the same result, no host sync, one msign more per matrix."""
    Y = X
    eye = _eye_like(Y.mT @ Y)
    for _ in range(steps):
        Y = Y @ (1.5 * eye - 0.5 * (Y.mT @ Y))
    err = (Y.mT @ Y - eye).abs().amax(dim=(-2, -1))
    bad = (~(err <= tol)).any()  # NaN counts as bad
    if host_branches(X.device):
        return (fallback or polar_express())(X) if bool(bad) else Y
    return torch.where(bad, (fallback or polar_express())(X), Y)


@torch.no_grad()
def manifold_muon_fast(
    W: torch.Tensor,
    G: torch.Tensor,
    manifold: str | Geometry,
    lr: float,
    dual: torch.Tensor | None = None,
    dual_steps: int = 1,
    dual_lr: float = 0.02,
    tol: float = 1e-6,
    *,
    msign_steps: int = 8,
    msign_dtype: torch.dtype = torch.float32,
    msign_fn: MsignFn | None = None,
    column_preserving: bool = False,
    radius: float | None = None,
    retraction: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Fast Manifold Muon on one matrix or a stack ``[B, m, n]`` of same-shape matrices: the dual ascent
    is amortised over optimizer steps instead of restarted at every step.

    * Start: ``Λ = Λ₀ + g·C`` with ``Λ₀`` the exact tangent-projection multiplier of the new gradient
      (``Geometry.tangent_dual``), ``C`` the correction carried from the previous step (``dual``) and
      ``g = ‖G‖_F/√n`` (C is kept relative to the gradient's scale; a zero gradient gives a zero step).
    * ``dual_steps`` (default 1) iterations of ``A = msign(X)``, ``X = G + 2WP(Λ)``, ``H = P(WᵀA + AᵀW)``,
      ``Λ_ij ← Λ_ij - dual_lr·s·H_ij/(d_i² + d_j²)`` with ``s = ‖X‖_F/√n`` and ``d² = diag(WᵀW)``: the
      step is a diagonal Newton step for the dual (∂H_ij/∂Λ_ij ≈ 2(d_i²+d_j²)/σ), so it does not depend
      on the gradient's scale or on DGram column norms, unlike the reference's absolute ``dual_lr``
      (docs/optimizers.md §2.4); the last update is kept as the next step's ``C`` (the returned ``A`` is from the last msign).
    * msign is Polar Express with ``msign_steps``; the Stiefel retraction is ``near_orthogonal_polar``,
      the DGram one ``DGram.retract_gram`` (the reference's retraction without a tall SVD; ``retraction``
      "exact": from an fp64 eigh, "ns": GEMMs only).
    Returns ``(W⁺, C, info)``; ``C`` is ``[.., n, n]`` with ``n = min(m, n)``. No host sync where
    ``host_branches`` is false: the logging figures in ``info`` stay tensors.
    """
    fn = msign_fn or polar_express(msign_steps, msign_dtype)
    geo = get_geometry(manifold, column_preserving, radius, retraction)
    Wf, Gf = _work(W, G)
    wide, (Wt, Gt) = _tall(Wf, Gf)
    P = geo.project_gram
    lam0 = geo.tangent_dual(Wt, Gt)
    # C is stored relative to the gradient's scale: a gradient that shrinks (or vanishes) shrinks it alike
    gscale = (Gt.norm(dim=(-2, -1), keepdim=True) / math.sqrt(Gt.shape[-1])).clamp_min(_FLOOR)
    Lam = lam0 if dual is None else lam0 + gscale * dual.to(lam0.dtype)
    d2 = Wt.square().sum(dim=-2)  # diag(WᵀW) without the n x n Gram
    denom = (d2.unsqueeze(-1) + d2.unsqueeze(-2)).clamp_min(_FLOOR)
    active = torch.ones(Wt.shape[:-2], dtype=torch.bool, device=Wt.device)
    iters = torch.zeros(Wt.shape[:-2], dtype=torch.int64, device=Wt.device)
    A = H = None
    for k in range(dual_steps):
        X = Gt + 2.0 * Wt @ P(0.5 * (Lam + Lam.mT))
        A_k = fn(X)
        H_k = geo.violation(Wt, A_k)
        mask = active[..., None, None]
        A = A_k if A is None else torch.where(mask, A_k, A)
        H = H_k if H is None else torch.where(mask, H_k, H)
        iters += active
        scale = X.norm(dim=(-2, -1), keepdim=True) / math.sqrt(X.shape[-1])
        Lam = Lam - (dual_lr * scale * H_k / denom) * mask.to(H_k.dtype)
        active = active & (rms(H_k) >= tol)
        # the early exit skips only masked no-op iterations; none to skip after the last one
        if k + 1 < dual_steps and host_branches(Wt.device) and not bool(active.any()):
            break
    if isinstance(geo, DGram):
        Wn = geo.retract_gram(Wt - lr * A)
    else:
        retract_fn = functools.partial(near_orthogonal_polar, fallback=fn) if isinstance(geo, Stiefel) else fn
        Wn = geo.retract(Wt - lr * A, Wt, retract_fn)
    correction = (Lam - lam0) / gscale
    info = {"iters": iters, "rms_violation": rms(H), "dual": correction}
    return (Wn.mT if wide else Wn).to(W.dtype), correction, info


# ----------------------------------------------------------------------------------------------------
# Diagnostics ([MM-code] logs these per Muon matrix at every eval)


@torch.no_grad()
def diagnostics(W: torch.Tensor) -> dict[str, float]:
    """σ_max, σ_min, ‖Off(WᵀW)‖_F and ‖W‖_F of a 2-D matrix (tall orientation; fp32 SVD values)."""
    Wt = (W.mT if is_wide(W) else W).to(torch.float32)
    sv = torch.linalg.svdvals(Wt)
    gram = Wt.mT @ Wt
    off = gram - torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1))
    return {
        "sigma_max": float(sv.max()),
        "sigma_min": float(sv.min()),
        "off_gram_norm": float(off.norm()),
        "fro_norm": float(Wt.norm()),
    }
