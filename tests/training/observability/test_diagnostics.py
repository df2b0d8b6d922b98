"""Diagnostics: matrix statistics, names, and attention probes on a real model."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_md.training.observability.diagnostics import EXACT_SVD_MAX_SIDE, attention_stats, label, matrix_stats


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


def _with_spectrum(m: int, n: int, sigma: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return ((U * sigma) @ V.T).float()


def _kinds():
    g = torch.Generator().manual_seed(0)
    yield "gaussian 512x1536", torch.randn(512, 1536, generator=g)
    yield "gaussian 1024x512", torch.randn(1024, 512, generator=g)
    yield "gaussian square 640x640 (cond ~10^3)", torch.randn(640, 640, generator=g)
    spread = 1 + 0.05 * torch.randn(384, generator=g, dtype=torch.float64)
    yield "orthogonal-ish 384x1152", _with_spectrum(384, 1152, spread, 1)
    yield "cond 100 1024x512", _with_spectrum(1024, 512, torch.logspace(0, -2, 512, dtype=torch.float64), 2)
    yield "cond 1000 512x768", _with_spectrum(512, 768, torch.logspace(1, -2, 512, dtype=torch.float64), 3)
    bulk = torch.randn(768, 512, generator=g) / math.sqrt(512)
    yield "gaussian + rank-4 spikes 768x512", bulk + torch.randn(768, 4, generator=g) @ torch.randn(4, 512, generator=g)


@pytest.fixture
def one_thread():
    """The Lanczos loops are many small ops: on a loaded 2-core machine two OpenMP threads stall at
    every barrier (seconds instead of tenths), so these tests run on one."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.mark.parametrize("name", [k for k, _ in _kinds()])
def test_matrix_stats_estimates_agree_with_the_svd(name, one_thread):
    W = dict(_kinds())[name]
    assert min(W.shape) > EXACT_SVD_MAX_SIDE  # the estimated path
    sv = torch.linalg.svdvals(W.double())
    rng = torch.get_rng_state()
    s = matrix_stats(W)
    assert torch.equal(torch.get_rng_state(), rng)  # the training RNG is left alone
    assert s["sigma_max"] == pytest.approx(sv.max().item(), rel=0.02)
    assert s["sigma_min"] == pytest.approx(sv.min().item(), rel=0.02)
    X = W.double() if W.shape[0] >= W.shape[1] else W.double().T
    G = X.T @ X
    off = (G.pow(2).sum() - G.diagonal().pow(2).sum()).sqrt().item()
    assert s["off_gram"] == pytest.approx(off, rel=1e-4) and s["fro"] == pytest.approx(W.norm().item(), rel=1e-5)
    assert matrix_stats(W) == s  # deterministic


def test_matrix_stats_estimates_on_degenerate_matrices(one_thread):
    W = torch.randn(600, 8) @ torch.randn(8, 400)  # rank 8: σ_min = 0
    s = matrix_stats(W)
    assert s["sigma_max"] == pytest.approx(torch.linalg.svdvals(W.double()).max().item(), rel=0.02)
    assert 0 <= s["sigma_min"] < 1e-4 * s["sigma_max"]
    s = matrix_stats(torch.zeros(300, 300))
    assert s == {"sigma_max": 0.0, "sigma_min": 0.0, "off_gram": 0.0, "fro": 0.0}
    Q, _ = torch.linalg.qr(torch.randn(1024, 300, dtype=torch.float64))
    s = matrix_stats(Q.float())  # semi-orthogonal, above the threshold
    assert s["sigma_max"] == pytest.approx(1, abs=1e-4) and s["sigma_min"] == pytest.approx(1, abs=1e-4)


def _dense_attention_stats(q, k):
    """The probe's former dense computation (full S×S float32 logits per head), kept as the reference."""
    q0, k0 = q.float(), k.float()
    if k0.shape[1] != q0.shape[1]:
        k0 = k0.repeat_interleave(q0.shape[1] // k0.shape[1], dim=1)
    logits = torch.einsum("shd,thd->hst", q0, k0) / math.sqrt(q0.shape[-1])
    s = logits.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    logits = logits.masked_fill(~causal, float("-inf"))
    probs = logits.softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()
    return logits.masked_fill(~causal, -1e30).max().item(), entropy.item()


@pytest.mark.parametrize(
    "s,heads,groups,chunk,block_elems",
    [
        (200, 8, 2, 64, 1 << 24),  # GQA, chunk divides nothing evenly (200 = 3*64 + 8)
        (200, 8, 2, 48, 1),  # one group per block
        (130, 4, 4, 37, 1 << 24),  # MHA
        (96, 6, 1, 256, 1 << 24),  # MQA, one chunk larger than the sequence
        (257, 4, 2, 256, 5000),  # a last chunk of one query, blocks of one group
    ],
)
def test_chunked_attention_stats_match_the_dense_computation(s, heads, groups, chunk, block_elems):
    g = torch.Generator().manual_seed(s + heads)
    d = 32
    q = (3 * torch.randn(s, heads, d, generator=g)).bfloat16()  # bf16 inputs as in training
    k = (3 * torch.randn(s, groups, d, generator=g)).bfloat16()
    max_logit, entropy = attention_stats(q, k, chunk=chunk, block_elems=block_elems)
    ref_max, ref_ent = _dense_attention_stats(q, k)
    assert max_logit.item() == pytest.approx(ref_max, rel=1e-6)
    assert entropy.item() == pytest.approx(ref_ent, rel=1e-5)
    assert 0 < entropy.item() < math.log(s)


def test_labels():
    assert label("decoder.layers.3.self_attention.linear_qkv.weight") == "L3.attention.qkv"
    assert label("decoder.layers.0.mlp.linear_fc2.weight") == "L0.mlp.fc2"
    assert label("decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight") == "L1.expert5.fc1"
    assert label("decoder.layers.1.mlp.router.weight") == "L1.router"
    assert label("embedding.word_embeddings.weight") is None


def test_attention_probe_on_a_model(mcore_world):
    from megatron_md.models.builder import build_model
    from megatron_md.training.config import resolve
    from megatron_md.training.observability.diagnostics import AttentionProbe

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


@pytest.mark.multirank
@pytest.mark.e2e
def test_update_norms_at_tp2_ep2_match_one_rank_and_leave_training_alone(tmp_path):
    """--log-update-norms: every hidden matrix (attention, experts, router) gets its relative update over the
    diagnostics step; TP2 x EP2 sums the shards to one rank's value, and the copy it takes changes no loss."""
    from mdtest import MD_LAYOUT_FLAGS, md_seed, run_cli, train_records

    seed = md_seed("tiny-moe")
    common = ["train", "--model", "tiny-moe", *MD_LAYOUT_FLAGS, "--pretrained-checkpoint", str(seed),
              "--train-iters", "3", "--diagnostics-interval", "3"]

    def run(name, *extra):
        run_cli([*common, "--run-dir", str(tmp_path / name), *extra])
        return train_records(tmp_path / name)

    plain = run("plain")
    one = run("one", "--log-update-norms")
    split = run("tp2-ep2", "--log-update-norms", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2",
                "--sequence-parallel", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1")
    assert [r["lm_loss"] for r in one] == [r["lm_loss"] for r in plain]
    assert not any(k.endswith("rel_update") for r in plain for k in r)
    got = {k: v for k, v in one[-1].items() if k.endswith("/rel_update")}
    roles = {k.split("/")[1].split(".", 1)[1] for k in got}
    assert {"attention.qkv", "attention.proj", "router", "expert0.fc1", "expert3.fc2"} <= roles, roles
    assert all(0 < v < 0.5 for v in got.values()), got
    assert {k: v for k, v in split[-1].items() if k.endswith("/rel_update")} == pytest.approx(got, rel=1e-3)
    assert not any(k.endswith("rel_update") for k in one[0])  # only on diagnostics steps


def test_update_norms_need_diagnostics():
    from megatron_md.training.config import resolve
    from megatron_md.training.validate import ConfigError, validate_config

    cfg = resolve("tiny-dense", None, {"diagnostics_interval": 0, "log_update_norms": True, "mock_data": True})
    with pytest.raises(ConfigError, match="--log-update-norms .* --diagnostics-interval"):
        validate_config(cfg, 1)
