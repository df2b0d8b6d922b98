"""Megatron-LM's process housekeeping between steps: manual garbage collection, emptying the CUDA caching
allocator, deterministic kernels. Process-wide settings a run changes are put back when it ends, so a run started
in-process (a notebook, the test suite's pooled workers) leaves the interpreter as it found it.

- ``--manual-gc``: Python's automatic collector off for the run (its pauses fall at random points of a step, on one
  rank at a time, and every other rank waits for it in the next collective); a collection every
  ``--manual-gc-interval`` steps (0: never) and before and after each evaluation (``--no-manual-gc-eval``: not).
- ``--empty-unused-memory-level``: 1 returns the allocator's unused cached blocks to the device after each
  forward-backward, 2 after the optimizer step as well; for runs that fragment memory, at the price of
  re-allocating. Nothing to return on the CPU.
- ``--deterministic-mode``: torch's deterministic algorithms (and megatron-core's ``deterministic_mode``); on CUDA
  cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG``, which is set to ``:4096:8`` when the environment has none.
"""

from __future__ import annotations

import gc
import os

import torch


class Housekeeping:
    def __init__(self, training_cfg, cuda: bool):
        self.t, self.cuda = training_cfg, cuda
        self.collections = 0  # manual collections run
        self.emptied = 0  # allocator caches emptied
        self._gc_was_enabled = gc.isenabled()
        self._deterministic_was = torch.are_deterministic_algorithms_enabled()
        if self.t.deterministic_mode:
            if cuda:
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        if self.t.manual_gc:
            gc.disable()
            self._collect()

    def describe(self) -> str | None:
        """One line for the log naming what is on, or None."""
        parts = []
        if self.t.manual_gc:
            every = f"every {self.t.manual_gc_interval} steps" if self.t.manual_gc_interval else "never between steps"
            parts.append(f"--manual-gc: automatic garbage collection off; collecting {every}"
                         + (" and around each evaluation" if self.t.manual_gc_eval else ""))
        if self.t.empty_unused_memory_level:
            parts.append(f"--empty-unused-memory-level {self.t.empty_unused_memory_level}"
                         + ("" if self.cuda else ": no CUDA caching allocator on the CPU, nothing to empty"))
        if self.t.deterministic_mode:
            parts.append("--deterministic-mode: torch's deterministic algorithms on")
        return "; ".join(parts) or None

    def _collect(self) -> None:
        gc.collect()
        self.collections += 1

    def _empty(self, level: int) -> None:
        if self.cuda and self.t.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()
            self.emptied += 1

    def after_forward_backward(self) -> None:
        self._empty(1)

    def after_step(self, iteration: int) -> None:
        self._empty(2)
        if self.t.manual_gc and self.t.manual_gc_interval and iteration % self.t.manual_gc_interval == 0:
            self._collect()

    def around_evaluation(self) -> None:
        if self.t.manual_gc and self.t.manual_gc_eval:
            self._collect()

    def close(self) -> None:
        if self._gc_was_enabled:
            gc.enable()
        torch.use_deterministic_algorithms(self._deterministic_was)
