"""Per-head max logits (models/logits.py): the chunked Q·Kᵀ and the local backend's scores against brute force,
and inside a model equal across attention backends and to the logits recomputed from what attention received."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_md.models.logits import head_max_from_scores, head_max_logits


def _dense(q, k, scale, mask=None, causal=False):
    """[heads] max over visible pairs, one full [b, h, sq, sk] tensor (the obvious way)."""
    sq, b, h, d = q.shape
    rep = h // k.shape[2]
    kk = k.repeat_interleave(rep, dim=2)
    logits = scale * torch.einsum("sbhd,tbhd->bhst", q.double(), kk.double())
    if mask is not None:
        logits = logits.masked_fill(mask, -math.inf)
    elif causal:
        logits = logits.masked_fill(torch.ones(sq, k.shape[0], dtype=torch.bool).triu(1), -math.inf)
    return logits.amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("kind", ["causal", "padding", "none"])
def test_chunked_max_equals_brute_force(heads, groups, kind):
    gen = torch.Generator().manual_seed(heads + groups)
    s, b, d = 37, 3, 16
    q, k = torch.randn(s, b, heads, d, generator=gen), torch.randn(s, b, groups, d, generator=gen)
    mask = None
    if kind == "padding":
        mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
        mask[0, :, :, 30:] = True  # sequence 0 padded after 30 keys
        mask[2, :, :, :5] = True
    scale = 0.3
    ref = _dense(q, k, scale, mask, causal=kind == "causal")
    # tiny blocks: many chunks of query rows, including a ragged last one
    got = head_max_logits(q, k, scale, mask, causal=kind == "causal", block_elems=heads * s * 4)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_scores_max_applies_mask_and_extra_scale():
    gen = torch.Generator().manual_seed(1)
    b, h, s = 2, 3, 9
    scores = torch.randn(b, h, s, s, generator=gen)
    scores[..., 0, 5] = 100.0  # above the diagonal: masked by causality
    got = head_max_from_scores(scores, None, causal=True, extra_scale=2.0)
    ref = 2.0 * scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(got, ref)
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    mask[..., 3] = True
    ref = scores.masked_fill(mask, -math.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(head_max_from_scores(scores, mask, causal=True), ref)


def _model(preset: str, backend: str, extra: dict | None = None):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.utils import unwrap_model

    from megatron_md.training.build import build_wrapped_model
    from megatron_md.training.config import resolve

    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    cfg = resolve(preset, None, {"optimizer": "adam", "mock_data": True, "attention_backend": backend,
                                 "seq_length": 24, **(extra or {})})
    model, _ = build_wrapped_model(cfg, cfg.model.vocab_size, cpu=True)
    return cfg, unwrap_model(model)


def _capture(gpt):
    """Brute-force per-head maxima from the q and k each layer's core attention receives."""
    seen = {}

    def hook(idx, module):
        def fn(mod, args, kwargs):
            q, k = args[0], args[1]
            scale = getattr(mod, "softmax_scale", None) or 1.0 / math.sqrt(q.shape[-1])
            prev = seen.get(idx)
            cur = _dense(q.detach(), k.detach(), scale, causal=True)
            seen[idx] = cur if prev is None else torch.maximum(prev, cur)
        return fn

    handles = [layer.self_attention.core_attention.register_forward_pre_hook(
        hook(layer.layer_number - 1, layer.self_attention.core_attention), with_kwargs=True)
        for layer in gpt.decoder.layers]
    return seen, handles


@pytest.mark.parametrize("preset,extra", [("tiny-dense", {}),  # QK-norm and RoPE
                                          ("tiny-gpt2", {}),  # learned positions, no QK-norm
                                          ("tiny-dense", {"num_query_groups": 2})])  # GQA
def test_probe_equal_across_backends_and_to_brute_force(mcore_world, preset, extra):
    from megatron_md.models.logits import MaxLogitProbe

    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24).unsqueeze(0).expand(2, -1)
    results = {}
    for backend in ("local", "sdpa"):
        cfg, gpt = _model(preset, backend, extra)
        probe = MaxLogitProbe(gpt)
        seen, handles = _capture(gpt)
        probe.armed = True
        with torch.no_grad():
            for _ in range(2):  # two micro-batches: a running maximum
                gpt(tokens, pos, None)
                tokens = tokens.flip(1)
        got = probe.take()
        for h in handles:
            h.remove()
        assert sorted(got) == list(range(cfg.model.num_layers))
        for idx, v in got.items():
            assert v.shape == (gpt.decoder.layers[idx].self_attention.num_attention_heads_per_partition,)
            torch.testing.assert_close(v, seen[idx], rtol=1e-5, atol=1e-6)
        results[backend] = got
        probe.armed = False
        gpt(tokens, pos, None)
        assert probe.take() == {}  # disarmed: nothing measured
    for idx in results["local"]:
        torch.testing.assert_close(results["sdpa"][idx], results["local"][idx], rtol=1e-5, atol=1e-6)
