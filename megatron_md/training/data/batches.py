"""Deterministic, resumable batching: global batch ``k`` is always samples [k*G, (k+1)*G).

Each data-parallel rank takes a contiguous slice of the global batch and splits it into
micro-batches. Tensor- and pipeline-parallel peers (same DP rank) read the same samples, so
no broadcast is needed; the position in the data is just ``consumed_samples``.

Why our own: megatron-core 0.19 ships no pretraining sampler (``MegatronPretrainingSampler`` lives in
Megatron-LM's ``megatron/training``/``megatron/legacy``, which we do not depend on); this is its
sequential order (global batch ``k`` = samples ``[k*G, (k+1)*G)``, each DP rank a contiguous slice).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    out = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        out[key] = torch.stack([torch.as_tensor(np.asarray(s[key])) for s in samples])
    out["tokens"] = out["tokens"].long()
    out["labels"] = out["labels"].long()
    out["position_ids"] = out["position_ids"].long()
    out["loss_mask"] = out["loss_mask"].float()
    return out


def micro_batches(
    dataset,
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this DP rank's micro-batches of the global batch starting at ``consumed_samples``."""
    per_rank = global_batch_size // dp_size
    start = consumed_samples + dp_rank * per_rank
    n = len(dataset)
    for m in range(per_rank // micro_batch_size):
        first = start + m * micro_batch_size
        idx = [(first + i) % n for i in range(micro_batch_size)]
        batch = collate([dataset[i] for i in idx])
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}
