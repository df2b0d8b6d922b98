"""Weight-geometry and attention diagnostics, cheap enough to leave on.

Every log interval: per hidden matrix σ_max, σ_min, ‖Off(WᵀW)‖_F and ‖W‖_F (TP shards gathered
first), MD gain statistics where MD manages the matrix, and per layer the max attention logit and
mean attention entropy of the interval's last micro-batch (first sequence). The values land in
``metrics.jsonl`` (keys ``diag/...``), TensorBoard and W&B; ``tools/plot_spectra.py`` draws them.
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)\.weight$")
_ROLES = [
    ("self_attention.linear_qkv", "attention.qkv"),
    ("self_attention.linear_proj", "attention.proj"),
    ("mlp.linear_fc1", "mlp.fc1"),
    ("mlp.linear_fc2", "mlp.fc2"),
    ("mlp.router", "router"),
]
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_(fc\d)$")  # canonical (mcore/naming.py)


def label(md_key: str) -> str | None:
    """``decoder.layers.3.self_attention.linear_qkv.weight`` -> ``L3.attention.qkv``; a routed expert's
    matrix, SequentialMLP's ``local_experts.5.linear_fc1.weight`` or TEGroupedMLP's ``linear_fc1.weight5``,
    -> ``L1.expert5.fc1`` (md_keys carry the global expert; a raw grouped name its local index)."""
    from megatron_md.mcore.naming import canonical_name

    m = _LAYER.match(canonical_name(md_key or ""))
    if not m:
        return None
    layer, rest = m.groups()
    e = _EXPERT.match(rest)
    if e:
        return f"L{layer}.expert{e.group(1)}.{e.group(2)}"
    for prefix, role in _ROLES:
        if rest == prefix:
            return f"L{layer}.{role}"
    return None


def _gather_full(p: torch.Tensor) -> torch.Tensor:
    W = p.detach().float()
    if not getattr(p, "tensor_model_parallel", False):
        return W
    group = ps.get_expert_tensor_parallel_group() if getattr(p, "expert_tp", False) else ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return W
    parts = [torch.empty_like(W) for _ in range(size)]
    dist.all_gather(parts, W.contiguous(), group=group)
    return torch.cat(parts, dim=p.partition_dim)


def matrix_stats(W: torch.Tensor) -> dict[str, float]:
    """σ_max, σ_min, ‖Off(WᵀW)‖_F (Gram of the smaller side), ‖W‖_F of one matrix."""
    sv = torch.linalg.svdvals(W)
    X = W if W.shape[0] >= W.shape[1] else W.T
    gram = X.T @ X
    off = (gram.pow(2).sum() - gram.diagonal().pow(2).sum()).clamp_min(0).sqrt()
    return {
        "sigma_max": sv.max().item(),
        "sigma_min": sv.min().item(),
        "off_gram": off.item(),
        "fro": W.norm().item(),
    }


class AttentionProbe:
    """Forward pre-hooks on each layer's core attention that measure logits when armed."""

    def __init__(self, gpt_model):
        self.armed = False
        self.values: dict[str, float] = {}
        self.handles = []
        for layer in getattr(getattr(gpt_model, "decoder", None), "layers", []):
            core = getattr(layer.self_attention, "core_attention", None)
            if core is not None:
                self.handles.append(core.register_forward_pre_hook(self._hook(layer.layer_number - 1)))

    def _hook(self, layer_idx: int):
        def hook(module, args):
            if not self.armed or len(args) < 2:
                return
            q, k = args[0], args[1]  # [s, b, heads, d] and [s, b, groups, d]
            with torch.no_grad():
                q0, k0 = q[:, 0].float(), k[:, 0].float()
                if k0.shape[1] != q0.shape[1]:  # GQA: repeat K groups over their heads
                    k0 = k0.repeat_interleave(q0.shape[1] // k0.shape[1], dim=1)
                logits = torch.einsum("shd,thd->hst", q0, k0) / math.sqrt(q0.shape[-1])
                s = logits.shape[-1]
                causal = torch.ones(s, s, dtype=torch.bool, device=logits.device).tril()
                logits = logits.masked_fill(~causal, float("-inf"))
                probs = logits.softmax(-1)
                entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()
                self.values[f"L{layer_idx}.max_logit"] = logits.masked_fill(~causal, -1e30).max().item()
                self.values[f"L{layer_idx}.attn_entropy"] = entropy.item()

        return hook

    def take(self) -> dict[str, float]:
        out, self.values = self.values, {}
        return out


def weight_diagnostics(model, optimizer) -> dict[str, float]:
    """This rank's share of the matrix statistics (TP rank 0 of each group reports)."""
    from megatron_md.mcore.md_checkpoint import md_optimizers
    from megatron.core.utils import unwrap_model as unwrap

    gains = {}
    for opt in md_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                key = getattr(p, "md_key", None)
                if key and opt.state.get(p):
                    gains[key] = opt.gains(p)
    out: dict[str, float] = {}
    for name, p in unwrap(model).named_parameters():
        key = getattr(p, "md_key", name)
        lab = label(key)
        if lab is None or p.ndim != 2:
            continue
        W = _gather_full(p)
        tp_rank = (ps.get_expert_tensor_parallel_rank() if getattr(p, "expert_tp", False)
                   else ps.get_tensor_model_parallel_rank())
        if tp_rank != 0:
            continue
        for k, v in matrix_stats(W).items():
            out[f"diag/{lab}/{k}"] = v
        for axis, g in zip(("row", "col"), gains.get(key, (None, None))):
            if g is not None:  # local shard's gains: enough for a trend
                out[f"diag/{lab}/gain_{axis}_mean"] = g.mean().item()
                out[f"diag/{lab}/gain_{axis}_max"] = g.max().item()
    return out


def collect(model, optimizer, probe: AttentionProbe | None) -> dict[str, float]:
    """Gather every rank's diagnostics (all ranks must call); returns the merged dict."""
    local = weight_diagnostics(model, optimizer)
    if probe is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        local.update({f"diag/{k}": v for k, v in probe.take().items()})
    elif probe is not None:
        probe.take()
    if ps.get_data_parallel_rank() != 0:
        local = {k: v for k, v in local.items() if ".expert" in k}  # experts differ across EP
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: dict[str, float] = {}
    for part in parts:
        merged.update(part or {})
    return dict(sorted(merged.items()))
