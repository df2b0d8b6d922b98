"""Geometry policy: parameter roles, presets, --geometry rule strings and the auto policy."""

from __future__ import annotations

import pytest

from megatron_md.optim import PRESETS, ROLES, Assignment, AutoPolicy, GeometryPolicy, layer_of, role_of

A = Assignment

NAMES = {
    "decoder.layers.3.self_attention.linear_qkv.weight": "attention.qkv",
    "module.decoder.layers.0.self_attention.linear_proj.weight": "attention.proj",
    "decoder.layers.1.mlp.linear_fc1.weight": "mlp.fc1",
    "decoder.layers.1.mlp.linear_fc2.weight": "mlp.fc2",
    "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight": "experts.fc1",
    "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight": "experts.fc2",
    "decoder.layers.2.mlp.experts.weight1": "experts.fc1",
    "decoder.layers.2.mlp.shared_experts.linear_fc2.weight": "experts.fc2",
    "decoder.layers.2.mlp.router.weight": "router",
    "embedding.word_embeddings.weight": "embedding",
    "embedding.position_embeddings.weight": "position_embedding",
    "output_layer.weight": "head",
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "norm",
    "decoder.layers.0.input_layernorm.weight": "norm",
    "decoder.layers.0.self_attention.q_layernorm.weight": "norm",
    "decoder.final_layernorm.weight": "norm",
    "decoder.layers.0.self_attention.linear_qkv.bias": "bias",
    # nanoGPT names (the paper's model)
    "transformer.h.4.attn.c_attn.weight": "attention.qkv",
    "transformer.h.4.attn.c_proj.weight": "attention.proj",
    "transformer.h.4.mlp.c_fc.weight": "mlp.fc1",
    "transformer.h.4.mlp.c_proj.weight": "mlp.fc2",
    "transformer.wte.weight": "embedding",
    "transformer.ln_f.weight": "norm",
    "lm_head.weight": "head",
}


@pytest.mark.parametrize("name,role", sorted(NAMES.items()))
def test_role_of(name, role):
    assert role_of(name) == role


def test_layer_of():
    assert layer_of("decoder.layers.12.mlp.linear_fc1.weight") == 12
    assert layer_of("transformer.h.4.attn.c_attn.weight") == 4
    assert layer_of("output_layer.weight") is None


PAPER = {  # preset: (attention, mlp) per docs/optimizers.md §2.8
    "unconstrained": ("none", "none"),
    "all-stiefel": ("stiefel", "stiefel"),
    "all-dgram": ("dgram", "dgram"),
    "hetero": ("stiefel", "dgram"),
    "hetero-inv": ("dgram", "stiefel"),
}


@pytest.mark.parametrize("preset", sorted(PAPER))
def test_paper_presets(preset):
    attn, mlp = PAPER[preset]
    pol = GeometryPolicy.preset(preset)
    for role in ("attention.qkv", "attention.proj"):
        assert pol.assign(role) == A(attn, "muon")
    for role in ("mlp.fc1", "mlp.fc2", "experts.fc1", "experts.fc2"):
        assert pol.assign(role) == A(mlp, "muon")
    assert pol.assign("router") == A("none", "muon")
    for role in ("embedding", "position_embedding", "head", "norm", "bias"):
        assert pol.assign(role) == A("none", "adam")


def test_md_presets_follow_md_routing():
    md = GeometryPolicy.preset("md")
    for role in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2", "experts.fc1", "router"):
        assert md.assign(role) == A("md", "muon")
    assert md.assign("embedding") == A("md", "adam") and md.assign("head") == A("md", "adam")
    assert md.assign("position_embedding") == A("none", "adam") and md.assign("norm") == A("none", "adam")
    hmd = GeometryPolicy.preset("hetero_md")  # underscores accepted
    assert hmd.assign("attention.qkv") == A("stiefel", "muon") and hmd.assign("attention.proj") == A("stiefel", "muon")
    assert hmd.assign("mlp.fc2") == A("md", "muon") and hmd.assign("experts.fc1") == A("md", "muon")
    assert hmd.assign("router") == A("md", "muon") and hmd.assign("head") == A("md", "adam")
    assert set(PRESETS) == {"unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv", "md", "hetero-md"}


def test_rule_string_prefixes_and_overrides():
    pol = GeometryPolicy.parse("attention.qkv=stiefel,attention.proj=stiefel,mlp=dgram,experts=md,router=md")
    assert pol.assign("attention.qkv") == A("stiefel", "muon")
    assert pol.assign("mlp.fc1") == A("dgram", "muon") and pol.assign("mlp.fc2") == A("dgram", "muon")
    assert pol.assign("experts.fc2") == A("md", "muon") and pol.assign("router") == A("md", "muon")
    assert pol.assign("embedding") == A("none", "adam")
    # later rules override earlier ones, presets compose with rules, explicit base
    pol = GeometryPolicy.parse("hetero, mlp.fc2=stiefel, attention=dgram, embedding=md:adam, mlp.fc1=none:adam")
    assert pol.assign("mlp.fc2") == A("stiefel", "muon") and pol.assign("experts.fc1") == A("dgram", "muon")
    assert pol.assign("attention.qkv") == A("dgram", "muon")
    assert pol.assign("embedding") == A("md", "adam") and pol.assign("mlp.fc1") == A("none", "adam")
    assert pol.assign_param("decoder.layers.7.mlp.linear_fc2.weight") == A("stiefel", "muon")
    assert GeometryPolicy.parse("hetero").table() == GeometryPolicy.preset("hetero").table()
    assert "attention.qkv=stiefel:muon" in GeometryPolicy.preset("hetero").describe()


@pytest.mark.parametrize("spec,match", [
    ("attn=stiefel", "unknown role 'attn'"),
    ("ml=dgram", "unknown role 'ml'"),  # prefix matching is per dotted component
    ("mlp=hyperbolic", "unknown geometry 'hyperbolic'"),
    ("mlp=dgram:sgd", "unknown base 'sgd'"),
    ("mlp=stiefel:adam", "base must be muon"),
    ("norm=stiefel", "vectors"),
    ("hetro", "neither a preset"),
    ("hetero,,mlp=dgram", "empty"),
])
def test_rule_errors_name_the_flag(spec, match):
    with pytest.raises(ValueError, match=match) as err:
        GeometryPolicy.parse(spec)
    assert "--geometry" in str(err.value)


def test_every_role_has_an_assignment():
    for preset in PRESETS:
        table = GeometryPolicy.preset(preset).table()
        assert set(table) == set(ROLES)
    with pytest.raises(ValueError):
        GeometryPolicy.preset("hetero").assign("attention")


def test_auto_policy_switches_on_sigma_max_sticky_and_logs():
    auto = AutoPolicy("all-dgram", sigma_max_threshold=10.0, logit_threshold=50.0)
    qkv3 = "decoder.layers.3.self_attention.linear_qkv.weight"
    assert auto.observe(qkv3, sigma_max=9.0) == []
    assert auto.assign_param(qkv3) == A("dgram", "muon")
    lines = auto.observe(qkv3, sigma_max=12.5)
    assert len(lines) == 1 and "layer 3 attention.qkv" in lines[0] and "dgram -> stiefel" in lines[0]
    assert "12.5" in lines[0] and "10" in lines[0]
    assert auto.assign_param(qkv3) == A("stiefel", "muon")
    assert auto.assign("attention.qkv", layer=4) == A("dgram", "muon")  # only layer 3 moved
    assert auto.assign_param("decoder.layers.3.self_attention.linear_proj.weight") == A("dgram", "muon")
    assert auto.observe(qkv3, sigma_max=1.0) == [] and auto.observe(qkv3, sigma_max=99.0) == []  # sticky, once
    assert auto.assign_param(qkv3) == A("stiefel", "muon") and len(auto.log) == 1


def test_auto_policy_logit_switches_the_layers_attention_only():
    auto = AutoPolicy("hetero-inv", logit_threshold=30.0)
    assert auto.observe(2, max_logit=29.0) == []
    lines = auto.observe("layers.2", max_logit=31.0)
    assert len(lines) == 2 and all("max attention logit 31" in ln for ln in lines)
    assert auto.assign("attention.qkv", 2) == A("stiefel", "muon") and auto.assign("attention.proj", 2).geometry == "stiefel"
    assert auto.assign("attention.qkv", 1).geometry == "dgram"
    assert auto.assign("mlp.fc1", 2).geometry == "stiefel"  # hetero-inv MLP is already Stiefel
    # role-wide observation (all layers); Adam-routed modules never switch; no threshold -> no switch
    # (unconstrained: MD modules never switch, test_auto_policy_never_switches_md_modules)
    auto2 = AutoPolicy("unconstrained", sigma_max_threshold=5.0)
    assert auto2.observe("embedding", sigma_max=100.0) == []
    assert auto2.observe("mlp", sigma_max=6.0) and auto2.assign("mlp.fc2", 7) == A("stiefel", "muon")
    assert auto2.observe(0, max_logit=1e9) == []
    with pytest.raises(ValueError, match="needs a module"):
        auto2.observe(0, sigma_max=10.0)
    # resume
    auto3 = AutoPolicy("hetero-inv", logit_threshold=30.0)
    auto3.load_state_dict(auto.state_dict())
    assert auto3.assign("attention.proj", 2) == A("stiefel", "muon") and auto3.log == auto.log


def test_auto_policy_never_switches_md_modules():
    """An MD module keeps its geometry: its gains and sphere are not a manifold's state, and the optimizer only
    moves manifold groups (a switch used to be logged for MD modules and then not applied)."""
    p = AutoPolicy("hetero-md,attention=none", sigma_max_threshold=1.0, logit_threshold=10.0)
    assert p.switchable_roles() == ["attention.qkv", "attention.proj"]
    assert p.observe("decoder.layers.0.mlp.linear_fc1.weight", sigma_max=5.0) == []
    assert p.assign_param("decoder.layers.0.mlp.linear_fc1.weight").geometry == "md"
    assert p.observe("decoder.layers.0.self_attention.linear_qkv.weight", sigma_max=5.0)  # a plain-Muon module does
    assert p.assign_param("decoder.layers.0.self_attention.linear_qkv.weight").geometry == "stiefel"
    assert AutoPolicy("hetero-md", sigma_max_threshold=1.0).switchable_roles() == []
