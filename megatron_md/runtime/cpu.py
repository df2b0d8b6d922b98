"""CPU bridges for megatron-core's CUDA entry points (gloo runs, no GPU).

megatron-core 0.19 has no CPU path: it calls ``torch.cuda.*`` and allocates with
``device="cuda"`` directly. ``install()`` maps each such entry point to its CPU equivalent;
``uninstall()`` restores every original. Nothing here runs at import time.

``NOT_BRIDGED`` lists the CUDA names megatron-core uses that are deliberately left alone, and why.

Scope of the device rewrite: Tensor/Module methods are patched on the classes (global), but the
``device=``/``pin_memory=`` keyword rewrite is a TorchFunctionMode, which torch keeps per thread.
It is pushed on the thread that calls ``install()``; autograd runs CPU backward on that thread,
and megatron's dist-ckpt writer threads only write CPU tensors to files.
"""

from __future__ import annotations

import importlib
import logging
import threading
import types
from typing import Any, Callable, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_TensorBase = torch._C.TensorBase


def _is_cuda_device(d: Any) -> bool:
    """True for anything torch would read as a CUDA device: 'cuda', 'cuda:N', device, int."""
    if isinstance(d, bool):  # bool is an int subclass (e.g. non_blocking passed positionally)
        return False
    if isinstance(d, int):
        return True
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    return isinstance(d, torch.device) and d.type == "cuda"


# --- inert stream / event / device stand-ins -------------------------------------------------
# On CPU every op is synchronous, so waiting and recording are trivially satisfied.


def _noop(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


def _true(*args, **kwargs):
    return True


class Event:
    """Stand-in for torch.cuda.Event: always complete."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        self.enable_timing = enable_timing

    record = wait = synchronize = _noop
    query = _true

    def elapsed_time(self, end_event) -> float:
        return 0.0


class Stream:
    """Stand-in for torch.cuda.Stream: usable as a context and in wait/record calls."""

    device = _CPU
    cuda_stream = 0
    wait_stream = wait_event = synchronize = _noop
    query = _true

    def __init__(self, device=None, priority=0, **kwargs):
        self.priority = priority

    @staticmethod
    def priority_range():
        return (0, 0)

    def record_event(self, event=None):
        return event if event is not None else Event()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_DEFAULT_STREAM = Stream()


class _StreamContext:
    """torch.cuda.stream(s): a context that yields s (None allowed, as in torch)."""

    def __init__(self, stream=None):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return False


class _DeviceContext:
    """torch.cuda.device(idx): nothing to switch on CPU."""

    def __init__(self, device=None):
        self.idx = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- CUDA RNG -> the CPU default generator ---------------------------------------------------
# On CPU the ops megatron wraps in get_cuda_rng_tracker().fork() (dropout, GPU init) draw from
# torch.default_generator, so the "CUDA" generator must BE that generator for the tracker's
# per-TP-rank streams to take effect.


def _get_rng_state(device="cuda"):
    return torch.get_rng_state()


def _set_rng_state(new_state, device="cuda"):
    torch.set_rng_state(new_state)


def _manual_seed(seed):
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. this function.
    torch.default_generator.manual_seed(int(seed))


def _mcore_get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _mcore_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    # The original queues a callback via torch.cuda._lazy_call, which never runs without CUDA.
    torch.set_rng_state(new_state)


class _ForkWarningFilter(logging.Filter):
    # fork() warns when the CPU RNG moved inside a CUDA-RNG fork; on CPU both are one generator.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_FORK_FILTER = _ForkWarningFilter()
_RNG_LOGGER = "megatron.core.tensor_parallel.random"


# --- Tensor / Module methods -----------------------------------------------------------------


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self  # a CUDA tensor's .cuda() returns itself; CPU is "the CUDA device" here


def _tensor_to(self, *args, **kwargs):
    args = tuple(_CPU if _is_cuda_device(a) else a for a in args)
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = _CPU
    return _TensorBase.to(self, *args, **kwargs)


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs:
        # megatron compares against 'torch.cuda.FloatTensor' etc. (optimizer.py, clip_grads.py)
        name = _TensorBase.type(self)
        if self.device.type == "cpu" and not name.startswith("torch.cuda."):
            name = "torch.cuda." + name[len("torch.") :]
        return name
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = "torch." + dtype[len("torch.cuda.") :]
    elif isinstance(dtype, type) and dtype.__module__ == "torch.cuda":
        dtype = getattr(torch, dtype.__name__)
    return _TensorBase.type(self, dtype, non_blocking, **kwargs)


def _tensor_pin_memory(self, device=None):
    return self  # pinning needs the CUDA driver; plain CPU memory is equivalent here


def _tensor_record_stream(self, stream):
    return None


def _module_cuda(self, device=None):
    return self


# --- megatron-core functions bound by name ---------------------------------------------------

_ORIG_MOVE: list[Callable] = []


def _maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    # The original only acts on tensor.is_cuda, so CPU split sizes would stay tensors although
    # the alltoall dispatcher asked for numpy lists (moe_utils.py:1184).
    if torch.is_tensor(tensor) and tensor.device.type == "cpu":
        return tensor.numpy() if as_numpy else tensor
    return _ORIG_MOVE[0](tensor, as_numpy=as_numpy, record_stream=record_stream)


_ORIG_CKPT_BACKWARD: list[Callable] = []


def _checkpoint_backward(ctx, *grads):
    # Activation recomputation re-runs the forward inside the backward pass. Entered through
    # torch.autograd.backward (which the mode below itself handles, so torch pops the mode for the
    # call's duration), that forward would run without the device rewrite: re-enter it here.
    with _CudaToCpuMode():
        return _ORIG_CKPT_BACKWARD[0](ctx, *grads)


# --- keyword rewrite for factories -----------------------------------------------------------


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites device=<cuda> to cpu and pin_memory=True to False on every torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs and (_is_cuda_device(kwargs.get("device")) or kwargs.get("pin_memory")):
            kwargs = dict(kwargs)
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = _CPU
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        return func(*args, **(kwargs or {}))


# --- gloo collectives ---------------------------------------------------------------------------
_ORIG_ALL_GATHER: list = []


def gather_padded(tensor_list, tensor, group, gather):
    """all_gather into first-dim-uneven outputs with an even ``gather``: pad, gather, slice."""
    rows = max(t.shape[0] for t in tensor_list)
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    bufs = [torch.empty_like(padded) for _ in tensor_list]
    gather(bufs, padded, group=group)
    for out, buf in zip(tensor_list, bufs):
        out.copy_(buf[: out.shape[0]])


class _DoneWork:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    # NCCL gathers first-dim-uneven tensors (MoE alltoall dispatcher with expert TP > 1); gloo
    # refuses them, so pad to the largest and slice.
    orig = _ORIG_ALL_GATHER[0]
    if all(t.shape == tensor.shape for t in tensor_list):
        return orig(tensor_list, tensor, group=group, async_op=async_op)
    gather_padded(tensor_list, tensor, group, orig)
    return _DoneWork() if async_op else None


# --- the bridge table ------------------------------------------------------------------------


class Bridge(NamedTuple):
    owner: str  # module path, or "module:Class" for a class attribute
    attr: str
    replacement: Any
    cpu_equivalent: str


_MODE = "<TorchFunctionMode>"
_LOGGING = "<logging>"
_SPECIAL = (_MODE, _LOGGING)
_TP_RANDOM = "megatron.core.tensor_parallel.random"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_MOE_DISPATCH = "megatron.core.transformer.moe.token_dispatcher"

_BRIDGE_LIST = [
    Bridge("torch.cuda", "current_device", lambda: _CPU, "returns torch.device('cpu')"),
    Bridge("torch.cuda", "set_device", _noop, "no-op"),
    Bridge("torch.cuda", "synchronize", _noop, "no-op (CPU ops are synchronous)"),
    Bridge("torch.cuda", "empty_cache", _noop, "no-op"),
    Bridge("torch.cuda", "Stream", Stream, "inert Stream"),
    Bridge("torch.cuda", "Event", Event, "inert, always-complete Event"),
    Bridge("torch.cuda", "current_stream", lambda device=None: _DEFAULT_STREAM, "inert Stream"),
    Bridge("torch.cuda", "default_stream", lambda device=None: _DEFAULT_STREAM, "inert Stream"),
    Bridge("torch.cuda", "stream", _StreamContext, "context yielding the stream"),
    Bridge("torch.cuda", "device", _DeviceContext, "inert context"),
    Bridge("torch.cuda", "is_current_stream_capturing", lambda: False, "False"),
    Bridge("torch.cuda", "memory_allocated", _zero, "0"),
    Bridge("torch.cuda", "max_memory_allocated", _zero, "0"),
    Bridge("torch.cuda", "memory_reserved", _zero, "0"),
    Bridge("torch.cuda", "max_memory_reserved", _zero, "0"),
    Bridge("torch.cuda", "reset_peak_memory_stats", _noop, "no-op"),
    Bridge("torch.cuda", "memory_stats", lambda device=None: {}, "{}"),
    *[
        Bridge(mod, name, fn, why)
        for mod in ("torch.cuda", "torch.cuda.random")
        for name, fn, why in (
            ("get_rng_state", _get_rng_state, "torch.get_rng_state()"),
            ("set_rng_state", _set_rng_state, "torch.set_rng_state()"),
            ("manual_seed", _manual_seed, "seeds torch.default_generator"),
            ("manual_seed_all", _manual_seed, "seeds torch.default_generator"),
        )
    ],
    Bridge("torch:Tensor", "cuda", _tensor_cuda, "returns self"),
    Bridge("torch:Tensor", "to", _tensor_to, "CUDA device arguments become cpu"),
    Bridge("torch:Tensor", "type", _tensor_type, "no-arg form reports 'torch.cuda.<X>Tensor'"),
    Bridge("torch:Tensor", "pin_memory", _tensor_pin_memory, "returns self"),
    Bridge("torch:Tensor", "record_stream", _tensor_record_stream, "no-op"),
    Bridge("torch.nn:Module", "cuda", _module_cuda, "returns self"),
    Bridge(_MODE, "device=", None, "device='cuda'/'cuda:N'/int/torch.device('cuda') -> cpu"),
    Bridge(_MODE, "pin_memory=", None, "pin_memory=True -> False"),
    Bridge(_TP_RANDOM, "_get_cuda_rng_state", _mcore_get_cuda_rng_state, "torch.get_rng_state()"),
    Bridge(_TP_RANDOM, "_set_cuda_rng_state", _mcore_set_cuda_rng_state, "torch.set_rng_state()"),
    Bridge(_LOGGING, _RNG_LOGGER, _FORK_FILTER, "drops fork()'s CPU-RNG-changed warning"),
    Bridge(_MOE_UTILS, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu, "numpy on CPU"),
    Bridge(_MOE_DISPATCH, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu, "numpy on CPU"),
    Bridge("torch.distributed", "all_gather", _all_gather, "gloo: first-dim-uneven outputs by padding"),
    Bridge(f"{_TP_RANDOM}:CheckpointFunction", "backward", staticmethod(_checkpoint_backward),
           "recomputed forward runs under the device rewrite"),
]


_BRIDGE_CKPT_BACKWARD = _BRIDGE_LIST[-1].replacement


def _key(b: Bridge) -> str:
    if b.owner in _SPECIAL:
        return f"{b.owner.strip('<>')}({b.attr})"
    return f"{b.owner.replace(':', '.')}.{b.attr}"


# name -> Bridge; tests iterate this so every bridged entry point has a behaviour check.
def _fresh(obj: Any) -> Any:
    # One distinct object per patched name: torch._dynamo maps torch objects to trace rules by
    # identity and asserts when one object sits under two names with different rules.
    if isinstance(obj, types.FunctionType):
        return types.FunctionType(
            obj.__code__, obj.__globals__, obj.__name__, obj.__defaults__, obj.__closure__
        )
    return obj


_BRIDGE_LIST = [b._replace(replacement=_fresh(b.replacement)) for b in _BRIDGE_LIST]
BRIDGES: dict[str, Bridge] = {_key(b): b for b in _BRIDGE_LIST}

# torch.cuda names used by megatron-core's training/checkpoint paths that stay untouched.
NOT_BRIDGED: dict[str, str] = {
    "is_available": "stays False: every megatron/EO branch on it skips a CUDA-only feature "
    "(dist_checkpointing/strategies/torch.py:67, utils.py:530/1575, EO muon.py:94, soap.py:182)",
    "device_count": "stays 0, consistent with is_available; megatron uses it only for async-save "
    "workers (dist_checkpointing/strategies/async_utils.py:565) and CUDA graphs",
    "FloatTensor": "legacy type; isinstance(x, (torch.FloatTensor, torch.cuda.FloatTensor)) "
    "already holds for CPU tensors (transformer/module.py:20)",
    "HalfTensor": "as FloatTensor",
    "BFloat16Tensor": "as FloatTensor",
    "OutOfMemoryError": "an exception class; exists without CUDA",
    "amp": "torch.cuda.amp.custom_fwd/bwd decorators work on CPU (tensor_parallel/layers.py:77)",
    "random": "the module; its RNG functions are bridged above",
    "CUDAGraph": "CUDA graphs only (cuda_graph_impl != 'none')",
    "default_generators": "graph-safe RNG only (use_cudagraphable_rng)",
    "get_device_capability": "flex/DeepEP dispatcher only (token_dispatcher.py:1546)",
    "nvtx": "NVTX ranges only when enabled",
    "clock_rate": "straggler detector, gated on is_available (utils.py:1575)",
    "power_draw": "as clock_rate",
    "temperature": "as clock_rate",
    "utilization": "as clock_rate",
}

_MISSING = object()
_lock = threading.Lock()
_saved: list[tuple[Any, str, Any]] = []  # (owner object, attr, original or _MISSING)
_mode: _CudaToCpuMode | None = None
_mode_thread: int | None = None


def _resolve(owner: str) -> Any:
    mod, _, cls = owner.partition(":")
    obj = importlib.import_module(mod)
    return getattr(obj, cls) if cls else obj


def _build_dynamo_rules() -> None:
    # dynamo builds its torch-object rule map once, lazily; build it from the originals so a
    # torch.compile'd function inlines the bridges instead of treating them as torch.cuda ops.
    try:
        from torch._dynamo import trace_rules

        trace_rules.get_torch_obj_rule_map()
    except Exception:  # private API; only precision of later compiles depends on it
        pass


def is_installed() -> bool:
    return _mode is not None


def install() -> None:
    """Install every bridge in BRIDGES (idempotent). Imports megatron.core modules it patches."""
    global _mode, _mode_thread
    with _lock:
        if _mode is not None:
            return
        # Import every owner first: token_dispatcher binds moe_utils' function by name at import.
        owners = {b.owner: _resolve(b.owner) for b in _BRIDGE_LIST if b.owner not in _SPECIAL}
        _build_dynamo_rules()
        try:
            for b in _BRIDGE_LIST:
                if b.owner == _MODE:
                    continue
                if b.owner == _LOGGING:
                    logging.getLogger(b.attr).addFilter(b.replacement)
                    _saved.append((logging.getLogger(b.attr), _LOGGING, b.replacement))
                    continue
                owner = owners[b.owner]
                if isinstance(owner, type):  # class attrs may be inherited (Tensor.cuda)
                    orig = owner.__dict__.get(b.attr, _MISSING)
                else:
                    orig = getattr(owner, b.attr)
                if b.attr == "maybe_move_tensor_to_cpu" and not _ORIG_MOVE:
                    _ORIG_MOVE.append(orig)
                if b.attr == "all_gather" and not _ORIG_ALL_GATHER:
                    _ORIG_ALL_GATHER.append(orig)
                if b.replacement is _BRIDGE_CKPT_BACKWARD and not _ORIG_CKPT_BACKWARD:
                    _ORIG_CKPT_BACKWARD.append(getattr(owner, b.attr))
                setattr(owner, b.attr, b.replacement)
                _saved.append((owner, b.attr, orig))
            mode = _CudaToCpuMode()
            mode.__enter__()
            _mode, _mode_thread = mode, threading.get_ident()
        except BaseException:
            _restore()
            raise


def _restore() -> None:
    while _saved:
        owner, attr, orig = _saved.pop()
        if attr == _LOGGING:
            owner.removeFilter(orig)
        elif orig is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, orig)
    _ORIG_MOVE.clear()
    _ORIG_ALL_GATHER.clear()
    _ORIG_CKPT_BACKWARD.clear()


def uninstall() -> None:
    """Restore every original (idempotent). Must run on the thread that installed."""
    global _mode, _mode_thread
    with _lock:
        if _mode is None:
            return
        if threading.get_ident() != _mode_thread:
            raise RuntimeError("cpu.uninstall() must run on the thread that called install()")
        stack = torch.overrides._get_current_function_mode_stack()
        if not stack or stack[-1] is not _mode:
            raise RuntimeError("a TorchFunctionMode entered after cpu.install() is still active")
        _mode.__exit__(None, None, None)
        _mode, _mode_thread = None, None
        _restore()
