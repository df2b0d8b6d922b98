"""What a pooled worker puts back after each job, so that the next job starts as a fresh process would, and the
audit that finds what it missed.

``reset()`` undoes a run's process-wide state: the process groups, megatron-core's globals (parallel state, the
micro-batch calculator, the RNG tracker, the rerun state machine, the MoE loggers), megatron_md's own (the CPU
bridges, the background-save queue, the fused-Adam probe), and torch's and Python's (default dtype, grad mode,
threads, warning filters, logging handlers). ``Audit`` snapshots every global of megatron, megatron_md and
emerging_optimizers at worker start and lists what differs after a reset: a rebound name, or a dict, list or set
whose items changed. tests/harness/test_pool.py requires the list to be empty after a varied set of jobs, so a
megatron-core upgrade that adds state the reset does not know fails there, by name.
"""

from __future__ import annotations

import gc
import importlib
import logging
import sys
import types
import warnings

import torch
import torch.distributed as dist

AUDITED = ("megatron", "megatron_md", "emerging_optimizers")

# Module globals put back to their values at worker start, each with the reason; `Restore` checks at worker start
# that every name still exists, so a megatron-core that renames one fails loudly there. "*": every global of the
# module. Most of these are private names: megatron-core has no public way to return them to import-time values.
RESTORE: dict[str, tuple[tuple[str, ...] | str, str]] = {
    "megatron.core.parallel_state": (
        "*", "process-group bookkeeping; destroy_model_parallel leaves rank lists and a few groups of the last job"),
    "megatron.core.tensor_parallel.random": (
        ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
        "a fresh process has no tracker; model_parallel_cuda_manual_seed keeps the kind of tracker it finds"),
    "megatron.core.transformer.utils": (
        ("_sequence_parallel_attr_cache",), "keyed by id(model): a later model may be given a dead model's id"),
    "megatron.core.tensor_parallel.layers": (
        ("_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS",), "megatron_md.mcore.compat.install() adds MD's keys at a model build"),
    "megatron.core.optimizer.emerging_optimizers": (
        ("_EMERGING_OPTIMIZERS",), "optimizer families register their entries at an optimizer build"),
    "megatron.core.dist_checkpointing.strategies.torch": (
        ("_logged_mcore_async_deprecation",), "a log-once flag: a fresh process logs at its first save"),
    "megatron.core.optimizer.clip_grads": (
        ("l2_norm_impl", "multi_tensor_scale_impl", "multi_tensor_scale_tensor_impl"),
        "megatron_md.mcore.multi_tensor installs its kernels at an optimizer build"),
}

# Globals that may differ from their import-time value after a job without changing what the next job computes,
# each with the reason; everything else the audit reports.
BENIGN = {
    "megatron.core.utils._te_version": "a version probe's cached answer",
    "megatron.core.utils._fa_version": "a version probe's cached answer",
    "megatron.core.utils._flashinfer_version": "a version probe's cached answer",
    "megatron.core.utils._mamba_ssm_version": "a version probe's cached answer",
    "megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue":
        "the queue of a multiprocessing manager that every later save reuses (a fresh process starts one)",
}


class Restore:
    """The RESTORE globals as they were at worker start (containers copied), put back by ``apply()``."""

    def __init__(self):
        self.saved: list[tuple[types.ModuleType, str, object, object]] = []  # module, name, object, copy
        for module, (names, _) in RESTORE.items():
            mod = importlib.import_module(module)
            if names == "*":
                names = tuple(k for k, v in vars(mod).items() if not k.startswith("__") and _is_state(v))
            missing = [n for n in names if not hasattr(mod, n)]
            if missing:
                raise RuntimeError(f"tests/harness/reset.py: {module} no longer has {', '.join(missing)}; "
                                   "megatron-core changed how it keeps this state: update RESTORE for this version")
            for n in names:
                value = getattr(mod, n)
                self.saved.append((mod, n, value, _copy(value)))

    def apply(self) -> None:
        for mod, name, value, copy in self.saved:
            setattr(mod, name, value)
            if isinstance(value, dict):
                value.clear()
                value.update(copy)
            elif isinstance(value, list):
                value[:] = copy
            elif isinstance(value, set):
                value.clear()
                value.update(copy)


def _copy(value):
    return type(value)(value) if isinstance(value, (dict, list, set)) else None


def reset(restore: Restore) -> None:
    """Return the process to the state of a fresh worker (between jobs)."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    from megatron_md.runtime import cpu
    from megatron_md.runtime.distributed import destroy_distributed

    _drain_background_saves()
    destroy_distributed()  # model-parallel groups, then the default group (idempotent)
    if dist.is_initialized():
        dist.destroy_process_group()
    ps.destroy_global_memory_buffer()
    destroy_num_microbatches_calculator()
    destroy_rerun_state_machine()
    _reset_moe_loggers()
    restore.apply()
    _reset_megatron_md()
    cpu.uninstall()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(False)  # --deterministic-mode, if a run stopped before putting it back
    gc.enable()  # --manual-gc, likewise
    gc.collect()


def _drain_background_saves() -> None:
    ck = sys.modules.get("megatron_md.training.checkpoints.checkpointing")
    queue = getattr(ck, "_ASYNC_QUEUE", None)
    if queue is not None:
        try:
            queue.close()
        except Exception:  # a failed job may leave it half-used; the worker is then recycled anyway
            pass
        ck._ASYNC_QUEUE = None


def _reset_moe_loggers() -> None:
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()  # its entries hold the finished job's process groups


def _reset_megatron_md() -> None:
    adam = sys.modules.get("megatron_md.optim.adam")
    if adam is not None:
        adam._state.update({"mode": "auto", "failed": False, "fn": None})


class ProcessState:
    """Process-wide settings outside any module: environment, working directory, argv, signal handlers, warning
    filters, logging handlers and levels. ``restore()`` puts back what ``__init__`` saw."""

    def __init__(self):
        import os
        import signal

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.argv = list(sys.argv)
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                                         signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)}
        self.warning_filters = list(warnings.filters)
        self.loggers = {name: (lg.level, list(lg.handlers), lg.propagate, lg.disabled)
                        for name, lg in _loggers().items()}

    def restore(self) -> None:
        import os
        import signal

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.argv[:] = self.argv
        for s, handler in self.signals.items():
            if signal.getsignal(s) is not handler and handler is not None:
                signal.signal(s, handler)
        warnings.resetwarnings()  # bumps the filters' version: modules forget which warnings they showed
        warnings.filters[:] = self.warning_filters
        warnings.onceregistry.clear()
        for name, lg in _loggers().items():
            level, handlers, lg.propagate, lg.disabled = self.loggers.get(name, (logging.NOTSET, [], True, False))
            lg.setLevel(level)  # (clears logging's cache of enabled levels)
            for h in lg.handlers[:]:
                if h not in handlers:
                    lg.removeHandler(h)
                    h.close()
            lg.handlers[:] = handlers


def _loggers() -> dict[str, logging.Logger]:
    out = {"": logging.getLogger()}
    out.update({n: lg for n, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)})
    return out


def _is_state(value) -> bool:
    return not isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type,
                                  types.MethodType, staticmethod, classmethod, property))


def _view(value):
    """What the audit compares: the object itself, and for a container the identities of its items."""
    if isinstance(value, dict):
        try:
            return id(value), tuple((k, id(v)) for k, v in value.items())
        except RuntimeError:
            return id(value), None
    if isinstance(value, (list, set)):
        return id(value), tuple(sorted(map(id, value))) if isinstance(value, set) else tuple(map(id, value))
    return id(value), None


class Audit:
    """Globals of the audited packages at worker start, compared after every reset."""

    def __init__(self):
        self.modules: dict[str, dict[str, tuple]] = {}
        self.keep: list = []  # the snapshot's objects stay alive, so an id cannot be reused by another object
        self._take_new()

    def _take_new(self) -> list[str]:
        new = []
        for name, mod in list(sys.modules.items()):
            if name in self.modules or not name.split(".")[0] in AUDITED or mod is None:
                continue
            self.modules[name] = {k: _view(v) for k, v in vars(mod).items()
                                  if not k.startswith("__") and _is_state(v)}
            self.keep.append(dict(vars(mod)))
            new.append(name)
        return new

    def differences(self) -> list[str]:
        out = []
        for name, before in self.modules.items():
            mod = sys.modules.get(name)
            if mod is None:
                continue
            for k, v in vars(mod).items():
                if k.startswith("__") or not _is_state(v) or f"{name}.{k}" in BENIGN:
                    continue
                if k not in before:
                    out.append(f"{name}.{k}: new global ({type(v).__name__})")
                elif _view(v) != before[k]:
                    out.append(f"{name}.{k}: changed ({type(v).__name__})")
        self._take_new()  # modules a job imported: judged from their state after it
        return out
