"""Per-head maximum pre-softmax attention logits: what QK-clip reads and the ``max_logit`` log fields report.

A head's logit is ``scale · q·k`` for a query and a key it may attend to, with q and k exactly as the attention
kernel receives them (after the projection, QK-norm and RoPE) and ``scale`` the softmax scale the kernel applies.
``MaxLogitProbe`` hooks every layer's core attention and keeps, while armed, a running per-head maximum over the
micro-batches (on the activations' device, no host sync):

- megatron's ``local`` attention (``DotProductAttention``) forms the scores anyway: the probe reads them at its
  softmax (``head_max_from_scores``), with the softmax's own mask and extra scale;
- every other backend (``sdpa``, Transformer Engine) never forms them: the probe recomputes ``Q·Kᵀ`` without
  gradients in chunks of query rows (``head_max_logits``), masked as the kernel masks.

Heads are this rank's tensor-parallel heads in megatron's order (query head h reads key group h // (heads /
groups)). Reducing over micro-batches is here; over data-parallel ranks it is the caller's (mcore/qk_clip.py).
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.enums import AttnMaskType

# The most float32 logits one chunk of query rows may hold (64 MiB); a chunk is never less than one row.
BLOCK_ELEMS = 1 << 24
NEG_INF = float("-inf")


def _causal_masked(q0: int, q1: int, sk: int, device) -> torch.Tensor:
    """[q1-q0, sk], True where key j is after query i (megatron's causal mask, top-left aligned)."""
    return torch.arange(sk, device=device).unsqueeze(0) > torch.arange(q0, q1, device=device).unsqueeze(1)


@torch.no_grad()
def head_max_from_scores(scores: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                         extra_scale: float | None = None) -> torch.Tensor:
    """Per-head max of megatron's scores ``[b, heads, sq, sk]`` (already ``softmax_scale·QKᵀ``) as its softmax
    masks them: the given boolean ``mask`` (True = masked out) or, without one, the causal mask; ``extra_scale`` is the softmax's own factor (query-key layer scaling). Returns ``[heads]`` float32."""
    b, h, sq, sk = scores.shape
    best = torch.full((h,), NEG_INF, dtype=torch.float32, device=scores.device)
    rows = max(1, BLOCK_ELEMS // max(1, b * h * sk))
    for q0 in range(0, sq, rows):  # chunks keep the masked copy small
        q1 = min(sq, q0 + rows)
        part = scores[:, :, q0:q1].float()
        if mask is not None:
            part = part.masked_fill(mask[..., q0:q1, :], NEG_INF)
        elif causal and sq > 1:
            part = part.masked_fill(_causal_masked(q0, q1, sk, part.device), NEG_INF)
        best = torch.maximum(best, part.amax(dim=(0, 2, 3)))
    # fl(x·s) is monotone in x for s > 0: scaling the maximum equals the maximum of the scaled logits
    return best * extra_scale if extra_scale is not None else best


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
                    causal: bool = False, block_elems: int = BLOCK_ELEMS) -> torch.Tensor:
    """Per-head max of ``scale · q·k`` over visible pairs, ``q`` ``[sq, b, heads, d]``, ``k`` ``[sk, b, groups, d]``
    (megatron's sbhd layout; GQA: head h reads group h // (heads/groups)). ``mask``: boolean, True = masked out,
    broadcastable to ``[b, heads, sq, sk]``; without it, ``causal`` masks keys after the query. Computed in
    float32 one sequence and one chunk of query rows at a time (about ``block_elems`` logits), never ``sq × sk``
    per head for the whole batch. Returns ``[heads]`` float32 (-inf for a head with no visible pair)."""
    sq, b, h, d = q.shape
    sk, g = k.shape[0], k.shape[2]
    rep = h // g
    best = torch.full((h,), NEG_INF, dtype=torch.float32, device=q.device)
    rows = max(1, block_elems // max(1, h * sk))
    causal_only = causal and mask is None and sq > 1
    for bi in range(b):
        kb = k[:, bi].float()  # [sk, g, d]
        for q0 in range(0, sq, rows):
            q1 = min(sq, q0 + rows)
            t1 = q1 if causal_only else sk  # causal: keys after the chunk's last query are never visible
            qb = q[q0:q1, bi].float().reshape(q1 - q0, g, rep, d)
            logits = torch.einsum("cgrd,tgd->grct", qb, kb[:t1]).reshape(h, q1 - q0, t1)
            if mask is not None:
                mb = mask[bi if mask.shape[0] > 1 else 0]  # [1 | heads, sq, sk]
                logits.masked_fill_(mb[:, q0:q1, :], NEG_INF)
            elif causal_only:
                logits.masked_fill_(_causal_masked(q0, q1, t1, logits.device), NEG_INF)
            best = torch.maximum(best, logits.amax(dim=(1, 2)))
    return best * scale


def _scores_hook(probe: "MaxLogitProbe", idx: int):
    def hook(module, args):
        if not probe.armed:
            return
        scores, mask = args[0], (args[1] if len(args) > 1 else None)
        if getattr(module, "window_size", None) is not None:
            raise ValueError("the max-logit probe does not take sliding-window attention; run with "
                             "--no-log-max-logit and without --qk-clip")
        causal = module.attn_mask_type == AttnMaskType.causal
        probe.record(idx, head_max_from_scores(scores, mask, causal, module.scale))

    return hook


def _qk_hook(probe: "MaxLogitProbe", idx: int):
    def hook(module, args, kwargs):
        if not probe.armed:
            return
        names = ("query", "key", "value", "attention_mask", "attn_mask_type")
        given = {**dict(zip(names, args)), **kwargs}
        if given.get("packed_seq_params") is not None:
            raise ValueError("the max-logit probe does not take packed (THD) sequences; run with --no-log-max-logit "
                             "and without --qk-clip, or unpacked sequences")
        q, k, mask = given["query"], given["key"], given.get("attention_mask")
        kind = given.get("attn_mask_type") or getattr(module, "attn_mask_type", None)
        scale = getattr(module, "softmax_scale", None) or 1.0 / math.sqrt(q.shape[-1])
        probe.record(idx, head_max_logits(q, k, scale, mask, kind == AttnMaskType.causal))

    return hook


class MaxLogitProbe:
    """Forward pre-hooks on each layer's core attention that keep per-head maximum logits while ``armed``.

    ``maxima[i]`` is layer i's (global 0-based index) running ``[local heads]`` maximum since the last
    ``take``; layers on other pipeline stages are absent."""

    def __init__(self, gpt_model):
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        self.armed = False
        self.maxima: dict[int, torch.Tensor] = {}
        self.heads: dict[int, int] = {}
        self.handles = []
        for layer in getattr(getattr(gpt_model, "decoder", None), "layers", []):
            attn = getattr(layer, "self_attention", None)
            core = getattr(attn, "core_attention", None)
            if core is None:
                continue
            idx = layer.layer_number - 1
            self.heads[idx] = attn.num_attention_heads_per_partition
            if isinstance(core, DotProductAttention):  # megatron's local attention: read its scores
                self.handles.append(core.scale_mask_softmax.register_forward_pre_hook(_scores_hook(self, idx)))
            else:
                self.handles.append(core.register_forward_pre_hook(_qk_hook(self, idx), with_kwargs=True))

    def record(self, idx: int, head_max: torch.Tensor) -> None:
        prev = self.maxima.get(idx)
        self.maxima[idx] = head_max if prev is None else torch.maximum(prev, head_max)

    def take(self) -> dict[int, torch.Tensor]:
        out, self.maxima = self.maxima, {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
