"""megatron-core's optimizer step without Apex, in a few ``torch._foreach_*`` calls instead of one call per tensor.

Without Apex or Transformer Engine (every CPU run, GPU installs without either) megatron-core 0.19 falls back to
local stand-ins for Apex's multi-tensor kernels, and those loop over the tensors: the grad norm runs one norm per
gradient, clipping one multiply and one copy per gradient. Its main->model param copies loop over the params
whatever is installed, and torch's AdamW steps tensor by tensor on CPU (torch turns ``foreach`` on by default
for CUDA tensors only). At dense-181m's 99 tensors that was 1,248 ops per Adam step.

``use_foreach(optimizer)`` (called by the optimizer build, never at import) puts in:

- the kernels, where megatron uses its local fallbacks: ``l2_norm`` (one ``_foreach_norm``, no device->host
  read), ``scale`` and ``scale_by_tensor``. Providing the tensor-scaled kernel makes megatron keep the grad norm
  a device tensor and clip by a device coefficient: the path it takes with Transformer Engine. The trainer
  reads the norm as a float only when it logs;
- ``BatchedCopies`` around each wrapped optimizer's main->model param copy: megatron's own loop runs, its
  ``copy_`` calls are collected and done in one ``_foreach_copy_``;
- torch's fused Adam/AdamW kernel in param groups that left the choice to torch's default (``foreach=True`` where
  it cannot fuse); equal to the per-tensor step to fp32 rounding, tested;
- a ChainedOptimizer norm joined on device where megatron reads each optimizer's norm to the host (the layer-wise
  optimizer beside a distributed Adam: three syncs per step).

Numerics: the norm of every tensor and their total are megatron's to the bit; megatron then takes the square root
of the reduced square in fp32 on device instead of in Python's double, and the clip coefficient is computed in
fp32: both within fp32 rounding. Copies and the Adam update are bit-identical.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from megatron_md.mcore import compat


# Signatures of Apex's amp_C kernels, as megatron's multi_tensor_applier calls them:
# op(chunk_size, noop_flag, tensor_lists, *args).

def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """L2 norm of all of ``tensor_lists[0]`` as a 1-element fp32 tensor (and the per-tensor norms if asked)."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    # stack promotes mixed dtypes as torch.tensor(list) does in megatron's fallback.
    total = torch.linalg.vector_norm(torch.stack(norms)).to(torch.float).reshape(1)
    return total, (norms if per_tensor else None)


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """``tensor_lists[1][i] = tensor_lists[0][i] * factor`` (a Python number), like megatron's fallback."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if factor == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, factor)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def scale_by_tensor(chunk_size, noop_flag, tensor_lists, factor: torch.Tensor):
    """The same with a 1-element device tensor ``factor`` (the clip coefficient), read by no host code."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    factor = factor.reshape(())  # foreach ops take a 0-dim tensor scalar
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, factor)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


class BatchedCopies(TorchFunctionMode):
    """Collect ``Tensor.copy_`` calls and run them at exit as one ``torch._foreach_copy_``.

    Only for code whose copies are independent (no copy reads what an earlier one wrote): megatron's
    main->model param copies, which take views of the model params and copy into them.
    """

    def __enter__(self):
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) == 2 and isinstance(args[1], torch.Tensor) \
                and not kwargs.get("non_blocking", False):
            self.dst.append(args[0])
            self.src.append(args[1])
            return args[0]
        return func(*args, **kwargs)

    def __exit__(self, exc_type, exc, tb):
        out = super().__exit__(exc_type, exc, tb)
        if exc_type is None and self.dst:
            torch._foreach_copy_(self.dst, self.src)
        return out


def _batched(copy_main_params_to_model_params):
    def copy():
        with BatchedCopies():
            copy_main_params_to_model_params()
    return copy


def _chained_norm(chained, original):
    """megatron's ChainedOptimizer norm when its optimizers' grad-stat groups differ, joined on device: each
    optimizer's norm (a device tensor with our kernels, or a number) squared, summed and square-rooted."""
    def get_grad_norm():
        if len(chained.chained_optimizers) == 1 or chained.grads_states_parallel_group_is_shared():
            return original()
        norms = [o.get_grad_norm() for o in chained.chained_optimizers]
        device = next((n.device for n in norms if isinstance(n, torch.Tensor)), None)
        if device is None:  # every norm is a number already: megatron's own arithmetic
            return original()
        parts = [n.reshape(()).to(device, torch.float32) if isinstance(n, torch.Tensor)
                 else torch.tensor(float(n or 0.0), device=device) for n in norms]
        return torch.stack(parts).square().sum().sqrt()
    return get_grad_norm


def _copies_are_plain(o) -> bool:
    """megatron's copy is a plain loop of ``copy_`` (no fp8/fp4 quantisation, no Megatron-FSDP)."""
    ddp = getattr(o, "ddp_config", None)
    return ddp is None or not (getattr(ddp, "fp8_param_gather", False) or getattr(ddp, "fp4_param_gather", False)
                               or getattr(ddp, "use_megatron_fsdp", False))


def use_foreach(optimizer) -> dict:
    """Put the foreach versions into ``optimizer`` (and megatron's kernels where it uses its local fallbacks).

    Idempotent. Returns what it did, for tests and logs: kernels (bool), batched copies, foreach Adam groups.
    """
    from megatron_md.mcore.optimizer_checkpoint import walk

    kernels = compat.install_multi_tensor_kernels(l2_norm=l2_norm, scale=scale, scale_by_tensor=scale_by_tensor)
    copies = 0
    groups = 0
    for o in walk(optimizer):
        if not getattr(o, "md_batched_copies", False) and _copies_are_plain(o) \
                and compat.wrap_copy_main_params_to_model_params(o, _batched):
            o.md_batched_copies = True
            copies += 1
        groups += foreach_adam(o)
        if not getattr(o, "md_device_norm", False) and compat.wrap_chained_grad_norm(o, _chained_norm):
            o.md_device_norm = True
    return {"kernels": kernels, "batched_copies": copies, "foreach_adam_groups": groups}


def foreach_adam(o) -> int:
    """torch's fused kernel (``fused=True``) in the param groups of a torch Adam/AdamW left to torch's default,
    where every param is a float tensor on a device torch fuses for (CPU and CUDA); else ``foreach=True``. torch's
    default steps tensor by tensor on CPU, and its foreach path reads each param's step counter on the host
    twice per step; the fused kernel keeps the counters in one launch (equal to fp32 rounding, not bit for bit).
    A checkpoint load replaces the groups with the saved ones, so the load calls this again."""
    if not isinstance(o, torch.optim.Adam):  # AdamW is an Adam in torch >= 2.6
        return 0
    n = 0
    for group in o.param_groups:
        if group.get("foreach") is None and not group.get("fused") and not group.get("differentiable"):
            fusable = all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in group["params"])
            group["fused" if fusable else "foreach"] = True
            n += 1
            for p in group["params"] if fusable else ():  # the fused kernel takes its step counters on the device
                step = o.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    o.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
    return n


FUSED_DEVICES = ("cpu", "cuda")
