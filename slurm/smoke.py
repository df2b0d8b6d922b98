"""The smoke step of slurm/pretrain.sbatch and slurm/lr_sweep.sbatch: a few seconds on every rank, under torchrun,
before the long run starts, so that a broken node, image or network stops the job at once with a message
rather than hours later (or never, in a hung collective).

Every rank checks that torch sees CUDA and exactly as many GPUs as torchrun starts processes on its node
(the GPUs SLURM granted, GPUS_PER_NODE / GPUS_PER_CELL), that megatron-core and megatron_md import, and
joins one NCCL all-reduce across all ranks whose result it checks. Rank 0 prints each node's GPUs (name,
memory) and the all-reduce's bus bandwidth. Exit 0: all fine; 1: a check failed (the message names it).

``--cpu`` (SMOKE_CPU=1 in the scripts) checks the same launch chain with gloo on CPU and skips the GPU
checks: for the tests, and for a dry rehearsal on a machine without GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import socket
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="gloo on CPU, no GPU checks")
    p.add_argument("--mib", type=float, default=64.0, help="size of the all-reduced tensor [default: 64 MiB]")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds [default: 300]")
    a = p.parse_args()

    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except KeyError as e:
        print(f"[smoke] {e.args[0]} is not set: run this under torchrun (the sbatch scripts do)", file=sys.stderr)
        return 1
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", max(1, world // max(1, local_world))))
    host = socket.gethostname()

    def fail(msg: str) -> int:
        print(f"[smoke] FAILED on {host} (rank {rank}, local rank {local_rank}): {msg}", file=sys.stderr, flush=True)
        return 1

    import torch
    import torch.distributed as dist

    for module in ("megatron.core", "megatron_md"):
        if importlib.util.find_spec(module) is None:
            return fail(f"{module} does not import with {sys.executable} (PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}): "
                        "install it in the venv or the container image, or set PYTHON")
    if a.cpu:
        device, backend, what = torch.device("cpu"), "gloo", "cpu (--cpu: gloo, no GPU checks)"
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        if not torch.cuda.is_available():
            return fail(f"torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
                        f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES={visible}): no GPU, no driver, or a CPU-only "
                        "torch build")
        n = torch.cuda.device_count()
        if n != local_world:
            return fail(f"{n} GPU(s) visible (CUDA_VISIBLE_DEVICES={visible}) but {local_world} process(es) on this "
                        f"node: set GPUS_PER_NODE (a sweep: GPUS_PER_CELL) to the GPUs the job has, or ask sbatch "
                        f"for --gpus-per-node={local_world}")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
        props = torch.cuda.get_device_properties(local_rank)
        what = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"

    kwargs = {"device_id": device} if device.type == "cuda" else {}
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=a.timeout), **kwargs)
        numel = max(1, int(a.mib * 2**20 / 4))
        x = torch.full((numel,), float(rank + 1), device=device)
        dist.all_reduce(x)  # the first one sets up the communicators
        x.fill_(float(rank + 1))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        want = world * (world + 1) / 2
        lo, hi = x.min().item(), x.max().item()
        if lo != want or hi != want:
            return fail(f"the all-reduce returned values in [{lo}, {hi}], not {want}: a rank computed wrongly")
        rows = [None] * world if rank == 0 else None
        dist.gather_object((host, local_rank, what), rows, dst=0)
    except Exception as e:  # a timeout or a transport error: say which, briefly
        return fail(f"{backend} collective failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if rank == 0:
        by_host: dict[str, list] = {}
        for h, _, w in rows:
            by_host.setdefault(h, []).append(w)
        for h, ws in sorted(by_host.items()):
            kinds = sorted(set(ws))
            print(f"[smoke] {h}: {len(ws)} x " + "; ".join(kinds), flush=True)
        gbps = 2 * (world - 1) / world * x.numel() * 4 / dt / 1e9 if world > 1 else float("nan")
        print(f"[smoke] ok: {world} rank(s) on {nodes} node(s), {backend} all-reduce of {x.numel() * 4 / 2**20:.0f} "
              f"MiB in {dt * 1e3:.1f} ms (bus bandwidth {gbps:.1f} GB/s)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
