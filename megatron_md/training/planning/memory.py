"""``megatron-md plan``: per-device memory of a run before launching it, from its config alone.

Closed forms of what the trainer allocates (checked against a real allocation in
tests/training/planning/test_plan.py):

- parameters in the param dtype (bf16 or fp32), each rank holding its TP / PP / EP shard;
- gradients: megatron DDP's grad buffers, fp32 (the trainer reduces in fp32), one full copy per rank;
- fp32 master weights with ``--bf16``;
- optimizer state in fp32: AdamW's two moments, Muon momentum, the MD gains and their Adam moments, the
  Manifold Muon duals (a full ``k x k`` per constrained matrix, k its short side);
- master weights and optimizer state sharded over DP by ``--use-distributed-optimizer`` (byte-sharded for
  adam, whole matrices for the layer-wise optimizer: ≈ 1/DP either way);
- activations per micro-batch by Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models"), term by term for this model (GQA, SwiGLU, QK-norm, MoE experts), for the attention
  kernel the run will use (``attention_for``: TE's flash attention and torch's SDPA keep no s x s tensor,
  except SDPA on the CPU with attention dropout; megatron-core's local, unfused attention keeps per layer
  the fp32 softmax, its bf16 copy and the causal mask, each s x s per head, counted tensor by tensor and
  checked against a measurement), with sequence parallelism dividing the
  norm regions by TP, and 1F1B keeping PP micro-batches in flight on the first stage.

FLOPs, communication and the report live in ``report.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_md.mcore.families import family_of
from megatron_md.models.builder import padded_vocab_size

FP32 = 4


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    ep: int
    etp: int
    dp: int  # dense data-parallel size
    edp: int  # expert data-parallel size
    sp: bool
    distopt: bool
    micro_batch: int
    global_batch: int

    @property
    def micro_batches(self) -> int:
        return max(1, self.global_batch // (self.micro_batch * self.dp))


def layout_of(cfg, world: int) -> Layout:
    p, t = cfg.parallel, cfg.training
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    if world % (tp * pp):
        raise ValueError(f"--world-size {world} is not a multiple of TP x PP = {tp * pp}")
    dp = world // (tp * pp)
    if cfg.model.num_experts and world % (ep * etp * pp):
        raise ValueError(f"--world-size {world} is not a multiple of EP x expert-TP x PP = {ep * etp * pp}")
    edp = world // (ep * etp * pp) if cfg.model.num_experts else dp
    gbs = t.global_batch_size or t.micro_batch_size * dp
    return Layout(world, tp, pp, ep, etp, dp, edp, bool(p.sequence_parallel and tp > 1),
                  bool(p.use_distributed_optimizer), t.micro_batch_size, gbs)


@dataclass(frozen=True)
class Tensor:
    """``count`` parameters of one kind on one rank: local shape, full shape (duals), expert or dense."""

    role: str  # policy role: attention.qkv, mlp.fc1, experts.fc2, router, embedding, head, norm, ...
    local: tuple
    full: tuple
    count: int
    expert: bool = False

    @property
    def numel(self) -> int:
        return self.count * math.prod(self.local)


def layers_on_stage(cfg, pp: int) -> int:
    return math.ceil(cfg.model.num_layers / pp)


def inventory(cfg, lay: Layout, stage: int) -> list[Tensor]:
    """The parameters one rank of pipeline stage ``stage`` holds (no DDP padding)."""
    m = cfg.model
    h, d, a, g = m.hidden_size, m.kv_channels, m.num_attention_heads, m.num_query_groups
    t, L = lay.tp, layers_on_stage(cfg, lay.pp)
    bias = not m.disable_bias_linear
    norm_w = 1 if m.normalization == "RMSNorm" else 2
    out: list[Tensor] = []

    def add(role, full, split_dim, count, expert=False, tp=t):
        local = list(full)
        if split_dim is not None:
            local[split_dim] = full[split_dim] // tp
        out.append(Tensor(role, tuple(local), tuple(full), count, expert))

    qkv_rows = d * (a + 2 * g)
    add("attention.qkv", (qkv_rows, h), 0, L)
    add("attention.proj", (h, a * d), 1, L)
    add("norm", (norm_w * h,), None, 2 * L)
    if m.qk_layernorm:
        add("norm", (norm_w * d,), None, 2 * L)
    if m.sandwich_norm:
        add("norm", (norm_w * h,), None, 2 * L)
    if bias:
        add("bias", (qkv_rows,), 0, L)
        add("bias", (h,), None, L)
    up = 2 if m.swiglu else 1
    if m.num_experts:
        f, local_experts = m.moe_ffn_hidden_size, m.num_experts // lay.ep
        add("router", (m.num_experts, h), None, L)
        add("experts.fc1", (up * f, h), 0, L * local_experts, True, lay.etp)
        add("experts.fc2", (h, f), 1, L * local_experts, True, lay.etp)
        if bias:
            add("bias", (up * f,), 0, L * local_experts, True, lay.etp)
            add("bias", (h,), None, L * local_experts, True)
        shared = getattr(m, "moe_shared_expert_intermediate_size", None)
        if shared:  # the shared expert: a dense TP-split MLP beside the routed ones (policy role: experts)
            add("experts.fc1", (up * shared, h), 0, L)
            add("experts.fc2", (h, shared), 1, L)
            if bias:
                add("bias", (up * shared,), 0, L)
                add("bias", (h,), None, L)
    else:
        f = m.ffn_hidden_size
        add("mlp.fc1", (up * f, h), 0, L)
        add("mlp.fc2", (h, f), 1, L)
        if bias:
            add("bias", (up * f,), 0, L)
            add("bias", (h,), None, L)
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, t)
    first, last = stage == 0, stage == lay.pp - 1
    if first:
        add("embedding", (vocab, h), 0, 1)
        if m.position_embedding_type == "learned_absolute":
            add("position_embedding", (m.max_position_embeddings, h), None, 1)
    if last:
        add("norm", (norm_w * h,), None, 1)
        # Tied embeddings: the last stage keeps its own copy of the word embedding when PP > 1.
        if m.untie_embeddings_and_output_weights or (lay.pp > 1):
            add("head", (vocab, h), 0, 1)
    return out


# ------------------------------------------------------------------------------------------------ optimizer


def base_state(kind: str) -> tuple[int, int, bool]:
    """(Adam moments, momentum-like buffers of the matrix's shape, Kronecker factors?) of a base update, as the
    base declares it (``optim/bases.py``: a new base is counted without an entry here)."""
    from megatron_md.optim.bases import BASES

    return BASES[kind].state_layout


def _gain_elems(shape: tuple, gains: str, rank: int = 4) -> int:
    rows, cols = shape
    # "embed" is row gains, column gains on out-projections: the larger of the two bounds it
    if gains == "lowrank":  # A [m, k] and B [k, n], k = --md-gains-rank capped at min(m, n)
        return min(rank, rows, cols) * (rows + cols)
    return {"rowcol": rows + cols, "row": rows, "col": cols, "flat": 1, "embed": max(rows, cols), "none": 0}[gains]


def optimizer_state(cfg, tensors: list[Tensor]) -> dict[str, int]:
    """Bytes of optimizer state by kind for ``tensors`` (unsharded over DP), as the optimizers allocate it."""
    o = cfg.optimizer
    kinds = {"adam_moments": 0, "muon_momentum": 0, "md_gains": 0, "manifold_duals": 0, "soap_factors": 0}
    family = family_of(cfg)

    def base(kind, n, tn: Tensor | None = None):
        moments, momenta, kronecker = base_state(kind)
        kinds["adam_moments"] += moments * FP32 * n
        kinds["muon_momentum"] += momenta * FP32 * n
        if kronecker:  # SOAP: the Kronecker factors L, R and their eigenbases Q_L, Q_R
            rows, cols = tn.full
            kinds["soap_factors"] += 2 * FP32 * tn.count * (rows * rows + cols * cols)

    def md(tn: Tensor, base_kind: str, gains: str):
        base(base_kind, tn.numel, tn)
        # Gain vector rho plus its two Adam moments, per axis, sized by the rank's shard.
        kinds["md_gains"] += 3 * FP32 * tn.count * _gain_elems(tn.local, gains, o.md.md_gains_rank)

    for tn in tensors:
        matrix = len(tn.local) == 2 and tn.role not in ("norm", "bias", "position_embedding")
        if not matrix:
            base("adam", tn.numel)
            continue
        a = family.assign(cfg, tn.role)
        if a.kind == "md":
            md(tn, a.base, a.gains)
        elif a.kind == "manifold":
            base("muon", tn.numel)
            if o.manifold.manifold_mode == "fast":
                rows, cols = tn.full
                blocks = qkv_rows(cfg) if (o.manifold.manifold_split_qkv and tn.role == "attention.qkv") else [rows]
                kinds["manifold_duals"] += FP32 * tn.count * sum(min(r, cols) ** 2 for r in blocks)
        else:
            base(a.base, tn.numel, tn)
    return kinds


def qkv_rows(cfg) -> list[int]:
    m = cfg.model
    return [m.num_attention_heads * m.kv_channels] + [m.num_query_groups * m.kv_channels] * 2


def static_memory(cfg, lay: Layout, stage: int) -> dict:
    """Bytes of params, grads, master weights and optimizer state on one rank of ``stage``."""
    tensors = inventory(cfg, lay, stage)
    dense = [t for t in tensors if not t.expert]
    expert = [t for t in tensors if t.expert]
    param_bytes = 2 if cfg.training.bf16 else FP32
    n_dense, n_expert = sum(t.numel for t in dense), sum(t.numel for t in expert)
    # The distributed optimizers shard master weights and state over the (expert-)data-parallel group.
    shard_d = lay.dp if lay.distopt else 1
    shard_e = lay.edp if lay.distopt else 1
    state_d, state_e = optimizer_state(cfg, dense), optimizer_state(cfg, expert)
    state = {k: math.ceil(state_d[k] / shard_d) + math.ceil(state_e[k] / shard_e) for k in state_d}
    master = 0
    if cfg.training.bf16:
        master = math.ceil(FP32 * n_dense / shard_d) + math.ceil(FP32 * n_expert / shard_e)
    return {
        "param_count": n_dense + n_expert,
        "expert_param_count": n_expert,
        "params": param_bytes * (n_dense + n_expert),
        "grads": FP32 * (n_dense + n_expert),  # grad_reduce_in_fp32: fp32 buffers on every rank
        "master_weights": master,
        "optimizer_state": sum(state.values()),
        "optimizer_state_by_kind": state,
    }


# ------------------------------------------------------------------------------------------------ activations

RECOMPUTE_MODES = ("none", "selective", "full")

# The attention kernels the plan can count. flash and sdpa keep no s x s tensor for backward.
ATTENTION_KERNELS = {
    "flash": "Transformer Engine's fused attention (flash-attn or cuDNN): no s x s tensor is kept",
    "sdpa": "torch's scaled_dot_product_attention in the local spec (--attention-backend sdpa): flash, cuDNN or "
            "memory-efficient kernels on CUDA, a flash-style kernel on the CPU; per layer it keeps Q, K and V "
            "(K and V repeated to all heads), its output and a fp32 log-sum-exp per head and token, no s x s tensor",
    "sdpa-math": "torch's SDPA on the CPU with attention dropout, where torch falls back to its math path in "
                 "fp32: per layer it keeps the probabilities, the dropout mask and dropout's output, all s x s "
                 "fp32, and fp32 copies of Q, K and V",
    "unfused": "megatron-core's local DotProductAttention with torch's softmax: per layer it keeps the fp32 "
               "probabilities, their act-dtype copy (bf16 runs) and a bool causal mask, all s x s",
    "unfused-fused-softmax": "megatron-core's local DotProductAttention with Megatron's fused causal softmax "
                             "kernel: per layer it keeps the probabilities in the act dtype only (s x s)",
    "te-unfused": "Transformer Engine's unfused attention (--attention-backend unfused): counted as "
                  "megatron-core's unfused attention with torch's softmax, an upper bound (not measured)",
}


@dataclass(frozen=True)
class Attention:
    """Which layer spec builds the layers (``te`` or ``local``) and which attention kernel the run uses."""

    spec: str
    kernel: str
    why: str
    cpu: bool = False

    @property
    def scores(self) -> bool:  # whether the kernel keeps s x s tensors for backward
        return self.kernel not in ("flash", "sdpa")

    @property
    def torch_softmax(self) -> bool:
        return self.kernel in ("unfused", "te-unfused")


def _fused_softmax_runs(cfg, micro_batch: int, tp: int) -> bool:
    """megatron-core's FusedScaleMaskSoftmax.is_kernel_available for causal self-attention, with the
    kernel's batch_per_block (scaled_masked_softmax.h: 128 threads, warps of min(2^ceil(log2 sk), 32)
    lanes, two rows a warp up to sk = 128)."""
    m = cfg.model
    s, heads = m.seq_length, m.num_attention_heads // tp
    pow2 = 1 << max(0, math.ceil(math.log2(s)))
    batch_per_block = (128 // min(pow2, 32)) * (2 if pow2 <= 128 else 1)
    batches = micro_batch * heads
    return (bool(cfg.training.bf16) and 16 < s <= 4096 and s % 4 == 0 and batches % 4 == 0
            and batches % batch_per_block == 0)


def attention_for(cfg, on_cpu: bool, micro_batch: int = 1, tp: int = 1) -> Attention:
    """The layer spec and attention kernel the trainer will build (``models/builder.py``), decided from the
    config alone: the planner runs on a login node, so it never looks at what imports here.

    --transformer-impl local, or a CPU run: megatron-core's local spec, whose attention is SDPA
    (--attention-backend auto or sdpa) or megatron's DotProductAttention (local or unfused).
    transformer_engine, or auto on a GPU: Transformer Engine's spec (auto assumes TE imports on the GPU
    machines, as in NGC containers; a run without TE gets the local spec, so plan it with
    --transformer-impl local). Under TE, --attention-backend auto, flash and fused keep no s x s tensor;
    unfused does.
    """
    m = cfg.model
    impl, backend = m.transformer_impl, m.attention_backend
    if impl == "transformer_engine" and on_cpu:
        raise ValueError("--transformer-impl transformer_engine needs CUDA; the plan's target is a CPU "
                         "(--device cpu): use --transformer-impl local or auto")
    te = impl == "transformer_engine" or (impl == "auto" and not on_cpu)
    if te:
        if backend in ("local", "sdpa"):
            raise ValueError(f"--attention-backend {backend} plugs into megatron-core's local layer spec, which "
                             "Transformer Engine layers replace; add --transformer-impl local, or pick auto, "
                             "flash, fused or unfused")
        src = "--transformer-impl transformer_engine" if impl != "auto" else (
            "--transformer-impl auto on a GPU: Transformer Engine assumed (NGC containers ship it; without it "
            "the run builds the local spec: plan with --transformer-impl local)")
        if backend == "unfused":
            return Attention("te", "te-unfused", f"{src}, --attention-backend unfused")
        return Attention("te", "flash", f"{src}, --attention-backend {backend}")
    if backend in ("flash", "fused"):
        raise ValueError(f"--attention-backend {backend} is a Transformer Engine kernel and needs CUDA with TE "
                         "layers; use --attention-backend sdpa (torch's fused attention), local (megatron-core's "
                         "own) or auto")
    src = "a CPU run: megatron-core's local spec" if on_cpu else "--transformer-impl local"
    if backend in ("auto", "sdpa"):
        src += f", --attention-backend {backend}: torch's scaled_dot_product_attention"
        if on_cpu and m.attention_dropout > 0:
            return Attention("local", "sdpa-math", f"{src} (with --attention-dropout on the CPU torch falls back "
                             "to its math path, which keeps the s x s probabilities)", on_cpu)
        return Attention("local", "sdpa", src, on_cpu)
    src += f", --attention-backend {backend}: megatron-core's DotProductAttention"
    fusion = m.masked_softmax_fusion
    if fusion and not on_cpu and _fused_softmax_runs(cfg, micro_batch, tp):
        return Attention("local", "unfused-fused-softmax", f"{src}, --masked-softmax-fusion")
    why = src
    if fusion is None and not on_cpu:
        why += (" (--masked-softmax-fusion unset: counted with torch's softmax, which keeps three times the "
                "fused kernel's bytes; the fusion runs only where Megatron's softmax extensions import)")
    return Attention("local", "unfused", why, on_cpu)


def layer_activation_bytes(cfg, lay: Layout, attn: Attention, selective: bool = False) -> dict:
    """Bytes one transformer layer saves for backward per micro-batch (Korthikanti's terms, this model).

    ``seq``: the parts outside TP regions (norm inputs/outputs, the inputs of column-parallel linears),
    divided by TP under sequence parallelism only; ``tensor``: inside TP regions, divided by TP.
    ``scores``: the s x s tensors of unfused attention (part of ``total``).
    """
    m = cfg.model
    s, b, h, d = m.seq_length, lay.micro_batch, m.hidden_size, m.kv_channels
    a, g, t = m.num_attention_heads, m.num_query_groups, lay.tp
    e = 2 if cfg.training.bf16 else FP32  # activation bytes
    # megatron's torch norms (local spec) compute and save in fp32; TE's fused norm-linear in the act dtype.
    ne = FP32 if attn.spec == "local" else e
    tokens = s * b
    # Norm: its input and normalised output; plus the linear's own copy of its (scaled) input.
    seq = 2 * (2 * h * ne + h * e)
    if m.sandwich_norm:
        seq += 2 * 2 * h * ne  # the two sublayer-output norms
    tensor = d * (a + 2 * g) * e  # QKV output (Q, K, V views)
    if m.qk_layernorm:
        tensor += (2 * a * d + g * d) * ne  # Q copy, normalised Q and K
    dropout = m.attention_dropout > 0
    # A dropout mask: CUDA's fused dropout keeps a bool mask; on the CPU torch multiplies by a noise tensor
    # of the input's dtype and keeps that.
    drop_mask = e if attn.cpu else 1
    if selective or attn.kernel == "flash":
        tensor += (d * (a + 2 * g) + a * d) * e  # Q, K, V into the kernel (or the recompute checkpoint), output
        softmax = mask = 0
    elif attn.kernel == "sdpa":
        # Q, K and V repeated to all heads (SDPAttention repeats for GQA), the output, a fp32 log-sum-exp
        tensor += 4 * a * d * e + a * FP32
        softmax = mask = 0
    elif attn.kernel == "sdpa-math":
        # torch's math fallback in fp32: copies of Q (scaled) and K, V (or its fp32 copy in bf16); per score
        # the softmax output, dropout's mask (a float tensor) and dropout's output, 4 bytes each
        tensor += 3 * a * d * FP32
        softmax, mask = a * s * 3 * FP32, 0
    else:
        tensor += 3 * a * d * e  # Q, K and V expanded to all heads (GQA) for the batched matmuls
        # Per score (a s^2 b of them), what megatron-core's DotProductAttention hands to backward: the
        # softmax's output, and the AV matmul's input in the act dtype (the same tensor where the dtypes
        # agree); with attention dropout, the matmul's input is dropout's output, and dropout keeps its mask.
        if attn.torch_softmax:  # torch's softmax, in fp32 (attention_softmax_in_fp32), then cast
            softmax_out, mask = FP32, s * s  # + the bool causal mask masked_fill keeps, built in every layer
        else:  # Megatron's fused causal softmax kernel: act-dtype output, masking inside the kernel
            softmax_out, mask = e, 0
        matmul_in = e if (dropout or e != softmax_out) else 0
        softmax = a * s * (softmax_out + matmul_in + (drop_mask if dropout else 0))
    tensor += a * d * e  # out-projection input
    dropout_mask = 2 * h * drop_mask if m.hidden_dropout > 0 else 0
    up = 2 if m.swiglu else 1
    # SwiGLU: gate+up output, silu output and the up half, fc2 input; GELU: fc1 output, fc2 input.
    mlp = (lambda f: up * f + (2 * f if m.swiglu else 0) + f)
    if m.num_experts:
        k, f = m.moe_router_topk, m.moe_ffn_hidden_size
        # Each routed copy of a token (≈ tokens x top-k land on each EP rank): its permuted input, the expert
        # MLP and the prob-weighted output.
        mlp_bytes = tokens * k * (h + (mlp(f) + f) / lay.etp) * e
        small = tokens * (m.num_experts * FP32 + 3 * k * 8)  # router scores and routing indices
        shared = getattr(m, "moe_shared_expert_intermediate_size", None)
        if shared:
            mlp_bytes += tokens * mlp(shared) / t * e
    else:
        mlp_bytes, small = tokens * mlp(m.ffn_hidden_size) / t * e, 0
    seq_bytes = tokens * seq / (t if lay.sp else 1)
    tensor_bytes = tokens * tensor / t + mlp_bytes
    rope = 4 * s * d * e if m.position_embedding_type == "rope" else 0  # cos/sin tables, b-independent
    scores = tokens * softmax / t + mask
    return {
        "total": seq_bytes + tensor_bytes + scores + tokens * dropout_mask + small + rope,
        "scores": scores,
        "input": tokens * h * e / (t if lay.sp else 1),  # what full recomputation keeps
    }


def stage_extra_activation_bytes(cfg, lay: Layout, stage: int, attn: Attention, on_cpu: bool) -> float:
    """Outside the layers: the final norm, LM-head input and fp32 logits on the last stage."""
    m = cfg.model
    tokens, e = m.seq_length * lay.micro_batch, 2 if cfg.training.bf16 else FP32
    ne = FP32 if attn.spec == "local" else e  # as in the layers' norms
    out = tokens * 8  # token ids
    if stage == lay.pp - 1:
        vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, lay.tp)
        out += tokens * m.hidden_size * (2 * ne + e) / (lay.tp if lay.sp else 1)
        # Megatron's vocab-parallel cross entropy keeps the softmax for backward: in fp32 (it upcasts the
        # logits), or in the logits' dtype with --cross-entropy-loss-fusion (on by default on CUDA).
        fused = m.cross_entropy_loss_fusion
        if fused is None:
            fused = not on_cpu
        out += tokens * vocab / lay.tp * (e if fused else FP32)
    return out


def activation_memory(cfg, lay: Layout, stage: int, attn: Attention, on_cpu: bool) -> dict:
    """Activation bytes on one rank of ``stage`` per recomputation mode, 1F1B micro-batches in flight."""
    in_flight = min(lay.pp - stage, lay.micro_batches)
    L = layers_on_stage(cfg, lay.pp)
    full_layer = layer_activation_bytes(cfg, lay, attn)
    sel_layer = layer_activation_bytes(cfg, lay, attn, selective=True)
    extra = stage_extra_activation_bytes(cfg, lay, stage, attn, on_cpu)
    m = cfg.model
    method = getattr(m, "recompute_method", None) or "uniform"
    n = max(1, min(getattr(m, "recompute_num_layers", None) or 1, L))
    # Saved between forward and backward, then the working set of the layers being recomputed in backward.
    if method == "block":
        saved = in_flight * (n * full_layer["input"] + (L - n) * full_layer["total"] + extra)
        working = full_layer["total"]
    else:  # uniform: the input of each group of n layers; one group's activations while it is recomputed
        saved = in_flight * (math.ceil(L / n) * full_layer["input"] + extra)
        working = n * full_layer["total"]
    return {
        "none": in_flight * (L * full_layer["total"] + extra),
        "selective": in_flight * (L * sel_layer["total"] + extra),
        "full": saved + working,
        "full_saved": saved,
        "in_flight_micro_batches": in_flight,
        "per_layer_none": full_layer["total"],
        "per_layer_scores": full_layer["scores"],  # the s x s part of per_layer_none (0 with flash)
    }


def configured_recompute(cfg) -> str:
    g = getattr(cfg.model, "recompute_granularity", None)
    return g if g in ("selective", "full") else "none"
