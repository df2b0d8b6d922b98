"""Adam pieces of the MD step (the Adam base on Ĝ, Adam on the raw gains), and a compiled kernel for big matrices.

The Adam base's moment update and denominator read Ĝ and both moments and write three matrices; eager torch
makes five passes (lerp, mul, addcmul, sqrt, add), one fused kernel makes one. Measured on the
``dense-181m`` embedding shape (131072 x 512, fp32, 2 CPU threads): 134 ms eager, 78 ms compiled, results
equal to 5e-10. Only matrices of at least ``COMPILE_MIN_ELEMENTS`` take the compiled path (embedding and LM
head at real vocabularies): compiling costs seconds per shape, which small matrices never earn back.
``set_compile("off")`` (``--md-compile off``) keeps everything eager; a compile failure (no C++ compiler, no
Triton) logs once and falls back to eager for the rest of the process.
"""

from __future__ import annotations

import logging
import math

import torch

COMPILE_MIN_ELEMENTS = 1 << 22
MODES = ("auto", "off")
_state = {"mode": "auto", "failed": False, "fns": {}}
log = logging.getLogger(__name__)


def set_compile(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"--md-compile {mode!r}: choose one of {MODES}")
    _state["mode"] = mode


def adam_moments_(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, beta1: float,
                  beta2: float) -> None:
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)


def adam_denominator(exp_avg_sq: torch.Tensor, step: int | float, beta2: float, eps: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``sqrt(v) + eps·sqrt(1-β2^t)``: with it ``m̂/(sqrt(v̂)+eps) = (sqrt(1-β2^t)/(1-β1^t)) · m / denom``
    (torch's Adam rewrite: two passes instead of four)."""
    return torch.sqrt(exp_avg_sq, out=out).add_(eps * math.sqrt(1.0 - beta2**step))


def _moments_and_denominator(grad, exp_avg, exp_avg_sq, beta1: float, beta2: float, eps_c: torch.Tensor,
                             out: torch.Tensor):
    # Functional body with copies back: inductor fuses it into one loop over the five matrices. The result goes
    # to ``out``, the caller's: a fresh matrix-sized result would cost a page fault per page on CPU every step.
    m = exp_avg + (1.0 - beta1) * (grad - exp_avg)
    v = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    out.copy_(v.sqrt() + eps_c)


def _compiled(fn=None):
    fn = _moments_and_denominator if fn is None else fn
    if fn not in _state["fns"]:
        _state["fns"][fn] = torch.compile(fn, dynamic=False)
    return _state["fns"][fn]


def _compiling(numel: int) -> bool:
    return _state["mode"] == "auto" and not _state["failed"] and numel >= COMPILE_MIN_ELEMENTS


def _failed(e: Exception) -> None:
    _state["failed"] = True
    log.warning("torch.compile of the MD Adam kernel failed (%s: %s); using eager kernels",
                type(e).__name__, str(e).splitlines()[0] if str(e) else "")


def adam_moments_and_denominator(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                                 step: int | float, betas: tuple[float, float], eps: float,
                                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Update both moments in place and return ``adam_denominator`` (into ``out`` on the eager path)."""
    b1, b2 = betas
    if _compiling(grad.numel()):
        try:
            # eps·sqrt(1-β2^t) changes every step: a tensor, so it is not baked into the kernel (a Python
            # float would recompile it each step)
            eps_c = torch.tensor(eps * math.sqrt(1.0 - b2**step), dtype=grad.dtype, device=grad.device)
            out = torch.empty_like(exp_avg_sq) if out is None else out
            _compiled()(grad, exp_avg, exp_avg_sq, b1, b2, eps_c, out)
            return out
        except Exception as e:  # noqa: BLE001 (any compile failure: eager is the reference)
            _failed(e)
    adam_moments_(grad, exp_avg, exp_avg_sq, b1, b2)
    return adam_denominator(exp_avg_sq, step, b2, eps, out=out)


def _step_rows(W, G, row, col, row_div, col_div, exp_avg, exp_avg_sq, beta1: float, beta2: float,
               scalars: torch.Tensor, rows_sq):
    # md_batched's Adam-base step of one matrix in one loop: Ĝ = G ⊙ gains, the moments, Ŵ recovered (clamped
    # gains) and decayed, the step m / (sqrt(v) + eps_c), and the rows' squared norms of the result
    eps_c, decay, alpha = scalars[0], scalars[1], scalars[2]
    g = G
    if row is not None:
        g = g * row
    if col is not None:
        g = g * col
    m = exp_avg + (1.0 - beta1) * (g - exp_avg)
    v = exp_avg_sq * beta2 + (1.0 - beta2) * g * g
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    w = W
    if row_div is not None:
        w = w / row_div
    if col_div is not None:
        w = w / col_div
    w = w * decay + alpha * (m / (v.sqrt() + eps_c))
    W.copy_(w)
    rows_sq.copy_((w * w).sum(dim=-1, keepdim=True))


def compiles(numel: int) -> bool:
    """Whether a matrix of ``numel`` elements takes the compiled kernels (``--md-compile``, size, no failure)."""
    return _compiling(numel)


def adam_step_rows_(W: torch.Tensor, G: torch.Tensor, gains: tuple, divisors: tuple, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, step: int | float, betas: tuple[float, float], eps: float,
                    decay: float, alpha_per_step: float) -> torch.Tensor | None:
    """The MD Adam base's whole step of one big matrix (stacks of one, ``[1, m, n]``) in one compiled pass:
    ``Ĝ = G ⊙ gains`` (row, column factors; None where absent), the moments in place, then
    ``W <- (W ⊘ divisors)·decay - lr_t·m/(sqrt(v)+eps_t)`` in place (``alpha_per_step``: ``-lr·radius_scale``, times
    Adam's step size here), returning the rows' squared norms ``[1, m, 1]``. None when the kernel is off, failed
    or the matrix is small: the caller then runs the eager phases (nothing was written)."""
    if not _compiling(W.numel()):
        return None
    b1, b2 = betas
    try:
        rows_sq = torch.empty((*W.shape[:-1], 1), dtype=W.dtype, device=W.device)
        if divisors[0] is None and divisors[1] is None:
            # x / 1 is exact, and inductor's kernel without a divisor measured 5x slower on CPU (90 vs 18 ms at
            # 131072 x 512)
            divisors = (torch.ones_like(rows_sq), None)
        # tensors, not Python floats: they change every step, and a float would recompile the kernel
        scalars = torch.tensor([eps * math.sqrt(1.0 - b2**step), decay, alpha_per_step * adam_step_size(step, betas)],
                               dtype=W.dtype, device=W.device)
        _compiled(_step_rows)(W, G, gains[0], gains[1], divisors[0], divisors[1], exp_avg, exp_avg_sq, b1, b2,
                              scalars, rows_sq)
        return rows_sq
    except Exception as e:  # noqa: BLE001 (any compile failure: eager is the reference)
        _failed(e)
        return None


def adam_(
    theta: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int | float,
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0, bias_correction: bool = True,
) -> None:
    """Adam with decoupled weight decay, in place (docs/optimizers.md §3.3); step counts from 1.
    ``bias_correction=False`` drops the ``1-β^t`` factors: ``m / (sqrt(v) + eps)``."""
    if weight_decay:
        theta.mul_(1.0 - lr * weight_decay)
    if not bias_correction:
        adam_moments_(grad, exp_avg, exp_avg_sq, *betas)
        denom = torch.sqrt(exp_avg_sq).add_(eps)
        theta.sub_(torch.div(exp_avg, denom, out=denom), alpha=lr)
        return
    theta.sub_(adam_direction(grad, exp_avg, exp_avg_sq, step, betas, eps), alpha=lr)


def adam_foreach_(
    thetas: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
    step: int | float, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
    bias_correction: bool = True,
) -> None:
    """``adam_`` on lists of tensors with one foreach op per stage: the same elementwise arithmetic in the same
    order, so every element equals ``adam_``'s bit for bit, in a number of launches independent of the list."""
    b1, b2 = betas
    if weight_decay:
        torch._foreach_mul_(thetas, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - b1)
    torch._foreach_mul_(exp_avg_sqs, b2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - b2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, eps if not bias_correction else eps * math.sqrt(1.0 - b2**step))
    update = torch._foreach_div(exp_avgs, denom)
    if bias_correction:
        torch._foreach_mul_(update, adam_step_size(step, betas))
    torch._foreach_sub_(thetas, update, alpha=lr)


def adam_step_size(step: int | float, betas: tuple[float, float]) -> float:
    """The factor ``sqrt(1-β2^t)/(1-β1^t)`` that multiplies ``m / adam_denominator``."""
    return math.sqrt(1.0 - betas[1] ** step) / (1.0 - betas[0] ** step)


def adam_direction(
    grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int | float,
    betas: tuple[float, float], eps: float,
) -> torch.Tensor:
    """Update the moments in place and return m̂ / (sqrt(v̂) + eps)."""
    adam_moments_(grad, exp_avg, exp_avg_sq, *betas)
    denom = adam_denominator(exp_avg_sq, step, betas[1], eps)
    return torch.div(exp_avg, denom, out=denom).mul_(adam_step_size(step, betas))
