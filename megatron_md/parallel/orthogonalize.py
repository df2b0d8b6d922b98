"""The orthogonalisation engine: every matrix orthogonalised once in its TP group, batched by shape.

Callers (MD's Muon base, Manifold Muon) ``submit`` a job per matrix: its local TP shards, the process
group they are split over and the split axis, and a ``Kernel`` (msign, or a whole manifold solve).
``run`` then, for every TP (or expert-TP) group:

1. groups the jobs into buckets of the same kernel, shapes and split (same-shape experts of a layer,
   Q/K/V blocks of equal shape, same-shape matrices across layers), capped at ``bucket_elements``;
2. gives each matrix exactly one owner rank in the group, greedily balancing the NS cost
   ``max(m,n)·min(m,n)²`` (every rank derives the same assignment from the same job list);
3. per bucket, one ``all_to_all`` brings each matrix's shards to its owner, the owner runs the kernel
   once on the stacked batch, and one ``all_to_all`` returns each rank its shard (and every rank the
   kernel's replicated outputs, e.g. a manifold dual).

A job whose group has one rank, or whose matrix is not split (``dim=None``), runs where it is when the
group has one rank; replicated matrices in a larger group are solved by their owner and sent to all.
``EngineStats`` counts what this rank computed and sent, for the counting benchmarks.
Knows groups and shards, not models or optimizers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_md.optim.msign import CPU_BATCH_MAX_ELEMENTS as CPU_BATCH_MAX

KernelFn = Callable[[list[torch.Tensor], list[torch.Tensor]], tuple[list[torch.Tensor], list[torch.Tensor]]]


@dataclass(frozen=True, eq=False)
class Kernel:
    """What an owner runs on a bucket.

    ``fn(sharded, replicated)`` takes the stacked FULL inputs ``[B, m, n]`` (one per sharded input) and the
    stacked replicated inputs, and returns (stacked full outputs to split back over the group, stacked
    replicated outputs every rank receives whole). ``outputs(full_shape, replicated_shapes)`` gives the
    per-matrix shapes of both output lists without running ``fn``; ``flops(m, n)`` its analytic cost.
    ``key`` identifies kernels that may share a bucket (same function and options).
    """

    key: tuple
    fn: KernelFn
    outputs: Callable[[tuple[int, int], list[tuple]], tuple[list[tuple], list[tuple]]]
    flops: Callable[[int, int], float]
    # NS invocations one call of ``fn`` makes for a batch of ``m x n`` matrices on a device (default 1)
    calls: Callable[[int, int, int, torch.device], int] = lambda batch, m, n, device: 1


def ns_cost(m: int, n: int) -> int:
    """Relative Newton-Schulz cost of an ``m x n`` matrix: ``max(m,n)·min(m,n)²``."""
    return max(m, n) * min(m, n) ** 2


def msign_flops(m: int, n: int, steps: int) -> float:
    """Multiply-add FLOPs of ``steps`` quintic NS iterations on ``m x n`` (wide orientation, s = min side):
    ``A = XXᵀ`` 2s²l, ``B = bA + cA²`` 2s³, ``X = aX + BX`` 2s²l per step."""
    s, l = min(m, n), max(m, n)
    return float(steps) * (4.0 * s * s * l + 2.0 * s**3)


@dataclass
class EngineStats:
    """What this rank did inside the engine since the last ``reset``."""

    matrices: int = 0  # jobs submitted by this rank (every TP rank submits each of its matrices)
    owned: int = 0  # jobs this rank computed
    buckets: int = 0  # buckets this rank took part in
    kernel_calls: int = 0  # kernel invocations (one per bucket with owned jobs, unless per_matrix)
    ns_calls: int = 0  # Newton-Schulz invocations inside them (a CPU kernel loops over big matrices)
    flops: float = 0.0  # analytic kernel FLOPs this rank computed
    collectives: int = 0
    bytes_sent: int = 0  # to other ranks (the self-to-self part of an all_to_all excluded)
    bytes_received: int = 0

    def reset(self) -> None:
        for name, value in EngineStats().__dict__.items():
            setattr(self, name, value)


@dataclass
class Ticket:
    """A submitted job; after ``run`` holds this rank's shard of each output and the replicated outputs."""

    sharded: list[torch.Tensor]
    replicated: list[torch.Tensor]
    group: object
    dim: int | None
    kernel: Kernel
    full_shape: tuple[int, int] = (0, 0)
    out_sharded: list[torch.Tensor] = field(default_factory=list)
    out_replicated: list[torch.Tensor] = field(default_factory=list)


def _group_ranks(group) -> tuple[int, ...]:
    if group is None or not dist.is_initialized():
        return (0,)
    return tuple(dist.get_process_group_ranks(group))


class OrthogonalizationEngine:
    """Collects jobs during an optimizer step and runs them: one owner per matrix, one kernel per bucket.

    ``per_matrix=True`` keeps the buckets and collectives but calls the kernel once per matrix (bitwise the
    unbatched result, for debugging). ``bucket_elements`` caps one bucket's full-matrix elements (memory of the
    stacked batch and its NS temporaries).
    """

    def __init__(self, per_matrix: bool = False, bucket_elements: int = 1 << 28):
        self.per_matrix = per_matrix
        self.bucket_elements = bucket_elements
        self.stats = EngineStats()
        self._jobs: list[Ticket] = []
        # name -> context manager around each wait for an all-to-all ("ns-engine-comm-wait"); the glue sets it
        # to megatron-core's timers (mcore/timing.py), here it does nothing
        self.timed: Callable[[str], contextlib.AbstractContextManager] = lambda _name: contextlib.nullcontext()

    def submit(self, sharded: Sequence[torch.Tensor], group, dim: int | None, kernel: Kernel,
               replicated: Sequence[torch.Tensor] = ()) -> Ticket:
        """Queue a job on a matrix whose sharded inputs (same local shape) are split along ``dim`` over ``group``."""
        size = len(_group_ranks(group))
        m, n = (int(x) for x in sharded[0].shape)
        if dim == 0:
            m *= size
        elif dim == 1:
            n *= size
        t = Ticket([s.contiguous() for s in sharded], [r.contiguous() for r in replicated], group, dim, kernel, (m, n))
        self._jobs.append(t)
        self.stats.matrices += 1
        return t

    # -- running --------------------------------------------------------------------------------
    def run(self) -> None:
        """Run every queued job; afterwards each ticket holds its outputs. All ranks of a group must call."""
        jobs, self._jobs = self._jobs, []
        by_group: dict[tuple[int, ...], list[Ticket]] = {}
        for t in jobs:
            by_group.setdefault(_group_ranks(t.group), []).append(t)
        for ranks in sorted(by_group):
            self._run_group(ranks, by_group[ranks])

    def _buckets(self, jobs: list[Ticket]) -> list[list[Ticket]]:
        by_key: dict[tuple, list[Ticket]] = {}
        order: list[tuple] = []
        for t in jobs:
            key = (t.kernel.key, t.dim, tuple(tuple(s.shape) for s in t.sharded),
                   tuple(tuple(r.shape) for r in t.replicated), t.sharded[0].dtype, t.sharded[0].device)
            if key not in by_key:
                by_key[key] = []
                order.append(key)
            by_key[key].append(t)
        buckets = []
        for key in order:  # submission order: identical on every rank of the group
            items = by_key[key]
            per = max(1, self.bucket_elements // max(1, items[0].full_shape[0] * items[0].full_shape[1]))
            buckets += [items[i:i + per] for i in range(0, len(items), per)]
        return buckets

    @staticmethod
    def owners(buckets: list[list[Ticket]], size: int) -> list[list[int]]:
        """Greedy cost balance (largest buckets first, each matrix to the least-loaded rank, ties to the lowest)."""
        load = [0] * size
        out: list[list[int]] = [[] for _ in buckets]
        order = sorted(range(len(buckets)), key=lambda b: -ns_cost(*buckets[b][0].full_shape))
        for b in order:
            cost = ns_cost(*buckets[b][0].full_shape)
            for _ in buckets[b]:
                r = min(range(size), key=lambda i: (load[i], i))
                load[r] += cost
                out[b].append(r)
        return out

    def _run_group(self, ranks: tuple[int, ...], jobs: list[Ticket]) -> None:
        size = len(ranks)
        buckets = self._buckets(jobs)
        if size == 1:
            for bucket in buckets:
                self.stats.buckets += 1
                self._compute(bucket, [[t.sharded[k] for t in bucket] for k in range(len(bucket[0].sharded))],
                              owner_of_rank=None)
            return
        me = ranks.index(dist.get_rank())
        owners = self.owners(buckets, size)
        # Pipelined: the gather of bucket i+1 is in flight while bucket i computes; every return is posted
        # as soon as its bucket is done and waited for at the end. Every rank issues the same sequence.
        flights = [_Flight(b, own, me, size) for b, own in zip(buckets, owners)]
        if flights:
            self._post_gather(flights[0])
        for i, f in enumerate(flights):
            if i + 1 < len(flights):
                self._post_gather(flights[i + 1])
            self.stats.buckets += 1
            self._compute_and_post_return(f)
        for f in flights:
            self._unpack(f)

    def _compute(self, bucket: list[Ticket], full_inputs: list[list[torch.Tensor]], owner_of_rank) -> tuple:
        """Run the kernel on the matrices of ``bucket`` (full inputs given per sharded-input index).

        Returns per output a sequence indexed by matrix: one stacked tensor when the kernel batched, else a
        list of the per-matrix results (no stacking copies for kernels that loop anyway)."""
        k = bucket[0].kernel
        B, (m, n), device = len(bucket), bucket[0].full_shape, full_inputs[0][0].device
        reps = [torch.stack([t.replicated[i] for t in bucket]) for i in range(len(bucket[0].replicated))]
        if self.per_matrix or k.calls(B, m, n, device) == B:
            outs_s, outs_r = [], []
            for j in range(B):
                s, r = k.fn([x[j].unsqueeze(0) for x in full_inputs], [x[j:j + 1] for x in reps])
                outs_s.append(s)
                outs_r.append(r)
                self.stats.kernel_calls += int(self.per_matrix)
                self.stats.ns_calls += k.calls(1, m, n, device)
            self.stats.kernel_calls += int(not self.per_matrix)
            sh = [[o[i][0] for o in outs_s] for i in range(len(outs_s[0]))]
            rp = [[o[i][0] for o in outs_r] for i in range(len(outs_r[0]))]
        else:
            sh, rp = k.fn([torch.stack(x) for x in full_inputs], reps)
            self.stats.kernel_calls += 1
            self.stats.ns_calls += k.calls(B, m, n, device)
        self.stats.owned += B
        self.stats.flops += B * k.flops(m, n)
        if owner_of_rank is None:  # local: the outputs are this rank's
            for j, t in enumerate(bucket):
                t.out_sharded = [x[j] for x in sh]
                t.out_replicated = [x[j] for x in rp]
        return sh, rp

    def _all_to_all(self, send: list[list[torch.Tensor]], recv_sizes: list[int], me: int, group,
                    like: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        """One asynchronous all_to_all_single; ``send[r]``: the tensors for rank r, packed with one copy each
        into a flat buffer. Returns (the flat chunk that will arrive from each rank, the work to wait on)."""
        send_sizes = [sum(t.numel() for t in ts) for ts in send]
        flat = like.new_empty(sum(send_sizes))
        off = 0
        for ts in send:
            for t in ts:
                flat[off:off + t.numel()].view(t.shape).copy_(t)
                off += t.numel()
        out = like.new_empty(sum(recv_sizes))
        work = dist.all_to_all_single(out, flat, recv_sizes, send_sizes, group=group, async_op=True)
        es = like.element_size()
        self.stats.collectives += 1
        self.stats.bytes_sent += es * (sum(send_sizes) - send_sizes[me])
        self.stats.bytes_received += es * (sum(recv_sizes) - recv_sizes[me])
        return list(out.split(recv_sizes)), (work, flat)

    def _post_gather(self, f: "_Flight") -> None:
        """Shards to owners (a replicated matrix needs nothing: its owner holds it whole)."""
        if f.dim is None:
            return
        send = [[s for j, o in enumerate(f.own) if o == r for s in f.bucket[j].sharded] for r in range(f.size)]
        f.gathered, f.gather_work = self._all_to_all(send, [len(f.mine) * f.n_in * f.local_numel] * f.size,
                                                     f.me, f.group, f.like)

    def _compute_and_post_return(self, f: "_Flight") -> None:
        """Wait for the shards, one kernel call on the owned matrices, then post every rank its pieces."""
        if f.dim is None:
            full = [[f.bucket[j].sharded[i] for j in f.mine] for i in range(f.n_in)]
        else:
            with self.timed("ns-engine-comm-wait"):
                f.gather_work[0].wait()
            shape = tuple(f.bucket[0].sharded[0].shape)
            full = [[] for _ in range(f.n_in)]
            for jj in range(len(f.mine)):
                for i in range(f.n_in):
                    lo = (jj * f.n_in + i) * f.local_numel
                    parts = [f.gathered[r][lo:lo + f.local_numel].view(shape) for r in range(f.size)]
                    full[i].append(torch.cat(parts, dim=f.dim))
            f.gathered = f.gather_work = None
        sh, rp = self._compute([f.bucket[j] for j in f.mine], full, owner_of_rank=f.me) if f.mine else ([], [])
        # every rank its shard of each sharded output, and the replicated outputs whole
        send = [[] for _ in range(f.size)]
        for r in range(f.size):
            for jj in range(len(f.mine)):
                send[r] += [x[jj] if f.dim is None else x[jj].chunk(f.size, dim=f.dim)[r] for x in sh]
                send[r] += [x[jj] for x in rp]
        counts = [sum(1 for o in f.own if o == r) for r in range(f.size)]
        f.returned, f.return_work = self._all_to_all(send, [c * f.per_job for c in counts], f.me, f.group, f.like)

    def _unpack(self, f: "_Flight") -> None:
        with self.timed("ns-engine-comm-wait"):
            f.return_work[0].wait()
        cursor = [0] * f.size
        for j, t in enumerate(f.bucket):
            src = f.own[j]
            buf, off = f.returned[src], cursor[src]
            t.out_sharded, t.out_replicated = [], []
            for s in f.sh_shapes:
                local = list(s)
                if f.dim is not None:
                    local[f.dim] //= f.size
                n = _numel(local)
                t.out_sharded.append(buf[off:off + n].view(local))
                off += n
            for s in f.rp_shapes:
                n = _numel(s)
                t.out_replicated.append(buf[off:off + n].view(s))
                off += n
            cursor[src] = off


class _Flight:
    """One bucket's trip through a group: who owns what, and its collectives in flight."""

    def __init__(self, bucket: list[Ticket], own: list[int], me: int, size: int):
        first = bucket[0]
        self.bucket, self.own, self.me, self.size = bucket, own, me, size
        self.group, self.dim, self.like = first.group, first.dim, first.sharded[0]
        self.n_in, self.local_numel = len(first.sharded), first.sharded[0].numel()
        self.mine = [j for j, o in enumerate(own) if o == me]
        self.sh_shapes, self.rp_shapes = first.kernel.outputs(first.full_shape,
                                                              [tuple(r.shape) for r in first.replicated])
        self.per_job = (sum(_numel(s) // (1 if self.dim is None else size) for s in self.sh_shapes)
                        + sum(_numel(s) for s in self.rp_shapes))
        self.gathered = self.gather_work = self.returned = self.return_work = None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


# ----------------------------------------------------------------------------------------------------
# The msign kernel


# measured on CPU: a loop of 2-D GEMMs beats batched GEMM above this size (optim/msign.py)
CPU_BATCH_MAX_ELEMENTS = CPU_BATCH_MAX


def batches_on(device: torch.device, m: int, n: int) -> bool:
    """Whether a bucket of ``m x n`` matrices is orthogonalised by one batched call on ``device``."""
    return device.type != "cpu" or m * n <= CPU_BATCH_MAX_ELEMENTS


def msign_kernel(steps: int, coefficients: str, dtype: torch.dtype = torch.float32,
                 matmul_precision: str | None = None) -> Kernel:
    """msign of each stacked matrix (Newton-Schulz in ``dtype``; fp32 matmuls at ``matmul_precision``)."""
    from megatron_md.optim.msign import msign

    def one(X: torch.Tensor) -> torch.Tensor:
        return _with_precision(matmul_precision, msign, X, steps, coefficients, dtype)

    def fn(sharded, replicated):
        X = sharded[0]
        if X.size(0) == 1:  # 2-D: bitwise the per-matrix result, and a view (no stacking copy)
            return [one(X[0]).unsqueeze(0)], []
        if not batches_on(X.device, *X.shape[1:]):
            return [torch.stack([one(x) for x in X.unbind(0)])], []
        return [one(X)], []

    def calls(batch: int, m: int, n: int, device: torch.device) -> int:
        return 1 if batch == 1 or batches_on(device, m, n) else batch

    return Kernel(("msign", steps, str(coefficients), dtype, matmul_precision), fn,
                  lambda shape, reps: ([shape], []), lambda m, n: msign_flops(m, n, steps), calls)


def _with_precision(precision: str | None, fn, X, steps, coefficients, dtype):
    if precision is None or precision == torch.get_float32_matmul_precision():
        return fn(X, steps=steps, coefficients=coefficients, dtype=dtype)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        return fn(X, steps=steps, coefficients=coefficients, dtype=dtype)
    finally:
        torch.set_float32_matmul_precision(old)
