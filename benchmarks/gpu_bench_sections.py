"""The parts of ``gpu_bench.py`` added for issue 30: a profiler pass over optimizer steps (kernel launches,
host syncs, GPU-busy fraction), the DGram retraction micro-benchmark, and the memory ``megatron-md plan``
predicts for a training section. Run inside the driver's worker processes (``gpu_bench_workers.py``)."""

from __future__ import annotations

import statistics
import time

# CUDA runtime/driver calls as the profiler names them (host side).
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaLaunchCooperativeKernel")
# Calls that block the host until the device catches up: each drains the queue (a synchronous cudaMemcpy
# does as well, which is how a device->host copy without pinned memory shows).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
STEP_RANGE = "gpu_bench/optimizer_step"


def _union_us(intervals) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def profile_summary(events, steps: int) -> dict:
    """Launches, syncs and GPU-busy fraction from profiler events: objects with ``name``, ``on_gpu`` and
    ``start_us``/``end_us``. Host calls count inside the ``STEP_RANGE`` ranges only; GPU work counts whole
    (the steps are the only GPU work in the pass). Busy = union of GPU intervals / the window from the first
    step's start to the end of the last step or GPU event, whichever is later."""
    ranges = [(e.start_us, e.end_us) for e in events if not e.on_gpu and e.name == STEP_RANGE]
    if not ranges:
        raise ValueError(f"no '{STEP_RANGE}' range among the profiler's events")

    def inside(e):
        return any(a <= e.start_us <= b for a, b in ranges)
    host = [e for e in events if not e.on_gpu and inside(e)]
    gpu = [e for e in events if e.on_gpu]
    kernels = [e for e in gpu if not e.name.startswith(("Memcpy", "Memset"))]
    start = min(a for a, _ in ranges)
    end = max([b for _, b in ranges] + [e.end_us for e in gpu])
    busy = _union_us((max(e.start_us, start), e.end_us) for e in gpu if e.end_us > start)
    launches = sum(1 for e in host if e.name in LAUNCH_CALLS)
    syncs = sum(1 for e in host if e.name in SYNC_CALLS)
    return {"steps": steps, "launches": launches, "launches_per_step": launches / steps,
            "gpu_kernels": len(kernels), "syncs": syncs, "syncs_per_step": syncs / steps,
            "sync_calls": {n: sum(1 for e in host if e.name == n) for n in SYNC_CALLS},
            "memcpy_dtoh": sum(1 for e in gpu if "DtoH" in e.name),
            "window_ms": (end - start) / 1e3, "gpu_busy_ms": busy / 1e3,
            "gpu_busy_fraction": busy / (end - start) if end > start else None}


class _Event:
    __slots__ = ("name", "on_gpu", "start_us", "end_us")

    def __init__(self, name, on_gpu, start_us, end_us):
        self.name, self.on_gpu, self.start_us, self.end_us = name, on_gpu, start_us, end_us


def profile_optimizer_steps(step_fn, steps: int, cuda: bool) -> dict:
    """``step_fn()`` ``steps`` times under torch.profiler (CPU and, on CUDA, GPU activity), summarised."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                step_fn()
        if cuda:
            torch.cuda.synchronize()  # outside every step range: not counted
    wall = time.perf_counter() - t0
    events = [_Event(e.name, e.device_type == DeviceType.CUDA, e.time_range.start, e.time_range.end)
              for e in prof.events()]
    return {**profile_summary(events, steps), "wall_ms": wall * 1e3}


# ----------------------------------------------------------------------------- DGram retraction

def retraction_candidates():
    """(name, fn) of every DGram retraction ``megatron_md.optim.manifolds`` has now: the exact one
    (``DGram().retract_gram``, an fp64 Gram and eigh), the column-preserving one (msign and column norms),
    the SVD one, and any module-level ``retract_gram*`` function (GEMM-only variants; looked up by name
    because they are being added and renamed). Missing ones are left out, not errors."""
    from megatron_md.optim import manifolds as M

    out = []
    dgram = getattr(M, "DGram", None)
    if dgram is not None:
        if hasattr(dgram, "retract_gram"):
            out.append(("eigh_fp64 (DGram.retract_gram)", dgram().retract_gram))
        try:
            cp = dgram(column_preserving=True)
            out.append(("column_preserving (msign x column norms)", lambda X, cp=cp: cp.retract(X)))
        except TypeError:
            pass
        out.append(("svd (DGram.retract)", lambda X, g=dgram(): g.retract(X)))
    for name in sorted(n for n in dir(M) if n.startswith("retract_gram") and callable(getattr(M, n))):
        out.append((f"{name}", getattr(M, name)))
    return out


def worker_retraction(spec: dict) -> dict:
    """Each candidate on a batch of tall fp32 DGram points after a step (dense-181m's fc1 and fc2): median ms
    over ``reps`` calls, and its off-diagonal Gram (the DGram constraint) and distance to the exact result."""
    import torch

    cuda = spec["device"] == "cuda"
    dev = torch.device(spec["device"])
    from dgram_retraction import _point_after_step

    rows = []
    for batch, m, n in spec["shapes"]:
        # where a retraction runs: a DGram point moved by one step (lr 0.02), not a random matrix (from which
        # the GEMM-only retraction is documented not to converge in its fixed steps)
        X = _point_after_step(batch, m, n, 0.02, dev, seed=0)
        exact = None
        for name, fn in retraction_candidates():
            row = {"name": name, "shape": [batch, m, n]}
            try:
                fn(X)  # warm-up: allocator, cuSOLVER/cuBLAS handles, compilation
                times = []
                for _ in range(spec["reps"]):
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    R = fn(X)
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                R64 = R.double()
                gram = R64.mT @ R64
                off = gram - torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1))
                if exact is None and name.startswith("eigh_fp64"):
                    exact = R64
                row.update(status="ok", ms=statistics.median(times) * 1e3,
                           off_gram_rel=float((off.norm(dim=(-2, -1)) / gram.norm(dim=(-2, -1))).max()),
                           diff_to_exact_rel=None if exact is None else
                           float(((R64 - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))).max()))
            except Exception as e:  # noqa: BLE001 (one candidate's failure is its row)
                row.update(status="failed", error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
    return {"status": "ok" if any(r["status"] == "ok" for r in rows) else "failed", "rows": rows,
            "reps": spec["reps"], "dtype": "float32 input",
            **({} if rows else {"error": "no DGram retraction found in megatron_md.optim.manifolds"})}


# ----------------------------------------------------------------------------- the plan's prediction

def planned_memory(argv: list[str], world: int = 1) -> dict:
    """What ``megatron-md plan`` predicts per device for the run ``megatron-md train argv`` (GiB by
    recomputation mode, and the configured mode)."""
    from megatron_md.training import config as C
    from megatron_md.training.arguments import train_parser
    from megatron_md.training.planning.report import make_plan

    args = vars(train_parser().parse_args(argv))
    args.pop("config", None)
    plan = make_plan(C.resolve(None, None, args), world)
    pd = plan["per_device"]
    gib = 1 / 2**30
    return {"recompute": pd["recompute"], "total_gib": {k: v * gib for k, v in pd["total"].items()},
            "static_gib": pd["static_total"] * gib,
            "activations_gib": {k: v * gib for k, v in pd["activations"].items()},
            "attention_kernel": plan["attention"]["kernel"], "predicted_gib": pd["total"][pd["recompute"]] * gib}
