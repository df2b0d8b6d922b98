"""CUDA fusions the builder turns on only when their kernels exist (checked without a GPU)."""

from __future__ import annotations

import importlib.util

from megatron_md.models import builder
from megatron_md.training import config as C


def test_masked_softmax_fusion_needs_its_extension(monkeypatch):
    """megatron-core imports ``scaled_masked_softmax_cuda`` (Apex / Megatron-LM) inside the first bf16
    forward of the local spec when the fusion is on; without it a CUDA run would fail there."""
    cfg = C.resolve("dense-181m", None, {"seq_length": 4096})

    def fusion(found: bool) -> bool:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (object() if found else None) if name in builder.FUSED_SOFTMAX_MODULES
                            else real(name, *a))
        return builder.transformer_config(cfg.model, cfg.parallel, bf16=True, cpu=False, use_te=False).masked_softmax_fusion

    assert fusion(False) is False
    assert fusion(True) is True
    assert builder.transformer_config(cfg.model, cfg.parallel, bf16=True, cpu=True, use_te=False).masked_softmax_fusion is False
