"""Batches are a pure function of consumed_samples: DP ranks tile the global batch exactly."""

from __future__ import annotations

import torch

from megatron_md.training.data.batches import micro_batches


class Seq:
    def __init__(self, n, s=4):
        self.n, self.s = n, s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t = torch.full((self.s,), i)
        return {"tokens": t, "labels": t + 1, "loss_mask": torch.ones(self.s), "position_ids": torch.arange(self.s)}


def test_dp_ranks_tile_the_global_batch_in_order():
    ds = Seq(100)
    seen = []
    for rank in range(2):
        for mb in micro_batches(ds, 8, 8, 2, rank, 2, torch.device("cpu")):
            seen += mb["tokens"][:, 0].tolist()
    assert seen == list(range(8, 16))


def test_resume_position_reproduces_batches():
    ds = Seq(10)
    a = [mb["tokens"] for mb in micro_batches(ds, 12, 4, 2, 0, 1, torch.device("cpu"))]
    b = [mb["tokens"] for mb in micro_batches(ds, 12, 4, 2, 0, 1, torch.device("cpu"))]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[0][:, 0].tolist() == [2, 3]  # wraps modulo the dataset length
