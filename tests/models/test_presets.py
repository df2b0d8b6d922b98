"""Presets: closed-form parameter counts match built models; the params CLI lists every preset."""

from __future__ import annotations

import re

import pytest

from megatron_md.cli import main as cli_main
from megatron_md.models.presets import PRESETS, count_parameters
from megatron_md.training.config import resolve


def _build(cfg):
    from megatron_md.models.builder import build_model

    return build_model(cfg, cfg.model.vocab_size, cpu=True)


@pytest.mark.parametrize(
    "preset,extra",
    [
        ("tiny-dense", {}),
        ("tiny-moe", {}),
        ("tiny-gpt2", {}),
        ("tiny-dense", {"sandwich_norm": True, "layer_scale": True, "embedding_scale": True}),
        ("tiny-dense", {"position_embedding_type": "learned_absolute", "swiglu": False,
                        "normalization": "LayerNorm", "disable_bias_linear": False, "qk_layernorm": False}),
        ("tiny-dense", {"hidden_size": 96}),
        ("tiny-moe", {"num_layers": 4, "moe_layer_freq": "2"}),  # MoE in layers 0 and 2, dense MLPs in 1 and 3
        ("tiny-dense", {"apply_layernorm_1p": True, "rotary_percent": 0.5}),
    ],
)
def test_count_matches_built_model(mcore_world, preset, extra):
    cfg = resolve(preset, None, dict(extra))
    model = _build(cfg)
    built = sum(p.numel() for p in model.parameters())
    assert count_parameters(cfg.model).total == built


def test_hidden_size_rescales_heads_and_ffn():
    cfg = resolve("dense-181m", None, {"hidden_size": 1024})
    m = cfg.model
    assert (m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size) == (8, 4, 4096)
    cfg = resolve("tiny-moe", None, {"hidden_size": 128})
    assert cfg.model.moe_ffn_hidden_size == 256 and cfg.model.num_attention_heads == 8


def test_paper_series_counts_match_names():
    for name, expect in [("dense-181m", 181e6), ("dense-307m", 307e6), ("dense-457m", 457e6),
                         ("dense-827m", 827e6), ("dense-1.29b", 1.29e9)]:
        n = count_parameters(resolve(name, None, {}).model).total
        assert abs(n - expect) / expect < 0.01, (name, n)


def test_params_cli_lists_every_preset(capsys):
    assert cli_main(["params"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    moe = [n for n in PRESETS if n.startswith("moe-")]
    totals = [count_parameters(resolve(n, None, {}).model).total for n in moe]
    assert 6.5e9 <= max(totals) <= 6.9e9
    assert re.search(r"moe-6\.7b\s+6\.\d\dB", out)


def test_unknown_preset_is_a_clear_error(capsys):
    assert cli_main(["params", "--model", "dense-9000b"]) == 2
    assert "--model 'dense-9000b' is not a known preset" in capsys.readouterr().err


def test_moe_preset_names_state_their_total():
    for name in PRESETS:
        if name.startswith("moe-"):
            stated = float(name[4:-1]) * 1e9
            n = count_parameters(resolve(name, None, {}).model).total
            assert abs(n - stated) / stated < 0.05, (name, n)
