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


def _descend_rows(W, row, col, exp_avg, denom, decay: torch.Tensor, alpha: torch.Tensor, rows_sq):
    # md_batched.descend_'s recovery, decay and Adam step, then the rows' squared norms, as one loop over the
    # matrix (rows are short: each one's sum stays in cache)
    w = W
    if row is not None:
        w = w / row
    if col is not None:
        w = w / col
    w = w * decay + alpha * (exp_avg / denom)
    W.copy_(w)
    rows_sq.copy_((w * w).sum(dim=-1, keepdim=True))


def descend_rows_(W: torch.Tensor, gains: tuple, decay: float, exp_avg: torch.Tensor, denom: torch.Tensor,
                  alpha: float) -> torch.Tensor | None:
    """For one big matrix (or a stack of one): ``W <- (W ⊘ row ⊘ col)·decay + alpha·m/denom`` in place (``gains``:
    the clamped (row, column) factors, None where absent) and the rows' squared norms of the result, ``[..., m, 1]``,
    in one compiled kernel; None when the kernel is off, failed or the matrix is small (the caller runs eager)."""
    if not _compiling(W.numel()):
        return None
    try:
        rows_sq = torch.empty((*W.shape[:-1], 1), dtype=W.dtype, device=W.device)
        if gains[0] is None and gains[1] is None:
            # x / 1 is exact, and inductor's kernel for the bare update measured 5x slower on CPU (90 vs 18 ms at
            # 131072 x 512) than with a row of divisors
            gains = (torch.ones_like(rows_sq), None)
        scalars = torch.tensor([decay, alpha], dtype=W.dtype, device=W.device)  # tensors: no recompile per step
        _compiled(_descend_rows)(W, gains[0], gains[1], exp_avg, denom, scalars[0], scalars[1], rows_sq)
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
