"""One training step's pieces: the loss function, megatron's forward_step, loss reduction, finiteness."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_md.mcore.timing import timed


def loss_func(loss_mask: torch.Tensor, nan_now: bool, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    if nan_now:
        loss_sum = loss_sum * float("nan")
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def make_forward_step(nan_now: bool, timers=None):
    def forward_step(data_iterator, model):
        with timed(timers, "batch-generator"):  # the wait for the loader (and the TP broadcast)
            batch = next(data_iterator) or {}  # (middle pipeline stages get none: they take activations)
        out = model(batch.get("tokens"), batch.get("position_ids"), batch.get("attention_mask"),
                    labels=batch.get("labels"))
        return out, functools.partial(loss_func, batch.get("loss_mask"), nan_now)

    return forward_step


def reduce_loss(losses: list[dict]) -> float | None:
    """Token-weighted mean loss over micro-batches and data-parallel ranks (last stage only).

    The sum stays on the losses' device (no copy per micro-batch); one host sync, the ``.item()``.
    """
    if not ps.is_pipeline_last_stage():
        return None
    device = losses[0]["lm loss"].device if losses else torch.device("cpu")
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for d in losses:
        total += d["lm loss"].detach().double()
    nccl = torch.cuda.is_available() and dist.get_backend() == "nccl"
    if nccl and total.device.type != "cuda":
        total = total.cuda()
    elif not nccl and total.device.type != "cpu":  # gloo reduces host tensors
        total = total.cpu()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item()


def _ddp_grad_buffers(chunk) -> list[torch.Tensor]:
    """The contiguous ``grad_data`` tensors of a megatron DDP chunk (dense and expert-parallel)."""
    out = []
    for name in ("buffers", "expert_parallel_buffers"):
        bufs = getattr(chunk, name, None)
        if isinstance(bufs, (list, tuple)):  # nn.Module.buffers is a method: not a DDP chunk
            out += [b.grad_data for b in bufs if getattr(b, "grad_data", None) is not None]
    return out


def _grad_tensors(model) -> list[torch.Tensor]:
    """Every gradient of ``model`` (a module or a list of chunks) as few tensors as possible.

    Megatron DDP keeps ``main_grad`` as views into a few contiguous ``grad_data`` buffers: those
    buffers stand for all their parameters. A gradient outside every buffer (a plain module, or a
    parameter DDP does not manage) is returned on its own.
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    tensors: list[torch.Tensor] = []
    covered: set[int] = set()
    for chunk in chunks:
        for g in _ddp_grad_buffers(chunk):
            tensors.append(g)
            covered.add(g.untyped_storage().data_ptr())
    for chunk in chunks:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = g if g is not None else p.grad
            if g is None or g.numel() == 0 or g.untyped_storage().data_ptr() in covered:
                continue
            tensors.append(g)
    return tensors


def all_finite(model, loss: float | None) -> bool:
    """Every rank agrees whether this step's loss and gradients are finite.

    One fused reduction per step, whatever the parameter count: per (device, dtype) group one
    ``torch._foreach_norm(..., inf)`` (max |g| per tensor, NaN-propagating) over the DDP grad
    buffers and any loose gradients, the results folded into one device flag together with the
    loss, one all-reduce (MAX) and one host sync (``.item()``).
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    tensors = _grad_tensors(chunks)
    device = tensors[0].device if tensors else next(chunks[0].parameters()).device
    loss_bad = 0.0 if loss is None or math.isfinite(loss) else 1.0
    flag = torch.full((1,), loss_bad, dtype=torch.float32, device=device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in tensors:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for ts in groups.values():
        amax = torch.stack(torch._foreach_norm(ts, float("inf")))  # NaN in -> NaN out; ±inf -> inf
        bad = (~torch.isfinite(amax)).any().to(device=device, dtype=torch.float32)
        flag = torch.maximum(flag, bad)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0
