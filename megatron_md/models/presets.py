"""Named model shapes and their parameter counts.

A preset is a plain dict of ModelConfig field overrides (see ``training/config.py``); the
builder turns a resolved ModelConfig into a megatron-core GPTModel. The dense series is the
MD paper's width ladder (12 layers, kv_channels 128, heads = hidden/128, GQA with
heads/2 groups, SwiGLU 4x, RMSNorm, QK-norm, RoPE, untied embeddings, no biases, no dropout,
vocab 131072). A preset states every field it sets (the defaults without one are Megatron-LM's,
training/model_config.py) and ``megatron-md train`` prints them once; ``--hidden-size`` on any preset
rescales heads and FFN so width families for LR-transfer sweeps keep the same shape ratios.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Optional

_PAPER_DENSE = dict(
    num_layers=12,
    kv_channels=128,
    ffn_ratio=4.0,
    query_group_ratio=0.5,
    seq_length=1024,
    max_position_embeddings=1024,
    vocab_size=131072,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    disable_bias_linear=True,
    qk_layernorm=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)

# What every MoE preset adds: aux-loss balancing at 1e-2 and all-to-all token dispatch (Megatron-LM's defaults
# are no aux loss and all-gather dispatch).
_MOE = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall")

# GPT-2 small as in the module-wise manifold paper (nanoGPT): MHA, GELU MLP 4x, LayerNorm, learned
# positions, tied embeddings, no biases. Differences to nanoGPT: megatron's LayerNorm has a bias
# (nanoGPT's has none with bias=False) and QKV is stored per head group (same constraint: WᵀW is
# row-permutation invariant).
_GPT2 = dict(
    num_layers=12,
    hidden_size=768,
    kv_channels=64,
    ffn_ratio=4.0,
    query_group_ratio=1.0,
    seq_length=1024,
    max_position_embeddings=1024,
    vocab_size=50304,
    position_embedding_type="learned_absolute",
    normalization="LayerNorm",
    swiglu=False,
    untie_embeddings_and_output_weights=False,
    disable_bias_linear=True,
    qk_layernorm=False,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)

PRESETS: dict[str, dict] = {
    # Seconds per step on 2 CPU cores: for tests, the demo and debugging layouts.
    "tiny-dense": dict(
        _PAPER_DENSE,
        num_layers=2,
        hidden_size=64,
        kv_channels=16,
        seq_length=64,
        max_position_embeddings=64,
        vocab_size=4096,
    ),
    "tiny-moe": dict(
        _PAPER_DENSE,
        **_MOE,
        num_layers=2,
        hidden_size=64,
        kv_channels=16,
        seq_length=64,
        max_position_embeddings=64,
        vocab_size=4096,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_ratio=2.0,
    ),
    "tiny-gpt2": dict(
        _GPT2, num_layers=2, hidden_size=64, kv_channels=16, seq_length=64, max_position_embeddings=64,
        vocab_size=4096,
    ),
    "gpt2-small": dict(_GPT2),
    # The MD paper's width series (names are total parameter counts at vocab 131072).
    "dense-181m": dict(_PAPER_DENSE, hidden_size=512),
    "dense-307m": dict(_PAPER_DENSE, hidden_size=768),
    "dense-457m": dict(_PAPER_DENSE, hidden_size=1024),
    "dense-827m": dict(_PAPER_DENSE, hidden_size=1536),
    "dense-1.29b": dict(_PAPER_DENSE, hidden_size=2048),
    # MoE family: fine-grained experts, top-k routing with aux-loss balancing.
    "moe-0.9b": dict(
        _PAPER_DENSE,
        **_MOE,
        hidden_size=1024,
        num_experts=16,
        moe_router_topk=2,
        moe_ffn_ratio=1.0,
    ),
    "moe-2.3b": dict(
        _PAPER_DENSE,
        **_MOE,
        num_layers=16,
        hidden_size=1536,
        num_experts=32,
        moe_router_topk=4,
        moe_ffn_ratio=0.5,
    ),
    # OLMoE-like: 16 layers, hidden 2048, 64 experts of ffn 960, top-8.
    "moe-6.7b": dict(
        _PAPER_DENSE,
        **_MOE,
        num_layers=16,
        hidden_size=2048,
        num_experts=64,
        moe_router_topk=8,
        moe_ffn_ratio=0.46875,
    ),
}


def moe_layer_pattern(m) -> Optional[list[int]]:
    """--moe-layer-freq as one 0/1 per layer (1: MoE), Megatron-LM's reading; None for a dense model. ValueError
    naming the flag for text that is neither a positive integer nor a list expression of 0s and 1s."""
    if not m.num_experts:
        return None
    text = str(m.moe_layer_freq).strip()
    if text.isdigit() and int(text) >= 1:
        return [1 if i % int(text) == 0 else 0 for i in range(m.num_layers)]
    if not re.fullmatch(r"[\[\]\(\)\d\s,+*]+", text):
        raise ValueError(f"--moe-layer-freq {text!r}: a positive integer, or a list expression of 0s and 1s such "
                         "as '([0]*2+[1]*10)'")
    try:
        pattern = eval(text, {"__builtins__": {}}, {})  # noqa: S307 (digits, brackets, + , * only: checked above)
    except Exception:  # noqa: BLE001
        pattern = None
    if not isinstance(pattern, list) or any(x not in (0, 1) for x in pattern) or len(pattern) != m.num_layers:
        raise ValueError(f"--moe-layer-freq {text!r}: the list must hold a 0 or 1 for each of the --num-layers "
                         f"{m.num_layers} layers")
    return pattern


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(
            f"--model {name!r} is not a known preset; choose one of: {', '.join(PRESETS)}"
        )
    return copy.deepcopy(PRESETS[name])


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    embedding: int  # input embedding + untied output layer

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count_parameters(cfg) -> ParamCounts:
    """Closed-form parameter count of the model a ModelConfig builds (no TP padding).

    ``cfg`` needs the resolved ModelConfig attributes (hidden_size, num_attention_heads, ...).
    The test in tests/models checks this against a built model.
    """
    h = cfg.hidden_size
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    bias = 0 if cfg.disable_bias_linear else 1
    qkv_bias = 1 if bias or getattr(cfg, "add_qkv_bias", False) else 0
    attn = h * d * (heads + 2 * groups) + qkv_bias * d * (heads + 2 * groups)
    attn += heads * d * h + bias * h
    norm_w = 1 if cfg.normalization == "RMSNorm" else 2  # LayerNorm has a bias
    norms = 2 * norm_w * h  # input + pre-MLP norm
    if cfg.qk_layernorm:
        norms += 2 * norm_w * d
    if cfg.sandwich_norm:
        norms += 2 * norm_w * h

    def mlp_params(ffn: int) -> int:
        up = (2 if cfg.swiglu else 1) * ffn
        return h * up + ffn * h + bias * (up + h)

    layers = cfg.num_layers
    moe_layers = sum(moe_layer_pattern(cfg) or []) if hasattr(cfg, "moe_layer_freq") else (
        layers if cfg.num_experts else 0)
    mlp_total = mlp_active = (layers - moe_layers) * mlp_params(cfg.ffn_hidden_size)
    if cfg.num_experts:
        expert = mlp_params(cfg.moe_ffn_hidden_size)
        router = cfg.num_experts * h
        shared = getattr(cfg, "moe_shared_expert_intermediate_size", None)
        shared_params = mlp_params(shared) if shared else 0  # every token goes through the shared expert
        shared_params += h if shared and getattr(cfg, "moe_shared_expert_gate", False) else 0  # its sigmoid gate
        mlp_total += moe_layers * (cfg.num_experts * expert + router + shared_params)
        mlp_active += moe_layers * (cfg.moe_router_topk * expert + router + shared_params)
    embedding = cfg.vocab_size * h
    if cfg.position_embedding_type == "learned_absolute":
        embedding += cfg.max_position_embeddings * h
    if cfg.untie_embeddings_and_output_weights:
        embedding += cfg.vocab_size * h
    final_norm = norm_w * h
    total = layers * (attn + norms) + mlp_total + embedding + final_norm
    active = layers * (attn + norms) + mlp_active + embedding + final_norm
    return ParamCounts(total=total, active=active, embedding=embedding)


def human(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)
