"""The input pipeline: a torch DataLoader over batches.py's order, read on one rank per TP group.

- ``GlobalBatchSampler`` yields the index lists of this data-parallel rank's micro-batches, global batch after
  global batch, from any ``consumed_samples``: the order batches.py documents (global batch k is samples
  [k*G, (k+1)*G), each DP rank a contiguous slice), so a resume at any point reads what a straight run reads.
  With a batch-size ramp-up it asks its own instance of megatron-core's calculator for each batch's size.
- ``loader`` wraps it in a ``torch.utils.data.DataLoader``: ``--num-workers`` processes read and collate ahead
  of the step; on CUDA the batches are pinned and copied without blocking.
- ``StageBatches`` is the iterator the schedules pull from. Only the first rank of each TP group reads (the
  others hold no loader); megatron-core's ``get_batch_on_this_tp_rank`` broadcasts each micro-batch to the
  group. Middle pipeline stages neither read nor receive: they take activations, not tokens.
"""

from __future__ import annotations

import signal
from typing import Callable, Iterator, Optional

import torch
from megatron.core import parallel_state as ps

from megatron_md.training.data.batches import collate


class GlobalBatchSampler:
    """Index lists of this DP rank's micro-batches from ``consumed`` on; ``limit`` global batches, or forever."""

    def __init__(self, n: int, consumed: int, gbs_at: Callable[[int], int], micro: int, dp_rank: int,
                 dp_size: int, limit: Optional[int] = None):
        self.n, self.consumed, self.gbs_at, self.micro = n, consumed, gbs_at, micro
        self.dp_rank, self.dp_size, self.limit = dp_rank, dp_size, limit

    def __iter__(self) -> Iterator[list[int]]:
        consumed, done = self.consumed, 0
        while self.limit is None or done < self.limit:
            g = self.gbs_at(consumed)
            per_rank = g // self.dp_size
            start = consumed + self.dp_rank * per_rank
            for m in range(per_rank // self.micro):
                first = start + m * self.micro
                yield [(first + i) % self.n for i in range(self.micro)]
            consumed, done = consumed + g, done + 1

    def __len__(self) -> int:  # the DataLoader asks only when finite
        if self.limit is None:
            raise TypeError("an endless sampler has no length")
        return self.limit * (self.gbs_at(self.consumed) // self.dp_size // self.micro)


def batch_sizes(schedule: Optional[str], gbs: int, micro: int, dp: int) -> Callable[[int], int]:
    """consumed samples -> the global batch size of the batch that starts there: constant, or by the step
    schedule the trainer hands megatron-core (a private instance of its calculator: the trainer's global one
    follows the steps taken, this one runs ahead with the loader's prefetch)."""
    if not schedule:
        return lambda _consumed: gbs
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    calc = StepBatchsizeNumMicroBatchesCalculator(micro, dp, False, 0, schedule)

    def size(consumed: int) -> int:
        calc.update(consumed, consistency_check=False)
        return calc.get_current_global_batch_size()

    return size


def _worker_ignores_preemption(_worker_id: int) -> None:
    """A worker leaves SIGTERM, SIGUSR1 and SIGINT to its rank: a scheduler or torchrun signals the whole process
    group, and a worker that died of it would fail the step the rank is finishing before it saves. The rank
    stops its workers when it exits (and they exit by themselves if it dies)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def loader(dataset, sampler: GlobalBatchSampler, num_workers: int, pin: bool) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers, pin_memory=pin,
        persistent_workers=False, prefetch_factor=2 if num_workers > 0 else None,
        worker_init_fn=_worker_ignores_preemption if num_workers > 0 else None)


def reads_here() -> bool:
    """Whether this rank reads data: the first rank of its TP group, on a stage that needs tokens or labels."""
    return ps.get_tensor_model_parallel_rank() == 0 and (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage())


class StageBatches:
    """What one rank's forward steps pull: this micro-batch on ``device`` (None on middle pipeline stages)."""

    def __init__(self, source: Optional[Iterator[dict]], device: torch.device, micro: int, seq_length: int,
                 attention_mask: bool):
        self.source, self.device = source, device
        self.micro, self.seq_length, self.attention_mask = micro, seq_length, attention_mask
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.tp = ps.get_tensor_model_parallel_world_size()

    def __iter__(self):
        return self

    def __next__(self) -> Optional[dict]:
        if not (self.first or self.last):
            return None
        batch = None
        if self.source is not None:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in next(self.source).items()}
        if self.tp == 1:
            return batch
        from megatron.core.utils import get_batch_on_this_tp_rank

        group = ps.get_tensor_model_parallel_group()
        return get_batch_on_this_tp_rank(
            batch, has_cu_seqlens=False, is_hybrid_cp=False, create_attention_mask_in_dataloader=self.attention_mask,
            broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(), broadcast_group=group, cp_size=1,
            tp_rank=ps.get_tensor_model_parallel_rank(), micro_batch_size=self.micro, seq_length=self.seq_length,
            mtp_on_this_rank=False, pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            is_pipeline_first_stage=self.first, is_pipeline_last_stage=self.last)


def eval_start(iteration: int, eval_interval: Optional[int], eval_iters: int, gbs: int, same_batches: bool) -> int:
    """The validation sample an evaluation after ``iteration`` steps starts at: Megatron-LM's order, where each
    evaluation continues where the previous one stopped (0 with ``same_batches``, or for the first)."""
    if same_batches or not eval_interval:
        return 0
    return ((max(iteration, 1) - 1) // eval_interval) * eval_iters * gbs


def stage_batches(dataset, *, consumed: int, sizes: Callable[[int], int], micro: int, dp_rank: int, dp_size: int,
                  num_workers: int, device: torch.device, seq_length: int, attention_mask: bool,
                  limit: Optional[int] = None) -> StageBatches:
    """This rank's micro-batches from ``consumed`` on (``limit`` global batches, or endless): a DataLoader where
    this rank reads, the TP broadcast where it receives."""
    source = None
    if reads_here():
        sampler = GlobalBatchSampler(len(dataset), consumed, sizes, micro, dp_rank, dp_size, limit)
        source = iter(loader(dataset, sampler, num_workers, pin=device.type == "cuda"))
    return StageBatches(source, device, micro, seq_length, attention_mask)
