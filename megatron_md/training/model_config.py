"""The model section of the run config: megatron-core's architecture knobs under Megatron-LM's flag names.

With no ``--model`` preset every default is Megatron-LM's (``pretrain_gpt.py``): LayerNorm, a GeLU MLP with
biases, learned absolute positions, tied embeddings, no QK-norm, dropout 0.1, head size hidden/heads. The
MD paper's and the manifold paper's architectures are presets (models/presets.py), which set every field
they change; ``megatron-md train`` prints them once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_md.fields import opt

@dataclass
class ModelConfig:
    num_layers: int = opt(2, "Transformer layers.", valid=">=1")
    hidden_size: int = opt(64, "Model width; with a preset, heads and FFN rescale with it.", valid=">=1")
    num_attention_heads: Optional[int] = opt(
        None, "Attention heads (unset: hidden / --kv-channels, with a 64-wide head when that is unset too).", valid=">=1")
    num_query_groups: Optional[int] = opt(
        None, "Key/value groups (GQA); applied with or without --group-query-attention (default heads x --query-group-ratio).", valid=">=1")
    group_query_attention: bool = opt(
        False, "Megatron-LM's switch for --num-query-groups; accepted, and not needed here (docs/usage.md).")
    kv_channels: Optional[int] = opt(None, "Per-head dimension (unset: hidden / heads, as Megatron-LM).", valid=">=1")
    query_group_ratio: float = opt(1.0, "Query groups per head when --num-query-groups is unset.", valid="(0,1]")
    ffn_hidden_size: Optional[int] = opt(
        None, "MLP width (unset: --ffn-ratio x hidden, or Megatron-LM's 4 x hidden, for --swiglu 2/3 of that rounded down to a multiple of 64).", valid=">=1")
    ffn_ratio: Optional[float] = opt(None, "MLP width / hidden when --ffn-hidden-size is unset (presets set it).", valid=">0")
    seq_length: int = opt(1024, "Training sequence length.", valid=">=1")
    max_position_embeddings: Optional[int] = opt(None, "Max positions (default seq-length).", valid=">=1")
    vocab_size: int = opt(131072, "Vocabulary size when no tokenizer fixes it (mock data).", valid=">=1")
    make_vocab_size_divisible_by: int = opt(128, "Pad the vocabulary to a multiple of this x TP.", valid=">=1")
    position_embedding_type: str = opt("learned_absolute", "Positions.", ["learned_absolute", "rope", "none"])
    rotary_base: int = opt(10000, "RoPE base.", valid=">0")
    rotary_percent: float = opt(1.0, "Share of each head's dimensions RoPE rotates.", valid="(0,1]")
    normalization: str = opt("LayerNorm", "Norm layer.", ["LayerNorm", "RMSNorm"])
    norm_epsilon: float = opt(1e-5, "Norm epsilon.", valid=">0")
    apply_layernorm_1p: bool = opt(
        False, "Zero-centred norm weights: the stored weight is the scale minus 1 (starts at 0, weight decay pulls the scale toward 1).")
    swiglu: bool = opt(False, "SwiGLU MLP (gated SiLU); without it a GeLU MLP.")
    untie_embeddings_and_output_weights: bool = opt(False, "Separate input embedding and LM head.")
    disable_bias_linear: bool = opt(False, "No biases in linear layers.")
    add_qkv_bias: bool = opt(
        False, "Biases on the query, key and value projections even with --disable-bias-linear (Qwen2's attention).")
    qk_layernorm: bool = opt(False, "Normalise queries and keys per head (QK-norm).")
    init_method_std: float = opt(0.02, "Std of the normal weight init.", valid=">0")
    attention_dropout: float = opt(0.1, "Attention dropout.", valid="[0,1)")
    hidden_dropout: float = opt(0.1, "Hidden dropout.", valid="[0,1)")
    sandwich_norm: bool = opt(False, "MD paper option: norm each sublayer output before the add.")
    layer_scale: bool = opt(False, "MD paper option: scale each sublayer output by 1/num-layers.")
    embedding_scale: bool = opt(False, "MD paper option: multiply embeddings by sqrt(hidden).")
    num_experts: Optional[int] = opt(None, "MoE experts per layer (unset: dense).", valid=">=1")
    moe_router_topk: int = opt(2, "Experts per token.", valid=">=1")
    moe_layer_freq: str = opt(
        "1", "Which layers are MoE: N makes every N-th layer MoE (layer 0 first), a list expression such as "
        "'([0]*2+[1]*10)' names each layer (1 MoE, 0 dense), as Megatron-LM.")
    moe_ffn_hidden_size: Optional[int] = opt(
        None, "Expert MLP width (unset: --moe-ffn-ratio x hidden, or --ffn-hidden-size as Megatron-LM).", valid=">=1")
    moe_ffn_ratio: Optional[float] = opt(None, "Expert width / hidden when --moe-ffn-hidden-size is unset (presets set it).", valid=">0")
    moe_grouped_gemm: Optional[bool] = opt(
        None, "Grouped GEMM experts, TE's TEGroupedMLP (unset: on when Transformer Engine builds the layers).")
    moe_token_dispatcher_type: str = opt("allgather", "Token dispatch.", ["allgather", "alltoall"])
    moe_router_load_balancing_type: str = opt(
        "aux_loss", "Router balancing.", ["aux_loss", "seq_aux_loss", "sinkhorn", "none"]
    )
    moe_aux_loss_coeff: float = opt(0.0, "Weight of the load-balancing loss.", valid=">=0")
    moe_z_loss_coeff: Optional[float] = opt(None, "Weight of the router z-loss (unset: none; 1e-3 is a common start).", valid=">=0")
    moe_expert_capacity_factor: Optional[float] = opt(
        None, "Expert capacity as a multiple of the even share of tokens; tokens beyond it are dropped (unset: "
        "no capacity, no dropping).", valid=">0")
    moe_token_drop_policy: str = opt(
        "probs", "With a capacity factor, which tokens an over-full expert drops: the lowest router "
        "probabilities, or the last positions.", ["probs", "position"])
    moe_pad_expert_input_to_capacity: bool = opt(
        False, "With a capacity factor, pad every expert's input to its capacity (fixed shapes).")
    moe_shared_expert_intermediate_size: Optional[int] = opt(
        None, "Width of the shared expert every token goes through beside the routed ones (unset: none).", valid=">=1")
    moe_shared_expert_gate: bool = opt(
        False, "Scale the shared expert's output by a learned per-token sigmoid gate (Qwen2-MoE); needs "
        "--moe-shared-expert-intermediate-size.")
    moe_router_dtype: Optional[str] = opt(
        None, "Precision of the router's scores and of the weighted sum of the experts' outputs (unset: the "
        "model's; fp32 is the usual choice with many experts).", ["fp32", "fp64"])
    moe_router_score_function: str = opt(
        "softmax", "Router scores: a softmax over the experts, or an independent sigmoid (or sqrt-softplus) per "
        "expert, as DeepSeek-V3.", ["softmax", "sigmoid", "sqrtsoftplus"])
    moe_router_pre_softmax: bool = opt(
        False, "Router probabilities: a softmax over all experts before the top-k choice, not renormalised "
        "over the chosen ones (Qwen3-MoE's norm_topk_prob false); default: top-k of the logits, softmax over those.")
    moe_router_enable_expert_bias: bool = opt(
        False, "Aux-loss-free balancing: a per-expert bias added to the scores for the top-k choice only, moved "
        "after every global batch toward even loads; a buffer, not a parameter (no optimizer steps it), kept in "
        "checkpoints. Needs a sigmoid or sqrtsoftplus score function.")
    moe_router_bias_update_rate: float = opt(
        1e-3, "With --moe-router-enable-expert-bias: the bias step per global batch.", valid=">=0")
    moe_permute_fusion: bool = opt(False, "Fused token permute/unpermute (Transformer Engine's kernels; CUDA).")
    recompute_granularity: Optional[str] = opt(
        None, "Activation recomputation: 'selective' recomputes the core attention (the s^2 term) in the "
        "backward pass; 'full' keeps only each layer's input (with --recompute-method). Unset: none.",
        ["full", "selective"])
    recompute_method: Optional[str] = opt(
        None, "Full recomputation: 'uniform' checkpoints groups of --recompute-num-layers layers; 'block' "
        "recomputes the first --recompute-num-layers layers of each pipeline stage (default uniform).",
        ["uniform", "block"])
    recompute_num_layers: Optional[int] = opt(
        None, "Full recomputation: layers per group (uniform) or layers recomputed per stage (block); default 1.", valid=">=1")
    recompute_modules: Optional[list[str]] = opt(
        None, "Selective recomputation: the modules recomputed in the backward pass (default core_attn). moe_act "
        "needs grouped GEMM experts.", ["core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts"], nargs="+")
    attention_backend: str = opt(
        "auto", "Core attention. With Transformer Engine layers: flash, fused or unfused (TE's kernels). With "
        "the local spec (no TE, and always on CPU): sdpa (torch's scaled_dot_product_attention: flash / cuDNN / "
        "memory-efficient kernels on CUDA, no s x s scores kept) or local (megatron-core's DotProductAttention, "
        "which keeps the fp32 scores). auto: TE's choice when TE builds the layers, sdpa otherwise.",
        ["auto", "flash", "fused", "unfused", "sdpa", "local"])
    # Fusions: unset means on where the kernel exists (CUDA, and TE/Apex where it needs them), off on CPU.
    rope_fusion: Optional[bool] = opt(None, "Fused RoPE (Transformer Engine's kernel); --no-rope-fusion turns it off.")
    bias_swiglu_fusion: Optional[bool] = opt(None, "Fused bias+SwiGLU (megatron's jit-fused kernel; CUDA).")
    bias_gelu_fusion: Optional[bool] = opt(None, "Fused bias+GeLU for non-SwiGLU MLPs (jit kernel; CUDA).")
    bias_dropout_fusion: Optional[bool] = opt(None, "Fused bias+dropout+add (jit kernel; CUDA).")
    masked_softmax_fusion: Optional[bool] = opt(
        None, "Fused scale+mask+softmax of the local attention (needs Megatron's CUDA softmax extensions).")
    gradient_accumulation_fusion: Optional[bool] = opt(
        None, "Accumulate weight gradients straight into the fp32 main_grad in the GEMM (TE or Apex "
        "fused_weight_gradient_mlp_cuda; CUDA).")
    cross_entropy_loss_fusion: Optional[bool] = opt(
        None, "Fused vocab-parallel cross entropy (unset: on on CUDA).")
    persist_layer_norm: Optional[bool] = opt(None, "Apex persistent LayerNorm kernel (needs Apex; CUDA).")
    transformer_impl: str = opt(
        "auto", "Layer spec: TE when it imports (auto), or forced.",
        ["auto", "local", "transformer_engine"],
    )


MEGATRON_HEAD_DIM = 64  # the head size when neither --num-attention-heads nor --kv-channels is given


def megatron_ffn(hidden: int, swiglu: bool) -> int:
    """Megatron-LM's MLP width when --ffn-hidden-size is unset: 4 x hidden, and for SwiGLU 2/3 of that rounded
    down to a multiple of 64 (the gated MLP's two input projections keep the parameter count near 8 h^2)."""
    return int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden


def derive_sizes(m: ModelConfig, explicit: set[str] = frozenset()) -> None:
    """Fill heads, head size, groups and FFN widths. A ratio (a preset's, or --ffn-ratio) scales with
    --hidden-size, so width families keep their shape; without one, Megatron-LM's rules apply."""
    derive_heads = m.num_attention_heads is None or ("hidden_size" in explicit and "num_attention_heads" not in explicit
                                                     and m.kv_channels is not None)
    if derive_heads:
        kv = m.kv_channels if m.kv_channels is not None else MEGATRON_HEAD_DIM
        if kv >= 1 and m.hidden_size % kv:  # (a --kv-channels below 1 is refused by its range, by flag)
            raise ValueError(
                f"--hidden-size {m.hidden_size} is not a multiple of --kv-channels {kv}; "
                "pick a width that is, or set --num-attention-heads explicitly"
            )
        m.num_attention_heads = m.hidden_size // kv if kv >= 1 else None
        m.kv_channels = kv
    elif m.kv_channels is None and m.num_attention_heads >= 1:
        if m.hidden_size % m.num_attention_heads:
            raise ValueError(
                f"--hidden-size {m.hidden_size} is not a multiple of --num-attention-heads {m.num_attention_heads}: "
                "set --kv-channels (the head size) explicitly, or pick sizes that divide")
        m.kv_channels = m.hidden_size // m.num_attention_heads
    if m.num_attention_heads is not None and (
            m.num_query_groups is None or ("num_query_groups" not in explicit and "hidden_size" in explicit)):
        m.num_query_groups = max(1, int(round(m.num_attention_heads * m.query_group_ratio)))
    if m.ffn_hidden_size is None or ("ffn_hidden_size" not in explicit and "hidden_size" in explicit):
        m.ffn_hidden_size = (int(round(m.ffn_ratio * m.hidden_size)) if m.ffn_ratio is not None
                             else megatron_ffn(m.hidden_size, m.swiglu))
    if m.num_experts and (
        m.moe_ffn_hidden_size is None
        or ("moe_ffn_hidden_size" not in explicit and "hidden_size" in explicit)
    ):
        m.moe_ffn_hidden_size = (int(round(m.moe_ffn_ratio * m.hidden_size)) if m.moe_ffn_ratio is not None
                                 else m.ffn_hidden_size)
    if m.max_position_embeddings is None or (
            "max_position_embeddings" not in explicit and m.max_position_embeddings < m.seq_length):
        m.max_position_embeddings = m.seq_length  # (a value the user set is checked against --seq-length)
