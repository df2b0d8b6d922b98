"""``megatron-md plan``'s costs and report: FLOPs and communication of one step, the fit verdict, the table.

Memory and activations: ``plan.py``. All per-device numbers are for the worst pipeline stage.
"""

from __future__ import annotations

import re

from megatron_md.models.builder import padded_vocab_size
from megatron_md.models.presets import count_parameters
from megatron_md.optim.policy import MANIFOLD_GEOMETRIES, make_policy
from megatron_md.parallel.orthogonalize import msign_flops
from megatron_md.training import plan as P
from megatron_md.training.throughput import model_flops_per_step

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """'80GB' (10^9), '141GiB' (2^30), '8e10' -> bytes; ValueError naming ``flag`` otherwise."""
    mt = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = mt.group(2).upper() if mt else None
    if not mt or unit not in _UNITS or float(mt.group(1)) <= 0:
        raise ValueError(f"{flag} {text!r}: expected a positive size like 80GB, 141GiB or 96e9 "
                         f"(units: {', '.join(u for u in _UNITS if u)})")
    return int(float(mt.group(1)) * _UNITS[unit])


def human_bytes(n: float) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def human_flops(n: float) -> str:
    for unit, div in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} FLOP"


# ------------------------------------------------------------------------------------------------ FLOPs


def model_flops(cfg, global_batch: int, tp: int = 1) -> float:
    """The trainer's Megatron-LM FLOP formula (``throughput.model_flops_per_step``, what MFU is logged
    against) at the padded vocabulary the run builds."""
    m = cfg.model
    return model_flops_per_step(m, padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp), global_batch)


def optimizer_ns_flops(cfg) -> float:
    """Newton–Schulz FLOPs of one optimizer step over the whole model (msign_flops per orthogonalised block)."""
    o, m = cfg.optimizer, cfg.model
    if o.optimizer in ("adam", "adam_md", "lion_md", "soap_md"):  # no Newton-Schulz in their hidden matrices
        return 0.0
    h, f = m.hidden_size, m.ffn_hidden_size
    qkv = [(r, h) for r in P.qkv_rows(cfg)]
    fc1 = [(2 * f, h)] if m.swiglu else [(f, h)]
    shapes = {"attention.qkv": qkv, "attention.proj": [(h, m.num_attention_heads * m.kv_channels)]}
    if m.num_experts:
        fe = m.moe_ffn_hidden_size
        shapes["experts.fc1"] = [((2 if m.swiglu else 1) * fe, h)] * m.num_experts
        shapes["experts.fc2"] = [(h, fe)] * m.num_experts
        shapes["router"] = [(m.num_experts, h)]
        shared = getattr(m, "moe_shared_expert_intermediate_size", None)
        if shared:
            shapes["experts.fc1"] = shapes["experts.fc1"] + [((2 if m.swiglu else 1) * shared, h)]
            shapes["experts.fc2"] = shapes["experts.fc2"] + [(h, shared)]
    else:
        shapes["mlp.fc1"], shapes["mlp.fc2"] = fc1, [(h, f)]
    total = 0.0
    if o.optimizer in ("muon", "muon_md"):
        for role, blocks in shapes.items():
            if o.optimizer == "muon" and role == "attention.qkv":
                blocks = [(sum(r for r, _ in blocks), h)]  # megatron Muon: the fused matrix
            total += sum(msign_flops(r, c, o.muon_num_ns_steps) for r, c in blocks)
    elif o.optimizer == "manifold_muon":
        policy = make_policy(o.geometry)
        fast = o.manifold_mode == "fast"
        steps = o.manifold_fast_msign_steps if fast else o.manifold_msign_steps
        calls = (o.manifold_fast_dual_steps if fast else o.manifold_dual_steps) + 1
        for role, blocks in shapes.items():
            asg = policy.assign(role)
            if asg.geometry in MANIFOLD_GEOMETRIES:
                if role == "attention.qkv" and not o.manifold_split_qkv:
                    blocks = [(sum(r for r, _ in blocks), h)]
                total += calls * sum(msign_flops(r, c, steps) for r, c in blocks)
            elif asg.base == "muon":
                total += sum(msign_flops(r, c, o.muon_num_ns_steps) for r, c in blocks)
    return m.num_layers * total


# ------------------------------------------------------------------------------------------------ communication


def communication(cfg, lay: P.Layout, static: dict) -> dict:
    """Bytes one rank sends per step (ring collectives: an all-reduce of X sends 2(n-1)/n X)."""
    m = cfg.model
    e = 2 if cfg.training.bf16 else P.FP32
    mb, L = lay.micro_batches, P.layers_on_stage(cfg, lay.pp)
    act = m.seq_length * lay.micro_batch * m.hidden_size * e  # one micro-batch's hidden states
    ring = lambda n: (n - 1) / n  # noqa: E731
    # DP: the fp32 grad buffers all-reduced, or reduce-scattered plus the param buffers all-gathered; dense
    # params over the data-parallel group, expert params over the (smaller) expert-data-parallel group.
    n_expert = static["expert_param_count"]
    n_dense = static["param_count"] - n_expert
    grads = ring(lay.dp) * P.FP32 * n_dense + ring(lay.edp) * P.FP32 * n_expert
    params = ring(lay.dp) * e * n_dense + ring(lay.edp) * e * n_expert
    out = {}
    if lay.distopt:
        out["dp_grad_reduce_scatter"] = grads
        out["dp_param_all_gather"] = params
    else:
        out["dp_grad_all_reduce"] = 2 * grads
    # TP: per layer two all-reduces forward and two backward (or all-gather + reduce-scatter pairs under SP:
    # the same bytes), plus the embedding's and the LM head's.
    out["tp_activations"] = (4 * L + 2) * 2 * ring(lay.tp) * act * mb
    if m.num_experts:
        # Dispatch and combine all-to-all, forward and backward, of every routed token copy.
        out["ep_all_to_all"] = 4 * L * ring(lay.ep) * act * m.moe_router_topk * mb / (lay.tp if lay.sp else 1)
    else:
        out["ep_all_to_all"] = 0.0
    # PP: activations forward and their gradients backward across each stage boundary.
    out["pp_send_recv"] = (2 * act * mb / (lay.tp if lay.sp else 1)) if lay.pp > 1 else 0.0
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------------------------------ the plan


def make_plan(cfg, world: int, device_memory: int | None = None, attention: str = "auto") -> dict:
    lay = P.layout_of(cfg, world)
    kind = P.attention_kind(cfg, attention)
    stages = sorted({0, lay.pp - 1})
    worst, per_stage = None, {}
    for stage in stages:
        st = P.static_memory(cfg, lay, stage)
        act = P.activation_memory(cfg, lay, stage, kind)
        static_total = st["params"] + st["grads"] + st["master_weights"] + st["optimizer_state"]
        per_stage[stage] = {"static_total": static_total, "activations": {m: act[m] for m in P.RECOMPUTE_MODES},
                            "in_flight_micro_batches": act["in_flight_micro_batches"]}
        cand = (stage, st, act, static_total)
        if worst is None or static_total + act["none"] > worst[3] + worst[2]["none"]:
            worst = cand
    stage, st, act, static_total = worst
    recompute = P.configured_recompute(cfg)
    totals = {mode: static_total + act[mode] for mode in P.RECOMPUTE_MODES}
    model_total = model_flops(cfg, lay.global_batch, lay.tp)
    ns_total = optimizer_ns_flops(cfg)
    # Newton–Schulz runs once per matrix in its TP group (layer_sharded) and once per DP owner under the
    # layer-wise optimizer; without it every DP replica repeats its model shard's work.
    ns_share = lay.world if lay.distopt else lay.tp * lay.pp * (lay.ep if cfg.model.num_experts else 1)
    n = count_parameters(cfg.model)
    out = {
        "model": cfg.preset, "optimizer": cfg.optimizer.optimizer,
        "precision": "bf16" if cfg.training.bf16 else "fp32",
        "layout": {"world": lay.world, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "expert_tp": lay.etp,
                   "dp": lay.dp, "expert_dp": lay.edp, "sequence_parallel": lay.sp,
                   "distributed_optimizer": lay.distopt, "micro_batch": lay.micro_batch,
                   "global_batch": lay.global_batch, "micro_batches": lay.micro_batches,
                   "seq_length": cfg.model.seq_length, "attention": kind},
        "parameters": {"total": n.total, "active": n.active,
                       "padded_vocab": padded_vocab_size(cfg.model.vocab_size,
                                                         cfg.model.make_vocab_size_divisible_by, lay.tp)},
        "per_device": {
            "stage": stage, "param_count": st["param_count"], "expert_param_count": st["expert_param_count"],
            "params": st["params"], "grads": st["grads"],
            "master_weights": st["master_weights"], "optimizer_state": st["optimizer_state"],
            "optimizer_state_by_kind": st["optimizer_state_by_kind"], "static_total": static_total,
            "activations": {m: act[m] for m in P.RECOMPUTE_MODES},
            "activations_full_saved": act["full_saved"],  # full recompute before backward's working set
            "in_flight_micro_batches": act["in_flight_micro_batches"],
            "total": totals, "recompute": recompute,
        },
        "pipeline_stages": per_stage,  # first and last (the middle ones hold less than the first)
        "flops_per_step": {"model": model_total, "model_per_device": model_total / lay.world,
                           "optimizer_newton_schulz": ns_total,
                           "optimizer_newton_schulz_per_device": ns_total / ns_share},
        "communication_per_device": communication(cfg, lay, st),
    }
    if device_memory is not None:
        out["device_memory"] = device_memory
        out["fits"] = {mode: totals[mode] <= device_memory for mode in P.RECOMPUTE_MODES}
    return out


def format_plan(plan: dict) -> str:
    lay, dev = plan["layout"], plan["per_device"]
    lines = [
        f"megatron-md plan: {plan['model']}  {plan['optimizer']}  {plan['precision']}  "
        f"({plan['parameters']['total']:,} params, {plan['parameters']['active']:,} active)",
        f"layout: world {lay['world']} = TP{lay['tp']} x PP{lay['pp']} x DP{lay['dp']}"
        + (f"  (EP{lay['ep']} x expert-TP{lay['expert_tp']} x expert-DP{lay['expert_dp']})" if lay["ep"] > 1 else "")
        + f"  SP {'on' if lay['sequence_parallel'] else 'off'}  distributed optimizer "
        f"{'on' if lay['distributed_optimizer'] else 'off'}",
        f"batch: micro {lay['micro_batch']} x seq {lay['seq_length']}, global {lay['global_batch']} "
        f"({lay['micro_batches']} micro-batches per DP rank), {lay['attention']} attention",
        "",
        f"per device (pipeline stage {dev['stage']}, {dev['param_count']:,} params)",
    ]
    rows = [("parameters", dev["params"]), ("gradients (fp32 buffers)", dev["grads"]),
            ("fp32 master weights", dev["master_weights"])]
    rows += [(f"optimizer: {k.replace('_', ' ')}", v) for k, v in dev["optimizer_state_by_kind"].items() if v]
    rows += [("static total", dev["static_total"])]
    for mode in P.RECOMPUTE_MODES:
        mark = "  <- configured" if mode == dev["recompute"] else ""
        rows.append((f"activations, recompute {mode}{mark}", dev["activations"][mode]))
    for mode in P.RECOMPUTE_MODES:
        verdict = ""
        if "fits" in plan:
            verdict = "  fits" if plan["fits"][mode] else "  DOES NOT FIT"
        rows.append((f"total, recompute {mode}", dev["total"][mode], verdict))
    width = max(len(r[0]) for r in rows)
    for r in rows:
        lines.append(f"  {r[0].ljust(width)}  {human_bytes(r[1]):>12}{r[2] if len(r) > 2 else ''}")
    if "device_memory" in plan:
        lines.append(f"  {'device memory'.ljust(width)}  {human_bytes(plan['device_memory']):>12}")
    fl = plan["flops_per_step"]
    lines += ["", "FLOPs per step",
              f"  model (Megatron-LM formula)      {human_flops(fl['model']):>14}  "
              f"({human_flops(fl['model_per_device'])} per device)",
              f"  optimizer Newton–Schulz          {human_flops(fl['optimizer_newton_schulz']):>14}  "
              f"({human_flops(fl['optimizer_newton_schulz_per_device'])} per device)",
              "", "communication per device per step (bytes sent)"]
    for k, v in plan["communication_per_device"].items():
        if v or k == "total":
            lines.append(f"  {k.replace('_', ' ').ljust(24)} {human_bytes(v):>12}")
    lines += ["", "(not counted: CUDA context, allocator fragmentation, temporary buffers of the optimizer "
              "step; keep a few GiB free)"]
    return "\n".join(lines)
