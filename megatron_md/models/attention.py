"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (``--attention-backend sdpa``).

megatron-core 0.19 has no fused attention without Transformer Engine: its local spec's
``DotProductAttention`` builds the [b, np, sq, sk] scores, softmaxes them in fp32 and keeps them for
the backward pass. ``SDPAttention`` is a drop-in for it in the local layer spec (``models/builder.py``
swaps ``self_attention.submodules.core_attention``): same constructor and ``forward`` arguments, same
shapes (query [sq, b, np, hn], key/value [sk, b, ng, hn], output [sq, b, np*hn], heads per TP rank),
same masking, scale and dropout RNG, and no parameters, so checkpoints are the same under either.

What torch runs underneath: on CUDA, flash attention, cuDNN or the memory-efficient kernel, which keep
no s x s tensor for backward (flash only without a mask); on the CPU (torch 2.13), a flash-style kernel
that keeps none either, unless attention dropout is on, where torch falls back to its math path, which
keeps the probabilities. Config that ``DotProductAttention`` supports and this module does not
(context parallelism, sliding windows, softmax offsets/sinks, packed THD sequences, attention bias) is
refused with the way out (``--attention-backend local``), never approximated.

One difference in a case the trainer never produces (it passes no mask; causal masking is built in): a
query row whose keys are all masked gets zeros here, and the mean of the values from megatron's
``masked_fill(-10000)``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

LOCAL = "use --attention-backend local (megatron-core's DotProductAttention)"


class SDPAttention(MegatronModule):
    """megatron-core's ``DotProductAttention`` interface on torch's scaled_dot_product_attention."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        **_unused,
    ):
        super().__init__(config=config)
        refuse_unsupported(config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        projection = config.kv_channels * config.num_attention_heads
        # megatron's scale: softmax_scale or 1/sqrt(head dim). With apply_query_key_layer_scaling it divides
        # the scores by the layer number and multiplies them back inside the softmax: the two cancel.
        self.softmax_scale = (1.0 / math.sqrt(divide(projection, config.num_attention_heads))
                              if softmax_scale is None else softmax_scale)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError(f"--attention-backend sdpa does not take packed (THD) sequences; {LOCAL} is no "
                             "option either: packed sequences need Transformer Engine's attention")
        if attention_bias is not None:
            raise ValueError(f"--attention-backend sdpa does not take an attention bias; {LOCAL}")
        sq, b = query.shape[:2]
        sk = key.shape[0]
        # megatron ignores the per-call attn_mask_type in DotProductAttention and masks by its own.
        mask, causal = None, False
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError("--attention-backend sdpa: megatron's attention mask is boolean (True = "
                                 f"masked out), got {attention_mask.dtype}")
            mask = ~attention_mask  # SDPA's boolean mask means the opposite: True = attend
        elif self.attn_mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:  # SDPA's is_causal is top-left aligned; megatron refuses this case too
                raise ValueError(f"causal attention needs as many queries as keys, got {sq} and {sk}")
            causal = True
        # GQA: repeat K/V per query head as megatron does (head i reads group i // (np/ng)). SDPA's
        # enable_gqa is taken by its flash and math kernels only, not cuDNN or memory-efficient.
        if self.heads != self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        # [s, b, n, hn] -> [b, n, s, hn]: strided views, which the kernels accept (last dim contiguous).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        p = self.dropout_p if self.training else 0.0
        if p > 0 and not self.config.sequence_parallel:
            # megatron draws attention dropout from the model-parallel RNG stream (per TP rank); on CPU
            # the runtime makes that stream torch's default generator, which SDPA's dropout uses.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                     scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                 scale=self.softmax_scale)
        # [b, np, sq, hv] -> [sq, b, np*hv]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * out.shape[-1])


def refuse_unsupported(config) -> None:
    """Raise, naming the setting and the fix, for TransformerConfig settings DotProductAttention honours
    and SDPAttention would silently ignore."""
    problems = []
    if getattr(config, "context_parallel_size", 1) > 1:
        problems.append(f"context parallelism (context_parallel_size {config.context_parallel_size}) needs "
                        "Transformer Engine's attention")
    if getattr(config, "window_size", None) is not None:
        problems.append(f"sliding-window attention (window_size {config.window_size}): {LOCAL}")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax offsets / attention sinks (softmax_type {config.softmax_type!r}): {LOCAL}")
    if problems:
        raise ValueError("--attention-backend sdpa cannot run " + "; ".join(problems))
