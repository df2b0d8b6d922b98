"""Hugging Face -> megatron: which ``config.json`` imports, as which ModelConfig, and the tensor mapping.

The inverse of ``mappings.megatron_to_hf`` for the families that import (``IMPORTABLE``): dense Qwen3 and
Llama, and the MoE families Qwen3-MoE, Qwen2-MoE and Mixtral. Everything else is refused with the ``config.json``
field that makes it impossible and why (``REFUSED``), before any tensor is read.
"""

from __future__ import annotations

import math

import torch

from megatron_md.convert.mappings import ConversionError, merge_qkv

IMPORTABLE = ("qwen3", "llama", "qwen3_moe", "qwen2_moe", "mixtral")
MOE = ("qwen3_moe", "qwen2_moe", "mixtral")

# Architectures people ask for that megatron-core's GPT layers (as this trainer builds them) cannot reproduce.
REFUSED = {
    "olmoe": "OLMoE normalises q and k over the whole projection (RMSNorm of width hidden_size, one weight per "
             "channel of all heads together), while megatron-core's qk_layernorm normalises each head "
             "(width kv_channels); the logits would differ, so it is not imported",
    "deepseek_v3": "DeepSeek-V3 uses multi-latent attention and sigmoid routing with grouped top-k, which this "
                   "trainer's GPT model does not build",
}


def _refuse(field: str, why: str):
    raise ConversionError(f"config.json {field}: {why}")


def _rope_theta(hc: dict) -> int:
    rope = hc.get("rope_parameters") or hc.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        kind = rope.get("rope_type", rope.get("type"))
        raise ConversionError(f"config.json rope type {kind!r}: only plain RoPE is supported")
    theta = float(rope.get("rope_theta", hc.get("rope_theta") or 10000.0))
    if theta != int(theta):
        _refuse("rope_theta", f"{theta}: --rotary-base is an integer")
    return int(theta)


def _moe_fields(hc: dict, mt: str) -> dict:
    """The MoE part of a Qwen3-MoE or Mixtral config.json."""
    shared = {}
    if mt == "qwen2_moe":  # a shared expert every token goes through, scaled by a sigmoid gate
        if not hc.get("shared_expert_intermediate_size"):
            _refuse("shared_expert_intermediate_size", "0: Qwen2-MoE's shared expert always exists")
        shared = dict(moe_shared_expert_intermediate_size=hc["shared_expert_intermediate_size"],
                      moe_shared_expert_gate=True)
    if mt in ("qwen3_moe", "qwen2_moe"):
        if (hc.get("decoder_sparse_step") or 1) != 1 or hc.get("mlp_only_layers"):
            _refuse("decoder_sparse_step / mlp_only_layers", "dense layers among the MoE ones are not imported "
                    "(the Hugging Face export writes every layer as MoE, so the round trip would not hold)")
        # published configs say num_experts; transformers 5 writes its alias num_local_experts
        experts, ffn = hc.get("num_experts") or hc["num_local_experts"], hc["moe_intermediate_size"]
        # Qwen3-MoE: softmax over all experts, top-k, renormalised when norm_topk_prob; megatron's default
        # router (top-k of the logits, softmax over those) is the renormalised one, its pre-softmax the other.
        pre_softmax = not hc.get("norm_topk_prob", False)
    else:
        if hc.get("router_jitter_noise"):
            _refuse("router_jitter_noise", f"{hc['router_jitter_noise']}: router jitter is not imported")
        experts, ffn, pre_softmax = hc["num_local_experts"], hc["intermediate_size"], False
    return dict(num_experts=experts, moe_router_topk=hc["num_experts_per_tok"], moe_ffn_hidden_size=ffn,
                moe_router_pre_softmax=pre_softmax,
                moe_aux_loss_coeff=float(hc.get("router_aux_loss_coef") or 0.0), **shared)


def model_overrides_from_hf(hc: dict) -> dict:
    """ModelConfig fields of a Qwen3, Llama, Qwen3-MoE or Mixtral ``config.json``; refuses what we cannot build."""
    mt = hc.get("model_type")
    if mt in REFUSED:
        raise ConversionError(f"config.json model_type {mt!r}: {REFUSED[mt]}")
    if mt not in IMPORTABLE:
        raise ConversionError(f"config.json model_type {mt!r}: import supports {', '.join(IMPORTABLE)}")
    if hc.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", f"{hc['hidden_act']!r}: our SwiGLU uses silu")
    theta = _rope_theta(hc)
    if hc.get("use_sliding_window") or (mt in ("llama", "mixtral") and hc.get("sliding_window")):
        _refuse("sliding_window", "sliding-window attention is not supported")
    bias = bool(hc.get("attention_bias", False))
    qkv_bias = mt == "qwen2_moe" and bool(hc.get("qkv_bias", True))  # Qwen2: q/k/v biases, none on o_proj
    if mt != "llama" and bias:
        _refuse("attention_bias", f"with {mt}: megatron's linear biases cover the MLP too")
    if mt == "llama" and bias != bool(hc.get("mlp_bias", False)):
        _refuse("attention_bias != mlp_bias", "megatron biases all linear layers or none")
    if (hc.get("pretraining_tp") or 1) != 1:
        _refuse("pretraining_tp", "values other than 1 are not supported")
    heads, vocab = hc["num_attention_heads"], hc["vocab_size"]
    max_pos = hc.get("max_position_embeddings", 4096)
    fields = dict(
        num_layers=hc["num_hidden_layers"], hidden_size=hc["hidden_size"], num_attention_heads=heads,
        num_query_groups=hc.get("num_key_value_heads") or heads,
        kv_channels=hc.get("head_dim") or hc["hidden_size"] // heads,
        ffn_hidden_size=hc["intermediate_size"], max_position_embeddings=max_pos,
        seq_length=min(max_pos, 4096), vocab_size=vocab,
        # the largest power of two (<= 128) dividing the vocabulary: TP1 padding keeps it as is
        make_vocab_size_divisible_by=math.gcd(vocab, 128),
        position_embedding_type="rope", rotary_base=theta, normalization="RMSNorm",
        norm_epsilon=float(hc.get("rms_norm_eps", 1e-6)), swiglu=True,
        untie_embeddings_and_output_weights=not hc.get("tie_word_embeddings", False),
        disable_bias_linear=not bias, add_qkv_bias=qkv_bias, qk_layernorm=mt in ("qwen3", "qwen3_moe"),
        init_method_std=float(hc.get("initializer_range", 0.02)),
        attention_dropout=0.0, hidden_dropout=0.0, sandwich_norm=False, layer_scale=False,
        embedding_scale=False, num_experts=None,
    )
    if mt in MOE:
        fields.update(_moe_fields(hc, mt))
    return fields


def hf_to_megatron(m, hf: dict, model_type: str) -> dict:
    """An HF state dict of ``model_type`` -> our TP1 state dict (SequentialMLP expert names; inverse of
    ``mappings.megatron_to_hf``)."""
    heads, groups, d = m.num_attention_heads, m.num_query_groups, m.kv_channels
    kinds = ("weight",) if m.disable_bias_linear else ("weight", "bias")
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(m.num_layers):
        s, t = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[s + "input_layernorm.weight"] = hf[t + "input_layernorm.weight"]
        for kind in ("weight", "bias") if m.add_qkv_bias else kinds:
            q, k, v = (hf[t + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
            out[s + f"self_attention.linear_qkv.{kind}"] = merge_qkv(q, k, v, heads, groups, d)
        for kind in kinds:
            out[s + f"self_attention.linear_proj.{kind}"] = hf[t + f"self_attn.o_proj.{kind}"]
        if m.qk_layernorm:
            out[s + "self_attention.q_layernorm.weight"] = hf[t + "self_attn.q_norm.weight"]
            out[s + "self_attention.k_layernorm.weight"] = hf[t + "self_attn.k_norm.weight"]
        out[s + "pre_mlp_layernorm.weight"] = hf[t + "post_attention_layernorm.weight"]
        if m.num_experts:
            out.update(_moe_from_hf(m, hf, s, t, model_type))
            continue
        for kind in kinds:
            out[s + f"mlp.linear_fc1.{kind}"] = torch.cat(
                [hf[t + f"mlp.gate_proj.{kind}"], hf[t + f"mlp.up_proj.{kind}"]], dim=0
            )
            out[s + f"mlp.linear_fc2.{kind}"] = hf[t + f"mlp.down_proj.{kind}"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if m.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def _moe_from_hf(m, hf: dict, s: str, t: str, model_type: str) -> dict:
    # The published checkpoints' per-expert keys (transformers 5 writes them too, fusing on load).
    qwen = model_type in ("qwen3_moe", "qwen2_moe")
    block = t + ("mlp." if qwen else "block_sparse_moe.")
    gate, up, down = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
    out = {s + "mlp.router.weight": hf[block + "gate.weight"]}
    if model_type == "qwen2_moe":
        src, dst = block + "shared_expert.", s + "mlp.shared_experts."
        out[dst + "linear_fc1.weight"] = torch.cat([hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]], dim=0)
        out[dst + "linear_fc2.weight"] = hf[src + "down_proj.weight"]
        out[dst + "gate_weight"] = hf[block + "shared_expert_gate.weight"]
    for e in range(m.num_experts):
        src, dst = block + f"experts.{e}.", s + f"mlp.experts.local_experts.{e}."
        out[dst + "linear_fc1.weight"] = torch.cat([hf[src + f"{gate}.weight"], hf[src + f"{up}.weight"]], dim=0)
        out[dst + "linear_fc2.weight"] = hf[src + f"{down}.weight"]
    return out
