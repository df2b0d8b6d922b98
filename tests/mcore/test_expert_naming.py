"""Expert parameter names -> one layout-independent key (issue 14, item 5).

megatron-core's SequentialMLP names a routed expert ``mlp.experts.local_experts.{n}.linear_fc1.weight``,
TE's TEGroupedMLP ``mlp.experts.linear_fc1.weight{n}`` and the legacy GroupedMLP packs every local
expert into ``mlp.experts.weight1`` / ``weight2``. TE is not installed here, so the models are plain
torch modules whose parameter names are exactly those megatron produces; EP rank and size are faked.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_md.mcore import naming
from megatron_md.optim.policy import layer_of, role_of
from megatron_md.training.observability.diagnostics import label

H, FFN, EXPERTS = 4, 3, 4


def _linear(out_features: int, in_features: int) -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(torch.zeros(out_features, in_features))
    return m


def _experts(layout: str, local: int) -> nn.Module:
    experts = nn.Module()
    if layout == "sequential":  # SequentialMLP: one MLP per local expert
        experts.local_experts = nn.ModuleList()
        for _ in range(local):
            mlp = nn.Module()
            mlp.linear_fc1, mlp.linear_fc2 = _linear(2 * FFN, H), _linear(H, FFN)
            experts.local_experts.append(mlp)
    elif layout == "grouped":  # TEGroupedMLP: TE GroupedLinear's weight0..weight{local-1}
        experts.linear_fc1, experts.linear_fc2 = nn.Module(), nn.Module()
        for n in range(local):
            experts.linear_fc1.register_parameter(f"weight{n}", nn.Parameter(torch.zeros(2 * FFN, H)))
            experts.linear_fc2.register_parameter(f"weight{n}", nn.Parameter(torch.zeros(H, FFN)))
    elif layout == "legacy":  # GroupedMLP (megatron-core < 0.19): every local expert in one matrix
        experts.weight1 = nn.Parameter(torch.zeros(H, local * 2 * FFN))
        experts.weight2 = nn.Parameter(torch.zeros(local * FFN, H))
    else:
        raise ValueError(layout)
    return experts


def _gpt(layout: str, *, ep_size: int, layers: int = 2, first_layer: int = 0, gated: bool = True) -> nn.Module:
    """A GPTModel-shaped module: this stage's layers first_layer.. (layer_number is 1-based and global)."""
    gpt = nn.Module()
    gpt.config = SimpleNamespace(num_moe_experts=EXPERTS, gated_linear_unit=gated)
    gpt.embedding = nn.Module()
    gpt.embedding.word_embeddings = _linear(16, H)
    gpt.decoder = nn.Module()
    gpt.decoder.layers = nn.ModuleList()
    for i in range(layers):
        layer = nn.Module()
        layer.layer_number = first_layer + i + 1
        layer.self_attention = nn.Module()
        layer.self_attention.linear_qkv = _linear(3 * H, H)
        layer.mlp = nn.Module()
        layer.mlp.router = _linear(EXPERTS, H)
        layer.mlp.experts = _experts(layout, EXPERTS // ep_size)
        gpt.decoder.layers.append(layer)
    return gpt


def _tag(monkeypatch, gpt: nn.Module, *, ep_rank: int, ep_size: int) -> dict[str, nn.Parameter]:
    from megatron_md.mcore import param_tags

    monkeypatch.setattr(param_tags.ps, "get_expert_model_parallel_rank", lambda: ep_rank)
    monkeypatch.setattr(param_tags.ps, "get_expert_model_parallel_world_size", lambda: ep_size)
    param_tags.tag_params(gpt)
    return dict(gpt.named_parameters())


def _expert_keys(params: dict) -> set[str]:
    return {p.md_key for p in params.values() if ".experts." in p.md_key}


def test_canonical_name_maps_both_namings_to_the_global_expert():
    seq = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    grouped = "decoder.layers.1.mlp.experts.linear_fc1.weight1"
    want = "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    for name in (seq, grouped):
        assert naming.canonical_name(name, global_layer=lambda i: i + 2, ep_rank=1, num_local_experts=4) == want
    assert naming.canonical_name("module.decoder.layers.0.mlp.experts.linear_fc2.bias3") == (
        "module.decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.bias")
    # Not routed experts: only the layer changes.
    for name in ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", "decoder.layers.0.mlp.router.weight",
                 "embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"):
        assert naming.canonical_name(name, global_layer=lambda i: i, ep_rank=3, num_local_experts=2) == name
    assert naming.expert_param(grouped) == naming.ExpertParam(1, "linear_fc1", "weight", True)
    assert naming.is_packed_expert("decoder.layers.0.mlp.experts.weight1")
    assert naming.is_packed_expert("decoder.layers.0.mlp.experts.linear_fc1.weight")  # TE single grouped weight
    assert not naming.is_packed_expert(seq) and not naming.is_packed_expert(grouped)
    assert not naming.is_packed_expert("decoder.layers.0.mlp.shared_experts.linear_fc1.weight")


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_md_keys_unique_across_ep_ranks_and_equal_for_sequential_and_grouped(monkeypatch, ep_size):
    union = {"sequential": set(), "grouped": set()}
    for rank in range(ep_size):
        keys = {}
        for layout in union:
            params = _tag(monkeypatch, _gpt(layout, ep_size=ep_size, first_layer=2), ep_rank=rank, ep_size=ep_size)
            keys[layout] = _expert_keys(params)
            assert len(keys[layout]) == 2 * 2 * EXPERTS // ep_size  # 2 layers x fc1/fc2 x local experts
            assert not keys[layout] & union[layout], "an expert key repeats on another EP rank"
            union[layout] |= keys[layout]
        assert keys["sequential"] == keys["grouped"]
    want = {f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_{fc}.weight"
            for layer in (2, 3) for e in range(EXPERTS) for fc in ("fc1", "fc2")}
    assert union["sequential"] == union["grouped"] == want


@pytest.mark.parametrize("layout", ["sequential", "grouped"])
def test_swiglu_roles_and_labels(monkeypatch, layout):
    params = _tag(monkeypatch, _gpt(layout, ep_size=2), ep_rank=1, ep_size=2)
    for name, p in params.items():
        expert = naming.expert_param(name)
        fc1 = name.endswith("linear_fc1.weight") or (expert is not None and expert.fc == "linear_fc1")
        assert p.md_swiglu == fc1, name
        if expert is None:
            continue
        fc = expert.fc[-3:]
        assert role_of(name) == role_of(p.md_key) == f"experts.{fc}", name
        assert layer_of(name) == layer_of(p.md_key)
        layer, e = layer_of(p.md_key), 2 + expert.expert  # EP rank 1 of 2: global = 2 + local
        assert label(p.md_key) == f"L{layer}.expert{e}.{fc}"
        assert label(name) == f"L{layer}.expert{expert.expert}.{fc}"  # a raw name carries its local index
    no_glu = _tag(monkeypatch, _gpt(layout, ep_size=2, gated=False), ep_rank=0, ep_size=2)
    assert not any(p.md_swiglu for p in no_glu.values())


def test_role_of_grouped_fc2_weight1_is_fc2():
    # TE's weight1 / weight2 are expert indices, not the legacy GroupedMLP's fc1 / fc2 matrices.
    assert role_of("decoder.layers.0.mlp.experts.linear_fc2.weight1") == "experts.fc2"
    assert role_of("decoder.layers.0.mlp.experts.linear_fc1.weight2") == "experts.fc1"
    assert role_of("decoder.layers.0.mlp.experts.linear_fc2.bias1") == "bias"
    assert role_of("decoder.layers.0.mlp.experts.weight1") == "experts.fc1"
    assert role_of("decoder.layers.0.mlp.experts.weight2") == "experts.fc2"


def test_md_optimizers_refuse_packed_experts(monkeypatch):
    from megatron_md.mcore import manifold_optimizer, md_optimizer

    legacy = _gpt("legacy", ep_size=2)
    params = _tag(monkeypatch, legacy, ep_rank=0, ep_size=2)  # tagging itself does not refuse (AdamW runs)
    assert not any(p.md_swiglu for n, p in params.items() if ".experts." in n)
    calls = [
        (lambda chunks: md_optimizer._config_to_kwargs(SimpleNamespace(md_base="muon"), chunks, None), "muon_md"),
        (lambda chunks: md_optimizer._config_to_kwargs(SimpleNamespace(md_base="adam"), chunks, None), "adam_md"),
        (lambda chunks: manifold_optimizer._config_to_kwargs(SimpleNamespace(), chunks, None), "manifold_muon"),
    ]
    for build, optimizer in calls:
        with pytest.raises(ValueError) as err:
            build([legacy])
        msg = str(err.value)
        assert f"--optimizer {optimizer}" in msg and "decoder.layers.0.mlp.experts.weight1" in msg
        assert "--moe-grouped-gemm" in msg and "--no-moe-grouped-gemm" in msg and "Transformer Engine" in msg
        for layout in ("sequential", "grouped"):
            assert build([_gpt(layout, ep_size=2)])["pg_collection"] is None


def test_hf_export_reads_both_namings():
    from megatron_md.convert.mappings import _expert

    w = torch.arange(6.0).view(2, 3)
    s = "decoder.layers.1."
    for name in naming.expert_names(s, 2, "linear_fc1"):
        assert torch.equal(_expert({name: w}, s, 2, "linear_fc1"), w)
    assert naming.expert_names(s, 2, "linear_fc2") == (
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
        "decoder.layers.1.mlp.experts.linear_fc2.weight2",
    )


def test_grouped_gemm_default_follows_transformer_engine():
    from megatron_md.models.builder import moe_grouped_gemm

    def m(flag, experts=4):
        return SimpleNamespace(num_experts=experts, moe_grouped_gemm=flag)

    assert moe_grouped_gemm(m(None), use_te=True) is True
    assert moe_grouped_gemm(m(None), use_te=False) is False
    assert moe_grouped_gemm(m(False), use_te=True) is False
    assert moe_grouped_gemm(m(True), use_te=True) is True
    assert moe_grouped_gemm(m(None, experts=None), use_te=True) is False
    with pytest.warns(UserWarning, match="--moe-grouped-gemm needs Transformer Engine"):
        assert moe_grouped_gemm(m(True), use_te=False) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moe_grouped_gemm(m(False), use_te=False)


def test_config_flag_unset_by_default():
    from megatron_md.training.config import resolve

    assert resolve("tiny-moe", None, {}).model.moe_grouped_gemm is None
    assert resolve("tiny-moe", None, {"moe_grouped_gemm": False}).model.moe_grouped_gemm is False


def test_grouped_params_carry_sequential_tp_attributes(mcore_world):
    """TEGroupedLinear marks each weight{n} as megatron's Column/RowParallelLinear mark an expert weight,
    so the MD TP reducer (tensor_model_parallel, partition_dim) and the EDP reduction (allreduce) agree."""
    from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, use_cpu_initialization=True)
    init = torch.nn.init.zeros_
    sequential = {
        "column": ColumnParallelLinear(H, 2 * FFN, config=config, init_method=init, bias=False, is_expert=True),
        "row": RowParallelLinear(FFN, H, config=config, init_method=init, bias=False, input_is_parallel=True,
                                 skip_bias_add=True, is_expert=True),
    }
    use_expert_pgs = False  # TEGroupedLinear's rule: is_expert and (EP > 1 or ETP != TP); both are 1 here
    for mode, linear in sequential.items():
        grouped = nn.Module()
        for n in range(2):
            grouped.register_parameter(f"weight{n}", nn.Parameter(torch.zeros(1)))
        _set_expert_parameter_attributes(grouped, mode, use_expert_pgs)
        for name, p in grouped.named_parameters():
            for attr in ("tensor_model_parallel", "partition_dim", "allreduce"):
                assert getattr(p, attr) == getattr(linear.weight, attr), (mode, name, attr)
