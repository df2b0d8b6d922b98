"""Preemption: on SIGTERM or SIGUSR1 finish the step, save, exit 0 (SLURM ``--signal``, ``--requeue``).

A signal handler only sets a flag; the trainer polls it after every step and all ranks agree through one
tiny all-reduce (a signal may reach the ranks at different moments, or only some of them), so every rank
stops after the same iteration and writes the same checkpoint. Further signals while stopping are
ignored: SLURM and torchrun may both deliver one to the same worker.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
TIME_UP = 1 << 20  # poll()'s answer when the --exit-duration-in-mins deadline passed (above any signal number)
# Test hook, "ITERATION:SECONDS": sleep that long after that iteration's checkpoint shards are written,
# before the checkpoint is made visible, so a test can kill the process mid-save. Unset in normal use.
SAVE_DELAY_ENV = "MEGATRON_MD_TEST_SAVE_DELAY"
# Set by ``megatron-md train --nproc-per-node N`` for its workers: rank 0 writes there once a preempted
# run has saved, so the parent can exit 0 although torch's launcher reports the forwarded signal.
PREEMPT_MARKER_ENV = "MEGATRON_MD_PREEMPT_MARKER"


class PreemptionWatch:
    """Installs the handlers (main thread only) and tells the trainer when to stop."""

    def __init__(self, enabled: bool = True):
        self.received: int = 0
        self._previous: dict[int, object] = {}
        if enabled:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        if not self.received:
            self.received = int(signum)

    def poll(self, out_of_time: bool | None = None) -> int:
        """The signal number any rank received, TIME_UP if any rank's ``out_of_time`` is True (the
        --exit-duration-in-mins deadline; None: no deadline set), else 0. A collective: call on every rank."""
        if not self._previous and out_of_time is None:
            return 0
        local = TIME_UP if out_of_time else self.received
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local
        device = "cpu"
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([local], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def signal_name(signum: int) -> str:
    if signum == TIME_UP:
        return "--exit-duration-in-mins"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def maybe_delay_save(iteration: int) -> None:
    spec = os.environ.get(SAVE_DELAY_ENV)
    if spec:
        at, seconds = spec.split(":")
        if int(at) == iteration:
            time.sleep(float(seconds))


def mark_preempted(message: str) -> None:
    path = os.environ.get(PREEMPT_MARKER_ENV)
    if path and (not dist.is_initialized() or dist.get_rank() == 0):
        with open(path, "w") as f:
            f.write(message + "\n")
