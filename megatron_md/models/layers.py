"""Small layer pieces plugged into megatron-core through its layer specs (no edited copies).

- ``TorchNorm``: torch LayerNorm/RMSNorm that, unlike megatron's ``WrappedTorchNorm``, accepts
  sequence parallelism (its weight is tagged so megatron's grad finalisation all-reduces it over
  TP). That lets MoE+TP, which megatron requires to use sequence parallelism, run without TE/Apex.
  With ``--apply-layernorm-1p`` (megatron's ``layernorm_zero_centered_gamma``) the stored weight is the scale
  minus one, as in megatron's fused LayerNorm and Transformer Engine's norms.
- ``SublayerOutput``: a bias-dropout-add replacement for the MD paper's architecture options:
  sandwich norm (normalise the sublayer output before the residual add) and a fixed layer scale.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.spec_utils import build_module


class _ZeroCentred:
    """Mixin: the weight holds scale - 1 (initialised to 0); the norm applies weight + 1."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "weight", None) is not None:
            with torch.no_grad():
                self.weight.zero_()

    def forward(self, x):
        if isinstance(self, torch.nn.RMSNorm):
            return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCentredRMSNorm(_ZeroCentred, torch.nn.RMSNorm):
    pass


class ZeroCentredLayerNorm(_ZeroCentred, torch.nn.LayerNorm):
    pass


class TorchNorm:
    """Build torch.nn.LayerNorm / RMSNorm with the megatron norm-module signature."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        centred = getattr(config, "layernorm_zero_centered_gamma", False)
        if config.normalization == "RMSNorm":
            norm = (ZeroCentredRMSNorm if centred else torch.nn.RMSNorm)(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = (ZeroCentredLayerNorm if centred else torch.nn.LayerNorm)(hidden_size, eps=eps)
        else:
            raise ValueError(f"--normalization {config.normalization} is not supported")
        if config.sequence_parallel:
            # Each TP rank sees a different slice of the sequence: the weight grads must be summed.
            for p in norm.parameters():
                setattr(p, "sequence_parallel", True)
        return norm


class SublayerOutput(torch.nn.Module):
    """bias-dropout-add that first normalises (sandwich norm) and scales the sublayer output."""

    def __init__(self, config, norm: type | None = None, scale: float = 1.0):
        super().__init__()
        self.norm = (
            build_module(norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
            if norm is not None
            else None
        )
        self.scale = scale

    def forward(self, training: bool, fused: bool):
        # TransformerLayer calls bda(training, fused) and then applies the returned function.
        add = get_bias_dropout_add(training, False)

        def apply(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            if self.norm is not None:
                x = self.norm(x)
            if self.scale != 1.0:
                x = x * self.scale
            return add((x, None), residual, prob)

        return apply
