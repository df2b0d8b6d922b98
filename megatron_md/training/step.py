"""One training step's pieces: the loss function, megatron's forward_step, loss reduction, finiteness."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def loss_func(loss_mask: torch.Tensor, nan_now: bool, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    if nan_now:
        loss_sum = loss_sum * float("nan")
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def make_forward_step(nan_now: bool):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return out, functools.partial(loss_func, batch["loss_mask"], nan_now)

    return forward_step


def reduce_loss(losses: list[dict]) -> float | None:
    """Token-weighted mean loss over micro-batches and data-parallel ranks (last stage only)."""
    if not ps.is_pipeline_last_stage():
        return None
    total = torch.zeros(2, dtype=torch.float64)
    for d in losses:
        total += d["lm loss"].detach().double().cpu()
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        total = total.cuda()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item()


def all_finite(model, loss: float | None) -> bool:
    """Every rank agrees whether this step's loss and gradients are finite."""
    bad = 0.0 if loss is None or math.isfinite(loss) else 1.0
    if not bad:
        for p in model.parameters():
            g = getattr(p, "main_grad", None)
            g = g if g is not None else p.grad
            if g is not None and not torch.isfinite(g).all():
                bad = 1.0
                break
    flag = torch.tensor([bad], device=next(model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0
