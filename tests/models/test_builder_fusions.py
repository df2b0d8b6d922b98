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


FUSIONS = ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "gradient_accumulation_fusion",
           "cross_entropy_loss_fusion")


def _tc(cli: dict, *, cpu: bool, use_te: bool):
    cfg = C.resolve("tiny-dense", None, dict(cli))
    if use_te:  # megatron-core refuses to build a TransformerConfig with fused RoPE when TE is absent (here)
        from types import SimpleNamespace

        return SimpleNamespace(**builder.fusion_settings(cfg.model, cpu=cpu, use_te=True, grouped=False),
                               attention_backend=builder.attention_backend(cfg.model, cpu=cpu, use_te=True))
    return builder.transformer_config(cfg.model, cfg.parallel, bf16=True, cpu=cpu, use_te=use_te)


def test_fusions_default_on_with_cuda_and_te_off_on_cpu():
    cuda = _tc({}, cpu=False, use_te=True)
    assert all(getattr(cuda, f) for f in FUSIONS), {f: getattr(cuda, f) for f in FUSIONS}
    cpu = _tc({}, cpu=True, use_te=False)
    assert not any(getattr(cpu, f) for f in FUSIONS), {f: getattr(cpu, f) for f in FUSIONS}
    # Without TE on CUDA: no fused RoPE kernel, no wgrad fusion (no Apex here either).
    local = _tc({}, cpu=False, use_te=False)
    assert not local.apply_rope_fusion and local.bias_activation_fusion


def test_no_fusion_flags_turn_each_off_on_cuda():
    off = _tc({"rope_fusion": False, "bias_swiglu_fusion": False, "bias_dropout_fusion": False,
               "gradient_accumulation_fusion": False, "cross_entropy_loss_fusion": False}, cpu=False, use_te=True)
    assert not any(getattr(off, f) for f in FUSIONS)


def test_fusion_asked_for_where_it_cannot_run_is_refused():
    import pytest

    for flag in ("rope_fusion", "gradient_accumulation_fusion", "cross_entropy_loss_fusion"):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} needs"):
            _tc({flag: True}, cpu=True, use_te=False)


def test_attention_backend_and_recompute_reach_transformer_config():
    import pytest
    from megatron.core.transformer.enums import AttnBackend

    assert _tc({"attention_backend": "flash"}, cpu=False, use_te=True).attention_backend == AttnBackend.flash
    assert _tc({"attention_backend": "local"}, cpu=True, use_te=False).attention_backend == AttnBackend.local
    with pytest.raises(ValueError, match="--attention-backend flash"):
        _tc({"attention_backend": "flash"}, cpu=True, use_te=False)
    with pytest.raises(ValueError, match="--transformer-impl local"):
        _tc({"attention_backend": "local"}, cpu=False, use_te=True)
    sel = _tc({"recompute_granularity": "selective"}, cpu=True, use_te=False)
    assert sel.recompute_granularity == "selective" and sel.recompute_modules == ["core_attn"]
    full = _tc({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
               cpu=True, use_te=False)
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "block", 2)
    with pytest.raises(ValueError, match="--recompute-granularity full"):
        _tc({"recompute_method": "uniform"}, cpu=True, use_te=False)


def test_moe_knobs_reach_transformer_config():
    cfg = C.resolve("tiny-moe", None, {"moe_z_loss_coeff": 1e-3, "moe_expert_capacity_factor": 1.5,
                                       "moe_token_drop_policy": "position", "moe_shared_expert_intermediate_size": 64})
    tc = builder.transformer_config(cfg.model, cfg.parallel, bf16=False, cpu=True, use_te=False)
    assert (tc.moe_z_loss_coeff, tc.moe_expert_capacity_factor, tc.moe_token_drop_policy,
            tc.moe_shared_expert_intermediate_size) == (1e-3, 1.5, "position", 64)


def test_auto_attention_is_sdpa_with_the_local_spec_and_te_s_choice_under_te():
    """auto: TE's backend when TE builds the layers, SDPAttention in the local spec (CPU included); megatron
    gets AttnBackend.auto (its default) for sdpa; local keeps megatron's DotProductAttention; sdpa under TE is refused."""
    import pytest
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    from megatron_md.models.attention import SDPAttention

    def resolved(cli, *, cpu, use_te):
        return builder.resolved_attention_backend(C.resolve("tiny-dense", None, dict(cli)).model, cpu=cpu, use_te=use_te)

    assert resolved({}, cpu=True, use_te=False) == resolved({}, cpu=False, use_te=False) == "sdpa"
    assert resolved({}, cpu=False, use_te=True) == "auto"
    assert _tc({}, cpu=True, use_te=False).attention_backend == AttnBackend.auto
    assert _tc({"attention_backend": "sdpa"}, cpu=False, use_te=False).attention_backend == AttnBackend.auto
    assert _tc({}, cpu=False, use_te=True).attention_backend == AttnBackend.auto
    with pytest.raises(ValueError, match="--attention-backend sdpa.*--transformer-impl local"):
        _tc({"attention_backend": "sdpa"}, cpu=False, use_te=True)
    for cli, module in (({}, SDPAttention), ({"attention_backend": "sdpa"}, SDPAttention),
                        ({"attention_backend": "local"}, DotProductAttention),
                        ({"attention_backend": "unfused"}, DotProductAttention)):
        cfg = C.resolve("tiny-dense", None, dict(cli))
        tc = builder.transformer_config(cfg.model, cfg.parallel, bf16=False, cpu=True, use_te=False)
        spec, _ = builder.layer_spec(cfg.model, tc, use_te=False)
        assert spec.submodules.self_attention.submodules.core_attention is module, cli
