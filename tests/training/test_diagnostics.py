"""Diagnostics: matrix statistics, names, and attention probes on a real model."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_md.training.diagnostics import label, matrix_stats


def test_matrix_stats_of_known_matrices():
    Q, _ = torch.linalg.qr(torch.randn(32, 16, dtype=torch.float64))
    s = matrix_stats(Q.float())
    assert s["sigma_max"] == pytest.approx(1, abs=1e-5) and s["sigma_min"] == pytest.approx(1, abs=1e-5)
    assert s["off_gram"] < 1e-5 and s["fro"] == pytest.approx(4.0, rel=1e-5)
    D = Q.float() * torch.linspace(1, 3, 16)  # orthogonal columns, free norms (a DGram point)
    s = matrix_stats(D)
    assert s["sigma_max"] == pytest.approx(3, rel=1e-4) and s["off_gram"] < 1e-4
    s = matrix_stats(torch.ones(8, 4))  # rank one: large off-diagonal Gram
    assert s["sigma_min"] < 1e-4 and s["off_gram"] > 1


def test_labels():
    assert label("decoder.layers.3.self_attention.linear_qkv.weight") == "L3.attention.qkv"
    assert label("decoder.layers.0.mlp.linear_fc2.weight") == "L0.mlp.fc2"
    assert label("decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight") == "L1.expert5.fc1"
    assert label("decoder.layers.1.mlp.router.weight") == "L1.router"
    assert label("embedding.word_embeddings.weight") is None


def test_attention_probe_on_a_model(mcore_world):
    from megatron_md.models.builder import build_model
    from megatron_md.training.config import resolve
    from megatron_md.training.diagnostics import AttentionProbe

    cfg = resolve("tiny-dense", None, {"seq_length": 16})
    model = build_model(cfg, cfg.model.vocab_size, cpu=True)
    probe = AttentionProbe(model)
    tokens = torch.randint(0, 100, (2, 16))
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    model(tokens, pos, None)
    assert probe.take() == {}  # not armed: nothing measured
    probe.armed = True
    model(tokens, pos, None)
    got = probe.take()
    assert set(got) == {"L0.max_logit", "L0.attn_entropy", "L1.max_logit", "L1.attn_entropy"}
    assert 0 < got["L0.attn_entropy"] < math.log(16)
    assert math.isfinite(got["L1.max_logit"])
