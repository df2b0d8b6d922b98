"""Build a megatron-core GPTModel (dense or MoE) from a resolved ModelConfig.

Transformer Engine's layer spec is used when TE imports (or when forced with
``--transformer-impl transformer_engine``); otherwise megatron-core's local spec, with
``TorchNorm`` in place of megatron's torch norm so sequence parallelism (needed by MoE+TP)
works without TE or Apex. MoE experts are TE's grouped-GEMM ``TEGroupedMLP`` when TE builds the
layers (unless ``--no-moe-grouped-gemm``), megatron's ``SequentialMLP`` otherwise. In the local spec the
core attention is ``SDPAttention`` (torch's scaled_dot_product_attention, ``--attention-backend sdpa``, the
default there) or megatron's ``DotProductAttention`` (``--attention-backend local``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import warnings

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_md.models.attention import SDPAttention
from megatron_md.models.backends import (  # noqa: F401  (resolved_attention_backend: re-exported)
    moe_grouped_gemm,
    resolved_attention_backend,
    use_transformer_engine,
)
from megatron_md.models.layers import SublayerOutput, TorchNorm
from megatron_md.models.presets import moe_layer_pattern


# Apex / Megatron-LM CUDA extensions behind megatron-core's FusedScaleMaskSoftmax; none ships with megatron-core.
FUSED_SOFTMAX_MODULES = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")


def fused_softmax_available() -> bool:
    """Whether megatron's fused masked softmax can run. With the fusion on, megatron-core imports these
    extensions inside the first fp16/bf16 forward of the local spec (sequence <= 4096), so without them
    the fusion must stay off (torch's softmax then runs)."""
    return all(importlib.util.find_spec(m) is not None for m in FUSED_SOFTMAX_MODULES)


def apex_available() -> bool:
    return importlib.util.find_spec("apex") is not None


def fusion_settings(model_cfg, *, cpu: bool, use_te: bool, grouped: bool) -> dict:
    """TransformerConfig fusion fields from the ``--*-fusion`` flags: unset means on where the kernel
    exists (CUDA, plus TE / Apex / Megatron's softmax extension where it needs one), off on CPU; asking
    for one where it cannot run is refused here, before any layer is built."""
    m = model_cfg
    glu_bias_gelu = m.swiglu or not m.disable_bias_linear  # megatron fuses plain GeLU only with a bias
    where = {  # flag -> (kernel exists here, what it needs)
        "rope_fusion": (not cpu and use_te, "Transformer Engine on CUDA"),
        "bias_swiglu_fusion": (not cpu, "CUDA"),
        "bias_gelu_fusion": (not cpu and glu_bias_gelu, "CUDA, and a bias (--no-disable-bias-linear)"),
        "bias_dropout_fusion": (not cpu and not (grouped and not m.disable_bias_linear), "CUDA"),
        "masked_softmax_fusion": (not cpu and fused_softmax_available(),
                                  "CUDA and Megatron's fused softmax extensions (" + ", ".join(FUSED_SOFTMAX_MODULES) + ")"),
        "gradient_accumulation_fusion": (
            not cpu and (use_te or importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None),
            "CUDA with Transformer Engine layers or Apex's fused_weight_gradient_mlp_cuda"),
        "cross_entropy_loss_fusion": (not cpu, "CUDA"),
        "persist_layer_norm": (not cpu and apex_available(), "CUDA and Apex"),
    }
    on = {}
    for name, (exists, needs) in where.items():
        asked = getattr(m, name)
        if asked and not exists:
            raise ValueError(
                f"--{name.replace('_', '-')} needs {needs}, which this run lacks; drop the flag (unset, it is on "
                f"exactly where it can run) or pass --no-{name.replace('_', '-')}"
            )
        on[name] = exists if asked is None else asked
    return dict(
        apply_rope_fusion=on["rope_fusion"],
        bias_activation_fusion=on["bias_swiglu_fusion"] if m.swiglu else on["bias_gelu_fusion"],
        bias_dropout_fusion=on["bias_dropout_fusion"],
        masked_softmax_fusion=on["masked_softmax_fusion"],
        gradient_accumulation_fusion=on["gradient_accumulation_fusion"],
        cross_entropy_loss_fusion=on["cross_entropy_loss_fusion"],
        persist_layer_norm=on["persist_layer_norm"],
    )


def attention_backend(model_cfg, *, cpu: bool, use_te: bool):
    """--attention-backend as megatron-core's AttnBackend. sdpa is ours (SDPAttention in the local spec, see
    layer_spec): megatron gets its default, AttnBackend.auto, whose only effect with the local spec is to leave
    Transformer Engine's NVTE_* kernel variables at TE's defaults, as a model built with megatron's defaults
    in the same process expects (megatron asserts those variables agree across the models a process builds)."""
    from megatron.core.transformer.enums import AttnBackend

    name = resolved_attention_backend(model_cfg, cpu=cpu, use_te=use_te)
    return AttnBackend.auto if name == "sdpa" else AttnBackend[name]


def recompute_settings(model_cfg) -> dict:
    """Megatron-LM's recompute flags as TransformerConfig fields ('selective': --recompute-modules, core_attn
    unless named)."""
    m = model_cfg
    if m.recompute_modules and m.recompute_granularity != "selective":
        raise ValueError("--recompute-modules applies to --recompute-granularity selective only")
    if m.recompute_granularity is None:
        if m.recompute_method or m.recompute_num_layers:
            raise ValueError("--recompute-method / --recompute-num-layers need --recompute-granularity full")
        return {}
    if m.recompute_granularity == "selective":
        if m.recompute_method or m.recompute_num_layers:
            raise ValueError(
                "--recompute-method / --recompute-num-layers apply to --recompute-granularity full only; "
                "selective recomputation recomputes --recompute-modules (default core_attn) in every layer"
            )
        return dict(recompute_granularity="selective", recompute_modules=list(m.recompute_modules or ["core_attn"]))
    return dict(recompute_granularity="full", recompute_method=m.recompute_method or "uniform",
                recompute_num_layers=m.recompute_num_layers or 1)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(
    model_cfg, parallel_cfg, *, bf16: bool, cpu: bool, use_te: bool | None = None
) -> TransformerConfig:
    m, p = model_cfg, parallel_cfg
    if use_te is None:
        use_te = use_transformer_engine(m.transformer_impl, cpu)
    dtype = torch.bfloat16 if bf16 else torch.float32
    grouped = moe_grouped_gemm(m, use_te)
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        layernorm_zero_centered_gamma=m.apply_layernorm_1p,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=not m.disable_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        init_method_std=m.init_method_std,
        attention_dropout=m.attention_dropout,
        hidden_dropout=m.hidden_dropout,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        sequence_parallel=p.sequence_parallel,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        # CPU: initialise the full master weight on CPU so the init is TP-size independent.
        use_cpu_initialization=cpu,
        # Megatron-LM's setting: a pipeline stage frees the data of the activations it has sent.
        deallocate_pipeline_outputs=True,
        attention_backend=attention_backend(m, cpu=cpu, use_te=use_te),
        **fusion_settings(m, cpu=cpu, use_te=use_te, grouped=grouped),
        **recompute_settings(m),
    )
    if m.num_experts:
        kwargs.update(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size,
            moe_grouped_gemm=grouped,
            moe_token_dispatcher_type=m.moe_token_dispatcher_type,
            moe_router_load_balancing_type=m.moe_router_load_balancing_type,
            moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_z_loss_coeff=m.moe_z_loss_coeff,
            moe_expert_capacity_factor=m.moe_expert_capacity_factor,
            moe_token_drop_policy=m.moe_token_drop_policy,
            moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
            moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=m.moe_shared_expert_gate,
            moe_router_dtype=m.moe_router_dtype,
            moe_router_score_function=m.moe_router_score_function,
            moe_router_pre_softmax=m.moe_router_pre_softmax,
            moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=m.moe_router_bias_update_rate,
            moe_permute_fusion=m.moe_permute_fusion,
            moe_layer_freq=_layer_freq(m),
        )
    return TransformerConfig(**kwargs)


def _layer_freq(m):
    """megatron-core's moe_layer_freq: 1 when every layer is MoE (its default, which the exports check), else the
    per-layer pattern."""
    pattern = moe_layer_pattern(m)
    return 1 if 0 not in pattern else pattern


def layer_spec(model_cfg, config: TransformerConfig, *, use_te: bool) -> tuple[ModuleSpec, type]:
    """The per-layer spec and the norm class used for the final and sandwich norms."""
    m = model_cfg
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=m.num_experts, moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=m.qk_layernorm
        )
        from megatron.core.extensions.transformer_engine import TENorm

        norm = TENorm
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=m.num_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=m.qk_layernorm,
            normalization=m.normalization,
        )
        norm = TorchNorm
        spec.submodules.input_layernorm = TorchNorm
        spec.submodules.pre_mlp_layernorm = TorchNorm
        attn = spec.submodules.self_attention.submodules
        if m.qk_layernorm:
            attn.q_layernorm = attn.k_layernorm = TorchNorm
        if m.attention_backend in ("auto", "sdpa"):  # auto means sdpa with the local spec
            attn.core_attention = SDPAttention
    if m.sandwich_norm or m.layer_scale:
        out = ModuleSpec(
            module=SublayerOutput,
            params=dict(
                config=config,
                norm=norm if m.sandwich_norm else None,
                scale=1.0 / m.num_layers if m.layer_scale else 1.0,
            ),
        )
        spec.submodules.self_attn_bda = out
        spec.submodules.mlp_bda = out
    return spec, norm


TE_KERNEL_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def build_model(
    run_cfg,
    vocab_size: int,
    *,
    cpu: bool,
    pre_process: bool | None = None,
    post_process: bool | None = None,
) -> GPTModel:
    """Build this pipeline stage's GPTModel. ``vocab_size`` must already be padded."""
    m = run_cfg.model
    use_te = use_transformer_engine(m.transformer_impl, cpu)
    config = transformer_config(m, run_cfg.parallel, bf16=run_cfg.training.bf16, cpu=cpu, use_te=use_te)
    spec, norm = layer_spec(m, config, use_te=use_te)
    specs = [spec] * get_num_layers_to_build(config)
    pattern = moe_layer_pattern(m)
    if pattern is not None and 0 in pattern:  # --moe-layer-freq: dense layers where the pattern has a 0
        dense, _ = layer_spec(dataclasses.replace(m, num_experts=None), config, use_te=use_te)
        offset = get_transformer_layer_offset(config)
        specs = [spec if pattern[offset + i] else dense for i in range(len(specs))]
    block = TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    if not use_te:
        # GPTModel sets Transformer Engine's NVTE_*_ATTN kernel variables for its attention backend and asserts that
        # earlier builds in the process agree. The local spec uses no TE kernel, so its builds (local and sdpa
        # alike) start from TE's defaults: one process can build both, e.g. a checkpoint converted across them.
        for name in TE_KERNEL_VARIABLES:
            os.environ.pop(name, None)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
    )
    if m.embedding_scale and pre_process:
        scale = math.sqrt(m.hidden_size)
        model.embedding.register_forward_hook(lambda _mod, _inp, out: out * scale)
    model.megatron_md_uses_te = use_te
    model.megatron_md_attention = resolved_attention_backend(m, cpu=cpu, use_te=use_te)
    return model
