"""Deterministic, resumable batching: global batch ``k`` is always samples [k*G, (k+1)*G).

Each data-parallel rank takes a contiguous slice of the global batch and splits it into
micro-batches; the position in the data is just ``consumed_samples``. loader.py's sampler walks this
order and its DataLoader collates with ``collate`` here.

Why our own: megatron-core 0.19 ships no pretraining sampler (``MegatronPretrainingSampler`` lives in
Megatron-LM's ``megatron/training``/``megatron/legacy``, which we do not depend on); this is its
sequential order (global batch ``k`` = samples ``[k*G, (k+1)*G)``, each DP rank a contiguous slice).
"""

from __future__ import annotations

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
    if "attention_mask" in samples[0]:  # --reset-attention-mask: [b, 1, s, s], True = masked out
        out["attention_mask"] = torch.stack([torch.as_tensor(s["attention_mask"]) for s in samples])
    return out
