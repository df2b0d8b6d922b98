"""SDPAttention (``--attention-backend sdpa``) against megatron-core's DotProductAttention on the CPU.

Forward outputs and the gradients of query, key and value agree in fp32 to rtol 1e-5 / atol 1e-6: the two
compute the same softmax(q k^T s) v in a different order (torch's CPU flash kernel tiles the keys and
rescales a running max; megatron forms the full score matrix), so they differ by fp32 rounding only
(measured at most 2e-6 absolute, 8e-7 relative to each tensor's largest entry, at these shapes). Settings SDPAttention does not implement are refused by
name; a 20-step training run and a checkpoint saved under one backend and resumed under the other go
through the real CLI.
"""

from __future__ import annotations

import math

import pytest
import torch

from mdtest import QUIET, run_cli, train_records

RTOL, ATOL = 1e-5, 1e-6


def _config(heads=4, groups=2, hn=8, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw.setdefault("attention_dropout", 0.0)
    return TransformerConfig(num_layers=2, hidden_size=heads * hn, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=hn, use_cpu_initialization=True, **kw)


def _pair(config, mask_type, softmax_scale=None, layer_number=1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_md.models.attention import SDPAttention

    kw = dict(config=config, layer_number=layer_number, attn_mask_type=mask_type, attention_type="self",
              cp_comm_type=None, softmax_scale=softmax_scale, pg_collection=None)
    return DotProductAttention(**kw), SDPAttention(**kw)


def _run(module, q, k, v, mask, grad):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _compare(ref, got):
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, got):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


CASES = [  # heads, groups, sq, batch, mask kind, softmax_scale
    (4, 2, 16, 2, "causal", None),
    (4, 1, 17, 2, "causal", None),  # MQA, odd length
    (4, 4, 33, 1, "causal", None),  # MHA
    (4, 2, 1, 3, "causal", None),  # one token: no mask, as in megatron
    (4, 2, 24, 2, "padding", None),
    (4, 1, 9, 2, "padding", 0.3),
    (4, 4, 16, 2, "causal", 0.05),
]


@pytest.mark.parametrize("heads, groups, s, b, kind, scale", CASES)
def test_forward_and_backward_equal_dot_product_attention(mcore_world, heads, groups, s, b, kind, scale):
    from megatron.core.transformer.enums import AttnMaskType

    g = torch.Generator().manual_seed(s * 100 + heads * 10 + groups)
    hn = 8
    q = torch.randn(s, b, heads, hn, generator=g)
    k, v = (torch.randn(s, b, groups, hn, generator=g) for _ in range(2))
    grad = torch.randn(s, b, heads * hn, generator=g)
    if kind == "causal":
        mask_type, mask = AttnMaskType.causal, None
    else:  # megatron's convention: True = masked out; a random padding of keys, every row keeping key 0
        mask_type = AttnMaskType.padding
        mask = torch.rand(b, 1, s, s, generator=g) < 0.4
        mask[..., 0] = False
    ref_mod, sdpa_mod = _pair(_config(heads, groups, hn), mask_type, scale)
    ref, got = _run(ref_mod, q, k, v, mask, grad), _run(sdpa_mod, q, k, v, mask, grad)
    _compare(ref, got)
    # The comparison can fail: without the mask (or with the wrong scale) the outputs differ.
    if s > 2:
        wrong = _run(sdpa_mod, q, k, v, None if mask is not None else torch.zeros(b, 1, s, s, dtype=torch.bool),
                     grad)
        assert (wrong[0] - ref[0]).abs().max() > 1e-3


def test_query_key_layer_scaling_cancels_as_in_megatron(mcore_world):
    """apply_query_key_layer_scaling divides the scores by the layer number and megatron's softmax multiplies
    them back: the result is unscaled attention, which SDPAttention computes directly."""
    from megatron.core.transformer.enums import AttnMaskType

    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(12, 2, 4, 8, generator=g), torch.randn(12, 2, 2, 8, generator=g), torch.randn(12, 2, 2, 8, generator=g)
    grad = torch.randn(12, 2, 32, generator=g)
    for scale in (None, 0.2):
        ref_mod, sdpa_mod = _pair(_config(apply_query_key_layer_scaling=True), AttnMaskType.causal, scale, layer_number=3)
        assert ref_mod.softmax_scale == pytest.approx((scale or 1 / math.sqrt(8)) / 3, rel=1e-12)
        assert sdpa_mod.softmax_scale == pytest.approx(scale or 1 / math.sqrt(8), rel=1e-12)
        _compare(_run(ref_mod, q, k, v, None, grad), _run(sdpa_mod, q, k, v, None, grad))


def test_dropout_draws_from_the_model_parallel_rng_stream(mcore_world):
    """As DotProductAttention: dropout runs under the tracker's fork, so it follows the tracker's seed and
    leaves the default stream where it was."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_md.models.attention import SDPAttention

    mod = SDPAttention(config=_config(4, 2, 8, attention_dropout=0.5), layer_number=1,
                       attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=None)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(8, 2, 4, 8, generator=g), torch.randn(8, 2, 2, 8, generator=g), torch.randn(8, 2, 2, 8, generator=g)

    def draw(seed):
        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(7)
        before = torch.get_rng_state()
        out = mod(q, k, v, None)
        assert torch.equal(torch.get_rng_state(), before)  # the fork restored the default stream
        return out

    a, b, c = draw(11), draw(11), draw(12)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert get_cuda_rng_tracker().is_initialized()
    mod.eval()
    torch.testing.assert_close(mod(q, k, v, None), _pair(_config(4, 2, 8), AttnMaskType.causal)[0](q, k, v, None),
                               rtol=RTOL, atol=ATOL)  # eval: no dropout


@pytest.mark.parametrize("field, value, says", [
    ("window_size", (4, 0), "window_size"),
    ("softmax_type", "off-by-one", "softmax_type"),
    ("context_parallel_size", 2, "context_parallel_size"),
])
def test_unsupported_config_is_refused_at_build(mcore_world, field, value, says):
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from megatron_md.models.attention import SDPAttention, refuse_unsupported

    base = {"context_parallel_size": 1, "window_size": None, "softmax_type": "vanilla"}
    with pytest.raises(ValueError, match=rf"--attention-backend sdpa.*{says}"):
        refuse_unsupported(SimpleNamespace(**{**base, field: value}))
    refuse_unsupported(SimpleNamespace(**base))  # the default passes
    if field == "window_size":  # and through the constructor, on a real TransformerConfig
        with pytest.raises(ValueError, match="--attention-backend local"):
            SDPAttention(config=_config(window_size=value), layer_number=1, attn_mask_type=AttnMaskType.causal)


def test_packed_sequences_and_attention_bias_are_refused(mcore_world):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    _, mod = _pair(_config(), AttnMaskType.causal)
    q, kv = torch.randn(4, 1, 4, 8), torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match="--attention-backend sdpa.*packed"):
        mod(q, kv, kv, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="--attention-backend sdpa.*bias"):
        mod(q, kv, kv, None, attention_bias=torch.zeros(1, 4, 4, 4))
    with pytest.raises(ValueError, match="as many queries as keys"):
        mod(q, torch.randn(6, 1, 2, 8), torch.randn(6, 1, 2, 8), None)


def test_a_backend_the_layer_spec_cannot_take_is_refused_before_launch(monkeypatch):
    from megatron_md.models import backends
    from megatron_md.training import config as C
    from megatron_md.training.validate import ConfigError, validate_config

    def check(**cli):
        validate_config(C.resolve("tiny-dense", None, {"mock_data": True, **cli}), 1)

    with pytest.raises(ConfigError, match="--attention-backend flash is a Transformer Engine kernel.*sdpa"):
        check(device="cpu", attention_backend="flash")
    check(device="cpu", attention_backend="sdpa")
    monkeypatch.setattr(backends, "transformer_engine_available", lambda: True)  # a GPU machine with TE
    with pytest.raises(ConfigError, match="--attention-backend sdpa plugs into.*--transformer-impl local"):
        check(device="cuda", attention_backend="sdpa")
    check(device="cuda", attention_backend="sdpa", transformer_impl="local")
    check(device="cuda")  # auto: TE's choice


def test_no_parameters_and_no_state(mcore_world):
    """Checkpoints do not change with the backend: neither module owns a tensor."""
    from megatron.core.transformer.enums import AttnMaskType

    for mod in _pair(_config(), AttnMaskType.causal):
        assert list(mod.parameters()) == [] and list(mod.buffers()) == [] and mod.state_dict() == {}


# ----------------------------------------------------------------------------- through the CLI

TRAIN = ["train", "--model", "tiny-dense", "--mock-data", "--global-batch-size", "2", "--micro-batch-size", "1",
         "--seq-length", "32", "--log-interval", "1", "--eval-iters", "1", "--optimizer", "adam", *QUIET]


def _losses(run):
    return [r["lm_loss"] for r in train_records(run)]


def _equal(a, b, rel=1e-5):
    assert len(a) == len(b) and a, (a, b)
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert worst <= rel, (worst, a, b)
    return worst


@pytest.mark.e2e
def test_twenty_fp32_steps_match_the_local_backend(tmp_path):
    runs = {}
    for backend in ("local", "sdpa"):
        runs[backend] = tmp_path / backend
        out = run_cli([*TRAIN, "--train-iters", "20", "--attention-backend", backend, "--run-dir", str(runs[backend])])
        assert f"layer spec: local, attention {backend}" in out.stdout + out.stderr  # the backend asked for ran
    local, sdpa = _losses(runs["local"]), _losses(runs["sdpa"])
    assert len(local) == 20
    _equal(sdpa, local)
    assert local[-1] < local[0]  # it trained


def test_checkpoint_saved_with_local_resumes_with_sdpa(tmp_path):
    """Saved with local, resumed with auto (sdpa on the CPU): the continued losses are the straight run's."""
    ck = tmp_path / "ck"
    run_cli([*TRAIN, "--train-iters", "8", "--attention-backend", "local", "--save", str(ck), "--save-interval", "4",
             "--run-dir", str(tmp_path / "straight")])
    (ck / "latest_checkpointed_iteration.txt").write_text("4\n")
    out = run_cli([*TRAIN, "--train-iters", "8", "--load", str(ck), "--run-dir", str(tmp_path / "resumed")])
    assert "attention sdpa" in out.stdout + out.stderr  # auto on the CPU
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert len(straight) == 8 and len(resumed) == 4
    _equal(resumed, straight[4:])
