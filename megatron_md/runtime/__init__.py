"""Runtime selection: CUDA (nccl) or the CPU runtime (gloo) that bridges megatron-core to CPU.

Selecting a runtime patches nothing; only ``activate()`` does, and only for the CPU runtime.
Importing this package never patches torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatron_md.runtime import cpu

__all__ = ["Runtime", "select_runtime", "activate", "cpu"]


@dataclass(frozen=True)
class Runtime:
    name: str  # 'cuda' or 'cpu'
    device: torch.device
    backend: str  # 'nccl' or 'gloo'

    def describe(self) -> str:
        """One line for the run log."""
        if self.name == "cpu":
            bridged = "megatron-core CUDA entry points bridged to CPU"
            return f"runtime: cpu ({self.backend}) — {bridged}"
        return f"runtime: cuda ({self.backend}), device {self.device}"


def select_runtime(device: str = "auto") -> Runtime:
    """Pick the runtime for ``--device`` ('auto', 'cuda' or 'cpu'). Patches nothing."""
    device = (device or "auto").lower()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "--device cuda was requested but torch.cuda.is_available() is False on this "
                "machine; pass --device cpu (or --device auto) to run on the CPU runtime over gloo"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return Runtime("cuda", torch.device("cuda", local_rank), "nccl")
    if device == "cpu":
        return Runtime("cpu", torch.device("cpu"), "gloo")
    raise ValueError(f"--device must be one of auto, cuda, cpu; got {device!r}")


def activate(rt: Runtime) -> None:
    """Make ``rt`` the process's runtime: CPU installs the bridges, CUDA binds LOCAL_RANK's GPU."""
    if rt.name == "cpu":
        cpu.install()
        return
    if rt.name != "cuda":
        raise ValueError(f"unknown runtime {rt.name!r}")
    if cpu.is_installed():
        raise RuntimeError("the CPU bridges are installed; they must never be active on a CUDA run")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
