"""QK-clip and the max-logit log fields inside megatron-core: which weights a layer's logit scale lives in, the
reductions over ranks, and the rescale of every copy of those weights.

Per step (``before_step`` after the forward/backward, then megatron's ``optimizer.step()``):

1. the probe's per-head maxima (``models/logits.py``, all micro-batches) are reduced with MAX over the
   data-parallel and context-parallel ranks, and each layer's maximum over its tensor-parallel heads;
2. layers whose maximum exceeds τ get factors (``optim/qk_clip.py``), chosen by where the logit scale lives:
   - QK-norm (``--qk-layernorm``): q = norm(W_Q x)·γ_q, so a factor on W_Q's rows is normalised away; the logit
     scale is the norms' weights, which megatron shares across the heads. The layer's factor goes into them
     (``η^α`` on the query norm, ``η^(1-α)`` on the key norm, weight and bias): every logit of the layer is
     scaled by η, its largest lands on τ;
   - no QK-norm: the rows of the fused QKV weight (and bias) per head (Kimi K2's MuonClip);
   - QK L2-norm without weights: logits are bounded by the softmax scale; nothing to clip;
3. the factors are applied right after the inner optimizer's step and before megatron copies the fp32 masters
   into the model weights (the instance's ``step`` is wrapped). So the master (whole, or this rank's shard
   under the distributed optimizer) is what is scaled, and the bf16 weight is its copy as after any step: the
   clip cannot be undone by the next step, and a checkpoint holds the clipped weights in every copy. An
   optimizer that keeps a geometry (MD, Manifold Muon) applies the row factors itself (``scale_rows_``).

The decision which layers clip is one host read per step (clipping on); without clipping, nothing is measured
except on the steps that log.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_md.mcore import compat
from megatron_md.models.logits import MaxLogitProbe
from megatron_md.optim import qk_clip as math_

NORM, ROWS, NOTHING = "QK-norm weights", "QKV rows", "nothing"


class _Layer:
    """One attention layer: its heads on this rank and the model params its logit scale lives in."""

    def __init__(self, attn, config):
        from megatron.core.transformer.identity_op import IdentityOp

        self.heads = attn.num_attention_heads_per_partition
        self.groups = attn.num_query_groups_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        if getattr(config, "attention_output_gate", False):
            raise ValueError("--qk-clip / the max-logit probe do not know the gated QKV layout; drop the output gate")
        qn = getattr(attn, "q_layernorm", None)
        if qn is not None and not isinstance(qn, IdentityOp) and list(qn.parameters()):
            self.kind = NORM
            self.targets = [(p, "q") for p in qn.parameters()] + [(p, "k") for p in attn.k_layernorm.parameters()]
        elif qn is not None and not isinstance(qn, IdentityOp):
            self.kind, self.targets = NOTHING, []
        else:
            self.kind = ROWS
            self.targets = [(p, "qkv") for p in attn.linear_qkv.parameters()]

    def factors(self, head_max: torch.Tensor, layer_max: torch.Tensor, tau: float, alpha: float) -> dict:
        """{"q": ..., "k": ..., "qkv": ...}: factors per target role (0-d for the norms, rows for QKV)."""
        if self.kind == NORM:
            q, k = math_.layer_factors(layer_max, tau, alpha)
            return {"q": q, "k": k}
        qf, kf = math_.query_key_factors(head_max, self.groups, tau, alpha)
        return {"qkv": math_.qkv_row_factors(qf, kf, self.head_dim)}


class _Main:
    """Where one model param's fp32 master lives: the inner optimizer holding it, and for the distributed
    optimizer the flat range of the param this rank's shard covers."""

    def __init__(self, inner, main: torch.Tensor, start: int | None = None, cols: int = 1):
        self.inner, self.main, self.start, self.cols = inner, main, start, cols

    def apply(self, factors: torch.Tensor) -> None:
        f = factors.to(self.main.device)
        if self.start is not None:  # a flat shard of the param: element i of it is row (start + i) // cols
            if f.ndim:
                idx = torch.arange(self.start, self.start + self.main.numel(), device=f.device) // self.cols
                f = f[idx]
            self.main.mul_(f.to(self.main.dtype))
        elif f.ndim and self.main.ndim == 2 and hasattr(self.inner, "scale_rows_"):
            self.inner.scale_rows_(self.main, f)
        elif f.ndim and self.main.ndim == 2:
            self.main.mul_(f.unsqueeze(1).to(self.main.dtype))
        else:
            self.main.mul_(f.to(self.main.dtype))


def _leaves(optimizer):
    children = getattr(optimizer, "chained_optimizers", None)
    if children is None:
        yield optimizer
        return
    for child in children:
        yield from _leaves(child)


def _masters(leaf) -> list[tuple[torch.Tensor, _Main]]:
    """(model param, its master) for every param this megatron optimizer's inner optimizer steps here."""
    inner = getattr(leaf, "optimizer", None)
    if inner is None or getattr(leaf, "is_stub_optimizer", False):
        return []
    stepped = {id(p) for g in inner.param_groups for p in g["params"]}
    pairs = []
    if hasattr(leaf, "shard_fp32_from_float16_groups"):  # DistributedOptimizer: flat shards
        range_of = compat.get("_get_model_param_range_map")
        for models, shards in ((leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups),
                               (leaf.model_fp32_groups, leaf.shard_fp32_groups)):
            for mg, sg in zip(models, shards):
                for p, shard in zip(mg, sg):
                    r = range_of(leaf, p)["param"]
                    cols = p.shape[1] if p.ndim == 2 else 1
                    pairs.append((p, _Main(inner, shard, r.start, cols)))
    elif hasattr(leaf, "float16_groups"):  # Float16OptimizerWithFloat16Params: whole fp32 masters
        for mg, fg in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
            pairs += [(p, _Main(inner, m)) for p, m in zip(mg, fg)]
        pairs += [(p, _Main(inner, p)) for g in leaf.fp32_from_fp32_groups for p in g]
    else:  # FP32Optimizer: the model params themselves
        pairs += [(p, _Main(inner, p)) for g in inner.param_groups for p in g["params"]]
    return [(p, m) for p, m in pairs if id(m.main) in stepped]


def _device_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """All-reduce MAX where the backend can (gloo reduces host tensors)."""
    gloo = dist.get_backend(group) == "gloo"
    work = t.cpu() if gloo and t.device.type != "cpu" else t
    dist.all_reduce(work, op=dist.ReduceOp.MAX, group=group)
    return work.to(t.device) if work is not t else t


class QKClip:
    """The probe, the per-step reductions and the rescale; ``log_fields`` for the log record."""

    def __init__(self, model, optimizer, *, clip: bool, threshold: float, alpha: float, num_layers: int):
        from megatron.core.utils import unwrap_model

        gpt = unwrap_model(model)
        self.clip, self.tau, self.alpha, self.num_layers = clip, threshold, alpha, num_layers
        if clip:
            math_.query_key_factors(torch.zeros(1), 1, threshold, alpha)  # refuses a bad τ or α now
        self.probe = MaxLogitProbe(gpt)
        self.layers = {layer.layer_number - 1: _Layer(layer.self_attention, gpt.config)
                       for layer in gpt.decoder.layers}
        self.pending: dict[int, torch.Tensor] = {}  # id(master) -> factors, for this step
        self.last: tuple[list[int], torch.Tensor] | None = None
        self.clipped = 0  # layer-steps clipped since the last log record
        self.where: dict[str, str] = {}
        if clip:
            self._attach(optimizer)

    def _attach(self, optimizer) -> None:
        masters: dict[int, list[_Main]] = {}
        for leaf in _leaves(optimizer):
            for p, m in _masters(leaf):
                masters.setdefault(id(p), []).append(m)
        self.targets: dict[int, list[tuple[str, list[_Main]]]] = {}
        inners = {}
        for idx, layer in self.layers.items():
            self.where.setdefault(layer.kind, "")
            entries = []
            for p, role in layer.targets:
                ms = masters.get(id(p), [])
                for m in ms:
                    inners[id(m.inner)] = m.inner
                    if role == "qkv" and p.ndim == 2 and m.start is None and hasattr(m.inner, "check_scale_rows"):
                        self.where[layer.kind] = m.inner.check_scale_rows(m.main)
                entries.append((role, ms))
            self.targets[idx] = entries
        for inner in inners.values():
            inner.step = functools.partial(self._step_then_clip, inner, inner.step)

    def _step_then_clip(self, inner, step, *args, **kwargs):
        out = step(*args, **kwargs)
        for idx, entries in self.targets.items():
            for role, masters in entries:
                for m in masters:
                    f = self.pending.pop(id(m.main), None) if m.inner is inner else None
                    if f is not None:
                        m.apply(f)
        return out

    def describe(self) -> str:
        if not self.clip:
            return "max logit: measured on logged steps (--qk-clip off)"
        kinds = "; ".join(f"{k}{': ' + v if v else ''}" for k, v in self.where.items())
        return f"qk-clip: τ {self.tau:g}, α {self.alpha:g}, every step; scaled: {kinds}"

    def arm(self, log_step: bool) -> None:
        self.probe.armed = self.clip or log_step

    @torch.no_grad()
    def before_step(self) -> None:
        """Reduce this step's maxima over ranks and queue the factors of the layers above τ."""
        self.probe.armed = False
        self.pending.clear()
        maxima = self.probe.take()
        if not maxima:
            return
        idxs = sorted(maxima)
        heads = _device_reduce(torch.stack([maxima[i] for i in idxs]),
                               ps.get_data_parallel_group(with_context_parallel=True))
        layer_max = _device_reduce(heads.amax(dim=1), ps.get_tensor_model_parallel_group())
        self.last = (idxs, layer_max)
        if not self.clip:
            return
        fired = (layer_max > self.tau).tolist()  # the step's one host read
        for row, (idx, hot) in enumerate(zip(idxs, fired)):
            if not hot or self.layers[idx].kind == NOTHING:
                continue
            self.clipped += 1
            factors = self.layers[idx].factors(heads[row], layer_max[row], self.tau, self.alpha)
            for role, masters in self.targets.get(idx, []):
                for m in masters:
                    self.pending[id(m.main)] = factors[role]

    def discard(self) -> None:
        """A step with non-finite gradients: its maxima are dropped (every rank skips it together)."""
        self.probe.armed = False
        self.probe.take()

    def after_step(self) -> None:
        self.pending.clear()  # a skipped step (non-finite gradients) clips nothing

    def log_fields(self, device) -> dict:
        """``max_logit`` (largest over layers) and ``max_logit/L<i>`` of the last measured step, from every
        pipeline stage; ``qk_clip_layers`` with clipping on. A collective: every rank calls it."""
        v = torch.full((self.num_layers,), -math.inf, dtype=torch.float32, device=device)
        if self.last is not None:
            idxs, layer_max = self.last
            v[torch.tensor(idxs, device=device)] = layer_max.to(device)
        v = _device_reduce(v, None)
        vals = v.tolist()
        self.last = None
        finite = [x for x in vals if math.isfinite(x)]
        out: dict = {"max_logit": max(finite) if finite else None}
        out.update({f"max_logit/L{i}": (x if math.isfinite(x) else None) for i, x in enumerate(vals)})
        if self.clip:
            out["qk_clip_layers"], self.clipped = self.clipped, 0
        return out
