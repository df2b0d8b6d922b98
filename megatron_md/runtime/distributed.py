"""torch.distributed setup for both runtimes: torchrun env vars, or a 1-process group."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from megatron_md.runtime import Runtime

_store: dist.Store | None = None  # keeps the single-process TCPStore alive


def init_distributed(rt: Runtime, timeout_s: int = 600) -> tuple[int, int, int]:
    """Init the default process group with ``rt.backend``; return (rank, world, local_rank).

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) this is an env:// rendezvous.
    Without them it is a world-size-1 group on a localhost TCPStore bound to a free port.
    Idempotent: if a default group exists it is reused.
    """
    global _store
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local_rank
    timeout = datetime.timedelta(seconds=timeout_s)
    if rt.name == "cuda":
        torch.cuda.set_device(local_rank)
    env = os.environ
    launcher = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in launcher if k not in env]
    if missing and int(env.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} but {', '.join(missing)} not set")
    if not missing:
        dist.init_process_group(
            backend=rt.backend,
            init_method="env://",
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            timeout=timeout,
        )
    else:
        # Port 0: the OS picks a free port at bind time, so there is no probe-then-bind race.
        _store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
        dist.init_process_group(
            backend=rt.backend, store=_store, rank=0, world_size=1, timeout=timeout
        )
        local_rank = 0
    return dist.get_rank(), dist.get_world_size(), local_rank


def destroy_distributed() -> None:
    """Tear down megatron's model-parallel groups (if any) and the default group. Idempotent."""
    global _store
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _store = None
