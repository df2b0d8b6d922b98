"""Which Hugging Face architecture reproduces a megatron_md model, and the tensor mappings.

A family is chosen only when its HF class computes exactly what our GPTModel computes (up to
float rounding); anything else is refused with the config field that makes it impossible. Fixed
scales that are exact to fold (``--layer-scale``, ``--embedding-scale`` with untied embeddings)
are multiplied into the weights. Megatron's fused tensors are split here:

- ``linear_qkv`` rows are stored per query group: ``[q heads of group g | k_g | v_g]`` for each g.
- SwiGLU ``linear_fc1`` rows are ``[gate; up]`` (megatron applies the activation to the first half).

The tables follow Megatron-Bridge's ``AutoMapping`` / ``QKVMapping`` / ``GatedMLPMapping``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_md.mcore.naming import expert_names


class ConversionError(ValueError):
    """The model (or HF checkpoint) has a feature the target architecture cannot reproduce."""


@dataclass(frozen=True)
class Family:
    name: str  # qwen3 | llama | qwen3_moe | qwen2_moe | mixtral | gemma3 | gpt2
    hf_class: str  # config.json "architectures" entry
    norm_topk_prob: bool = True  # qwen3_moe: renormalise the top-k router probabilities


def _refuse(field: str, why: str):
    raise ConversionError(f"model.{field} (--{field.replace('_', '-')}): {why}")


# ----------------------------------------------------------------------------- family choice

# TransformerConfig settings whose non-default values change the forward pass in a way no target reproduces.
# Several are run flags (FLAGS: the refusal names the flag); the rest no run config sets.
_MCORE_FIXED = {
    "softmax_scale": None,
    "rotary_interleaved": False,
    "apply_residual_connection_post_layernorm": False,
    "layernorm_zero_centered_gamma": False,
}
_MCORE_MOE_FIXED = {
    "moe_router_score_function": "softmax",  # sigmoid routing (DeepSeek-V3 style) is not mapped
    "moe_router_topk_scaling_factor": None,
    "moe_layer_freq": 1,  # every layer MoE (Qwen3-MoE decoder_sparse_step=1)
    "moe_expert_capacity_factor": None,  # token dropping has no HF counterpart
    "moe_router_enable_expert_bias": False,
    "moe_router_num_groups": None,
    "moe_input_jitter_eps": None,
}
FLAGS = {
    "layernorm_zero_centered_gamma": ("--apply-layernorm-1p", "no exported family stores norm weights as scale - 1"),
    "moe_router_score_function": ("--moe-router-score-function", "the exported MoE families route by softmax"),
    "moe_layer_freq": ("--moe-layer-freq", "Qwen3-MoE and Mixtral have no dense layers among MoE ones here"),
    "moe_shared_expert_intermediate_size": (
        "--moe-shared-expert-intermediate-size", "the one exported family with a shared expert, Qwen2-MoE, gates "
        "it by a sigmoid: add --moe-shared-expert-gate"),
    "moe_expert_capacity_factor": ("--moe-expert-capacity-factor", "token dropping has no Hugging Face counterpart"),
    "moe_router_enable_expert_bias": ("--moe-router-enable-expert-bias",
                                      "the exported MoE families have no expert bias"),
}


def check_mcore(tc) -> bool:
    """Refuse megatron settings no target reproduces; returns ``moe_router_pre_softmax``."""
    fixed = dict(_MCORE_FIXED, **(_MCORE_MOE_FIXED if tc.num_moe_experts else {}))
    if tc.num_moe_experts and not getattr(tc, "moe_shared_expert_gate", False):
        fixed["moe_shared_expert_intermediate_size"] = None  # an ungated shared expert: no family has one
    for name, want in fixed.items():
        have = getattr(tc, name, want)
        if have != want and name in FLAGS:
            flag, why = FLAGS[name]
            raise ConversionError(f"{flag} {have}: cannot be exported ({why}); the export takes the default "
                                  f"({want!r})")
        if have != want:
            raise ConversionError(
                f"megatron TransformerConfig.{name}={have!r} (expected {want!r}): no supported Hugging "
                "Face architecture computes this"
            )
    return bool(getattr(tc, "moe_router_pre_softmax", False))


def choose_family(m, *, pre_softmax: bool = False) -> Family:
    """The HF architecture that reproduces ModelConfig ``m`` exactly, or ConversionError."""
    pos = m.position_embedding_type
    if getattr(m, "rotary_percent", 1.0) != 1.0 and pos == "rope":
        _refuse("rotary_percent", f"{m.rotary_percent}: the supported architectures rotate every head dimension")
    if pos == "learned_absolute":
        return _gpt2_family(m)
    if pos != "rope":
        _refuse("position_embedding_type", f"{pos!r}: the supported architectures use RoPE (Qwen3, Llama, "
                "Qwen3-MoE, Mixtral, Gemma3) or learned absolute positions (GPT-2)")
    if m.normalization != "RMSNorm":
        _refuse("normalization", "LayerNorm with RoPE: every supported RoPE architecture uses RMSNorm")
    if not m.swiglu:
        _refuse("swiglu", "a non-gated MLP with RoPE: every supported RoPE architecture has a SwiGLU MLP")
    tied = not m.untie_embeddings_and_output_weights
    if m.num_experts:
        if not m.disable_bias_linear:
            _refuse("disable_bias_linear", "linear biases in a MoE model: Qwen3-MoE and Mixtral have none")
        if m.sandwich_norm:
            _refuse("sandwich_norm", "no supported MoE architecture normalises sublayer outputs "
                    "(Gemma3 has post-sublayer norms but is dense)")
        if m.embedding_scale and tied:
            _refuse("embedding_scale", "with tied embeddings the sqrt(hidden) input scale cannot be folded "
                    "into the shared matrix, and no supported MoE architecture scales embeddings itself")
        if m.moe_shared_expert_intermediate_size or m.add_qkv_bias:
            return _qwen2_moe_family(m, pre_softmax)
        if m.qk_layernorm:
            return Family("qwen3_moe", "Qwen3MoeForCausalLM", norm_topk_prob=not pre_softmax)
        if pre_softmax:
            _refuse("qk_layernorm", "without QK-norm the MoE target is Mixtral, which always renormalises "
                    "the top-k router probabilities; this router (moe_router_pre_softmax) does not")
        return Family("mixtral", "MixtralForCausalLM")
    if m.add_qkv_bias and m.disable_bias_linear:
        _refuse("add_qkv_bias", "q/k/v-only biases export as Qwen2-MoE (a MoE model with a gated shared expert); "
                "no dense family is mapped for them")
    if m.sandwich_norm:
        # Gemma3 is the HF decoder with post-attention and post-feedforward norms.
        if not m.qk_layernorm:
            _refuse("sandwich_norm", "sandwich norm maps to Gemma3, which always has QK-norm; this model "
                    "has --no-qk-layernorm (Gemma2 has no QK-norm but soft-caps logits)")
        if not m.disable_bias_linear:
            _refuse("disable_bias_linear", "Gemma3 (the sandwich-norm target) has no MLP biases")
        if tied and not m.embedding_scale:
            _refuse("embedding_scale", "Gemma3 (the sandwich-norm target) multiplies input embeddings by "
                    "sqrt(hidden); without --embedding-scale the inverse would have to be folded into a "
                    "matrix that is shared with the LM head (tied embeddings)")
        return Family("gemma3", "Gemma3ForCausalLM")
    if m.embedding_scale and tied:
        _refuse("embedding_scale", "with tied embeddings the sqrt(hidden) input scale cannot be folded into "
                "the shared matrix (the LM head would change); only Gemma3 scales embeddings natively, "
                "and it also has sandwich norms (--sandwich-norm)")
    if m.qk_layernorm:
        if not m.disable_bias_linear:
            _refuse("disable_bias_linear", "Qwen3 (QK-norm) has attention biases but no MLP biases, while "
                    "megatron's linear biases cover every linear layer")
        return Family("qwen3", "Qwen3ForCausalLM")
    return Family("llama", "LlamaForCausalLM")


def _qwen2_moe_family(m, pre_softmax: bool) -> Family:
    """Qwen2-MoE: a sigmoid-gated shared expert beside the routed ones, optional q/k/v-only biases, no QK-norm."""
    why = "a shared expert or q/k/v-only biases in a MoE model map to Qwen2-MoE"
    if not m.moe_shared_expert_intermediate_size:
        _refuse("moe_shared_expert_intermediate_size", f"{why}, which always has a shared expert: set it and "
                "--moe-shared-expert-gate")
    if not m.moe_shared_expert_gate:
        _refuse("moe_shared_expert_gate", f"{why}, which gates the shared expert by a sigmoid; add "
                "--moe-shared-expert-gate")
    if m.qk_layernorm:
        _refuse("qk_layernorm", f"{why}, which has no QK-norm (--no-qk-layernorm)")
    return Family("qwen2_moe", "Qwen2MoeForCausalLM", norm_topk_prob=not pre_softmax)


def _gpt2_family(m) -> Family:
    why = "learned absolute positions map to GPT-2"
    if m.normalization != "LayerNorm":
        _refuse("normalization", f"{why}, which uses LayerNorm")
    if m.swiglu:
        _refuse("swiglu", f"{why}, whose MLP is not gated")
    if m.qk_layernorm:
        _refuse("qk_layernorm", f"{why}, which has no QK-norm")
    if m.num_experts:
        _refuse("num_experts", f"{why}, which is dense")
    if m.sandwich_norm:
        _refuse("sandwich_norm", f"{why}, which has no post-sublayer norms")
    if m.num_query_groups != m.num_attention_heads:
        _refuse("num_query_groups", f"{why}, which has multi-head attention only (no GQA)")
    if m.kv_channels * m.num_attention_heads != m.hidden_size:
        _refuse("kv_channels", f"{why}, whose head size is hidden/heads")
    if m.embedding_scale and not m.untie_embeddings_and_output_weights:
        _refuse("embedding_scale", "with tied embeddings the sqrt(hidden) input scale cannot be folded "
                "into the shared matrix (the LM head would change)")
    return Family("gpt2", "GPT2LMHeadModel")


# ----------------------------------------------------------------------------- HF config

def _rope(base: float, per_layer_type: bool = False) -> dict:
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        p = {"rope_type": "default", "rope_theta": float(base)}
        return {"rope_parameters": {"full_attention": p, "sliding_attention": dict(p)} if per_layer_type else p}
    extra = {"rope_local_base_freq": float(base)} if per_layer_type else {}
    return {"rope_theta": float(base), **extra}


def hf_config(fam: Family, m, vocab: int, dtype: torch.dtype, special: dict | None = None):
    """The transformers config object of family ``fam`` for ModelConfig ``m``."""
    import transformers as T

    special = special or {}
    dtype_name = str(dtype).removeprefix("torch.")
    tied = not m.untie_embeddings_and_output_weights
    bias = not m.disable_bias_linear
    if fam.name == "gpt2":
        cfg = T.GPT2Config(
            vocab_size=vocab, n_positions=m.max_position_embeddings, n_embd=m.hidden_size,
            n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size,
            activation_function="gelu",  # megatron's F.gelu is the exact erf GELU, not gelu_new (tanh)
            layer_norm_epsilon=m.norm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            initializer_range=m.init_method_std, tie_word_embeddings=tied, torch_dtype=dtype_name, **special,
        )
        cfg.architectures = [fam.hf_class]
        return cfg
    common = dict(
        vocab_size=vocab, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups,
        head_dim=m.kv_channels, max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.norm_epsilon, initializer_range=m.init_method_std, tie_word_embeddings=tied,
        attention_dropout=0.0, torch_dtype=dtype_name, **special,
    )
    if fam.name == "qwen3":
        cfg = T.Qwen3Config(intermediate_size=m.ffn_hidden_size, hidden_act="silu", attention_bias=False,
                            use_sliding_window=False, **_rope(m.rotary_base), **common)
    elif fam.name == "llama":
        cfg = T.LlamaConfig(intermediate_size=m.ffn_hidden_size, hidden_act="silu", attention_bias=bias,
                            mlp_bias=bias, **_rope(m.rotary_base), **common)
    elif fam.name == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(
            intermediate_size=m.ffn_hidden_size, moe_intermediate_size=m.moe_ffn_hidden_size,
            num_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
            norm_topk_prob=fam.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
            router_aux_loss_coef=m.moe_aux_loss_coeff, hidden_act="silu", attention_bias=False,
            use_sliding_window=False, **_rope(m.rotary_base), **common,
        )
    elif fam.name == "qwen2_moe":
        cfg = T.Qwen2MoeConfig(
            intermediate_size=m.ffn_hidden_size, moe_intermediate_size=m.moe_ffn_hidden_size,
            shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size, num_experts=m.num_experts,
            num_experts_per_tok=m.moe_router_topk, norm_topk_prob=fam.norm_topk_prob, decoder_sparse_step=1,
            mlp_only_layers=[], router_aux_loss_coef=m.moe_aux_loss_coeff, hidden_act="silu",
            qkv_bias=m.add_qkv_bias, use_sliding_window=False, **_rope(m.rotary_base), **common,
        )
    elif fam.name == "mixtral":
        cfg = T.MixtralConfig(
            intermediate_size=m.moe_ffn_hidden_size, num_local_experts=m.num_experts,
            num_experts_per_tok=m.moe_router_topk, router_aux_loss_coef=m.moe_aux_loss_coeff,
            router_jitter_noise=0.0, sliding_window=None, hidden_act="silu", **_rope(m.rotary_base), **common,
        )
    elif fam.name == "gemma3":
        cfg = T.Gemma3TextConfig(
            intermediate_size=m.ffn_hidden_size, hidden_activation="silu",
            query_pre_attn_scalar=m.kv_channels,  # softmax scale 1/sqrt(head_dim), as megatron
            layer_types=["full_attention"] * m.num_layers, sliding_window=m.max_position_embeddings,
            final_logit_softcapping=None, attn_logit_softcapping=None, attention_bias=False,
            **_rope(m.rotary_base, per_layer_type=True), **common,
        )
    else:
        raise ConversionError(f"unknown family {fam.name!r}")
    cfg.architectures = [fam.hf_class]
    return cfg


# ----------------------------------------------------------------------------- tensor helpers

def split_qkv(t: torch.Tensor, heads: int, groups: int, d: int):
    """Megatron's grouped ``linear_qkv`` weight (or bias) -> (q, k, v) in head order."""
    per, rest = heads // groups, t.shape[1:]
    x = t.reshape(groups, (per + 2) * d, *rest)
    q = x[:, : per * d].reshape(heads * d, *rest)
    k = x[:, per * d : (per + 1) * d].reshape(groups * d, *rest)
    v = x[:, (per + 1) * d :].reshape(groups * d, *rest)
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, d: int):
    per, rest = heads // groups, q.shape[1:]
    x = torch.cat(
        [q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    )
    return x.reshape(-1, *rest)


def _own(t: torch.Tensor) -> torch.Tensor:
    # safetensors refuses tensors that share storage (views of one fused matrix)
    return t.detach().contiguous().clone()


def _scaled(t: torch.Tensor, s: float) -> torch.Tensor:
    return _own(t) if s == 1.0 else _own(t * s)


# ----------------------------------------------------------------------------- megatron -> HF

def megatron_to_hf(fam: Family, m, sd: dict) -> dict:
    """Our TP1 state dict (fp32 or bf16 tensors) -> the HF state dict of ``fam``, scales folded."""
    if fam.name == "gpt2":
        return _to_gpt2(m, sd)
    h, heads, groups, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels
    ls = 1.0 / m.num_layers if m.layer_scale else 1.0  # SublayerOutput's fixed scale
    gemma = fam.name == "gemma3"
    # Gemma3 multiplies embeddings by sqrt(h) itself; elsewhere fold --embedding-scale into them.
    emb_scale = (math.sqrt(h) if m.embedding_scale else 1.0) / (math.sqrt(h) if gemma else 1.0)
    out_scale = 1.0 if gemma else ls  # Gemma3: the scale goes into the post-sublayer norms instead

    def norm(w, s=1.0):
        return _own(w * s - 1.0) if gemma else _scaled(w, s)  # Gemma3's RMSNorm is x * (1 + w)

    out = {"model.embed_tokens.weight": _scaled(sd["embedding.word_embeddings.weight"], emb_scale)}
    for i in range(m.num_layers):
        s, t = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[t + "input_layernorm.weight"] = norm(sd[s + "input_layernorm.weight"])
        for kind in ("weight", "bias"):
            qkv = sd.get(s + f"self_attention.linear_qkv.{kind}")
            if qkv is None:
                continue
            for name, part in zip("qkv", split_qkv(qkv, heads, groups, d)):
                out[t + f"self_attn.{name}_proj.{kind}"] = _own(part)
            proj = sd.get(s + f"self_attention.linear_proj.{kind}")  # no bias with --add-qkv-bias alone
            if proj is not None:
                out[t + f"self_attn.o_proj.{kind}"] = _scaled(proj, out_scale)
        if m.qk_layernorm:
            out[t + "self_attn.q_norm.weight"] = norm(sd[s + "self_attention.q_layernorm.weight"])
            out[t + "self_attn.k_norm.weight"] = norm(sd[s + "self_attention.k_layernorm.weight"])
        if gemma:
            out[t + "post_attention_layernorm.weight"] = norm(sd[s + "self_attn_bda.norm.weight"], ls)
            out[t + "pre_feedforward_layernorm.weight"] = norm(sd[s + "pre_mlp_layernorm.weight"])
            out[t + "post_feedforward_layernorm.weight"] = norm(sd[s + "mlp_bda.norm.weight"], ls)
        else:
            out[t + "post_attention_layernorm.weight"] = norm(sd[s + "pre_mlp_layernorm.weight"])
        if m.num_experts:
            _moe_to_hf(fam, m, sd, s, t, out, out_scale)
        else:
            for kind in ("weight", "bias"):
                fc1 = sd.get(s + f"mlp.linear_fc1.{kind}")
                if fc1 is None:
                    continue
                gate, up = torch.chunk(fc1, 2, dim=0)
                out[t + f"mlp.gate_proj.{kind}"], out[t + f"mlp.up_proj.{kind}"] = _own(gate), _own(up)
                out[t + f"mlp.down_proj.{kind}"] = _scaled(sd[s + f"mlp.linear_fc2.{kind}"], out_scale)
    out["model.norm.weight"] = norm(sd["decoder.final_layernorm.weight"])
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = _own(sd["output_layer.weight"])
    return out


def _moe_to_hf(fam: Family, m, sd: dict, s: str, t: str, out: dict, out_scale: float) -> None:
    # Per-expert keys (the format of the published Qwen3-MoE / Mixtral checkpoints); transformers 5
    # fuses them into its 3-D expert tensors on load.
    qwen = fam.name in ("qwen3_moe", "qwen2_moe")
    block = t + ("mlp." if qwen else "block_sparse_moe.")
    if fam.name == "qwen2_moe":  # the shared expert and its sigmoid gate
        gate, up = torch.chunk(sd[s + "mlp.shared_experts.linear_fc1.weight"], 2, dim=0)
        out[block + "shared_expert.gate_proj.weight"], out[block + "shared_expert.up_proj.weight"] = _own(gate), _own(up)
        out[block + "shared_expert.down_proj.weight"] = _scaled(sd[s + "mlp.shared_experts.linear_fc2.weight"],
                                                                out_scale)
        out[block + "shared_expert_gate.weight"] = _own(sd[s + "mlp.shared_experts.gate_weight"])
    out[block + "gate.weight"] = _own(sd[s + "mlp.router.weight"])
    names = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
    for e in range(m.num_experts):
        gate, up = torch.chunk(_expert(sd, s, e, "linear_fc1"), 2, dim=0)
        dst = block + f"experts.{e}."
        out[dst + f"{names[0]}.weight"], out[dst + f"{names[1]}.weight"] = _own(gate), _own(up)
        out[dst + f"{names[2]}.weight"] = _scaled(_expert(sd, s, e, "linear_fc2"), out_scale)


def _expert(sd: dict, s: str, e: int, fc: str) -> torch.Tensor:
    """Expert ``e``'s matrix (TP1, EP1): SequentialMLP's ``local_experts.{e}.{fc}.weight`` or TEGroupedMLP's
    ``{fc}.weight{e}`` (``mcore/naming.py``)."""
    sequential, grouped = expert_names(s, e, fc)
    return sd[grouped] if sequential not in sd and grouped in sd else sd[sequential]


def _to_gpt2(m, sd: dict) -> dict:
    """GPT-2 stores Conv1D weights as [in, out] and always has biases (zeros where we have none)."""
    h, heads, d = m.hidden_size, m.num_attention_heads, m.kv_channels
    ls = 1.0 / m.num_layers if m.layer_scale else 1.0
    es = math.sqrt(h) if m.embedding_scale else 1.0  # the hook scales word + position embeddings

    def conv(w, s=1.0):
        return _scaled(w.t(), s)

    def bias_or_zero(key, n, like, s=1.0):
        b = sd.get(key)
        return torch.zeros(n, dtype=like.dtype) if b is None else _scaled(b, s)

    out = {
        "transformer.wte.weight": _scaled(sd["embedding.word_embeddings.weight"], es),
        "transformer.wpe.weight": _scaled(sd["embedding.position_embeddings.weight"], es),
    }
    for i in range(m.num_layers):
        s, t = f"decoder.layers.{i}.", f"transformer.h.{i}."
        qkv = sd[s + "self_attention.linear_qkv.weight"]
        out[t + "ln_1.weight"] = _own(sd[s + "input_layernorm.weight"])
        out[t + "ln_1.bias"] = _own(sd[s + "input_layernorm.bias"])
        out[t + "attn.c_attn.weight"] = conv(torch.cat(split_qkv(qkv, heads, heads, d), dim=0))
        qkv_b = sd.get(s + "self_attention.linear_qkv.bias")
        out[t + "attn.c_attn.bias"] = (
            torch.zeros(3 * h, dtype=qkv.dtype) if qkv_b is None
            else _own(torch.cat(split_qkv(qkv_b, heads, heads, d), dim=0))
        )
        proj = sd[s + "self_attention.linear_proj.weight"]
        out[t + "attn.c_proj.weight"] = conv(proj, ls)
        out[t + "attn.c_proj.bias"] = bias_or_zero(s + "self_attention.linear_proj.bias", h, proj, ls)
        out[t + "ln_2.weight"] = _own(sd[s + "pre_mlp_layernorm.weight"])
        out[t + "ln_2.bias"] = _own(sd[s + "pre_mlp_layernorm.bias"])
        fc1, fc2 = sd[s + "mlp.linear_fc1.weight"], sd[s + "mlp.linear_fc2.weight"]
        out[t + "mlp.c_fc.weight"] = conv(fc1)
        out[t + "mlp.c_fc.bias"] = bias_or_zero(s + "mlp.linear_fc1.bias", fc1.shape[0], fc1)
        out[t + "mlp.c_proj.weight"] = conv(fc2, ls)
        out[t + "mlp.c_proj.bias"] = bias_or_zero(s + "mlp.linear_fc2.bias", h, fc2, ls)
    out["transformer.ln_f.weight"] = _own(sd["decoder.final_layernorm.weight"])
    out["transformer.ln_f.bias"] = _own(sd["decoder.final_layernorm.bias"])
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = _own(sd["output_layer.weight"])
    return out
