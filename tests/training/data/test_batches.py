"""Batches are a pure function of consumed_samples: DP ranks tile the global batch exactly, in the order
batches.py documents, whether the DataLoader reads in the trainer's process or in workers."""

from __future__ import annotations

import pytest
import torch

from megatron_md.training.data.loader import GlobalBatchSampler, batch_sizes, eval_start, loader


class Seq:
    def __init__(self, n, s=4):
        self.n, self.s = n, s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t = torch.full((self.s,), i)
        return {"tokens": t, "labels": t + 1, "loss_mask": torch.ones(self.s), "position_ids": torch.arange(self.s)}


def _first_tokens(ds, consumed, gbs, micro, rank, dp, limit, workers=0, sizes=None):
    sampler = GlobalBatchSampler(len(ds), consumed, sizes or (lambda _c: gbs), micro, rank, dp, limit)
    return [mb["tokens"][:, 0].tolist() for mb in loader(ds, sampler, workers, pin=False)]


def test_dp_ranks_tile_the_global_batch_in_order():
    ds = Seq(100)
    seen = []
    for rank in range(2):
        for mb in _first_tokens(ds, 8, 8, 2, rank, 2, limit=1):
            seen += mb
    assert seen == list(range(8, 16))


def test_resume_position_reproduces_batches():
    ds = Seq(10)
    a = _first_tokens(ds, 12, 4, 2, 0, 1, limit=1)
    b = _first_tokens(ds, 12, 4, 2, 0, 1, limit=1, workers=2)
    assert a == b
    assert a[0] == [2, 3]  # wraps modulo the dataset length


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_reads_what_the_straight_run_reads_next(workers):
    ds = Seq(1000)
    straight = _first_tokens(ds, 0, 12, 3, 1, 2, limit=5, workers=workers)
    resumed = _first_tokens(ds, 24, 12, 3, 1, 2, limit=3, workers=workers)  # after two global batches
    assert resumed == straight[4:]  # two micro-batches per global batch on this rank
    assert straight[0] == [6, 7, 8] and straight[2] == [18, 19, 20]  # rank 1: the second half of each batch


def test_the_ramp_sizes_each_global_batch_from_megatron_core_s_schedule():
    ds = Seq(1000)
    sizes = batch_sizes("0:4 8:8", 8, 2, 1)  # 4 per step until 8 samples are consumed, then 8
    assert [sizes(c) for c in (0, 4, 8, 16)] == [4, 4, 8, 8]
    got = _first_tokens(ds, 0, 8, 2, 0, 1, limit=3, sizes=sizes)
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]


def test_evaluations_move_through_the_split_unless_told_to_stay():
    assert [eval_start(it, 10, 4, 8, False) for it in (10, 20, 25, 30)] == [0, 32, 64, 64]
    assert eval_start(20, 10, 4, 8, True) == 0 and eval_start(20, None, 4, 8, False) == 0
