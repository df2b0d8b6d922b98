"""``megatron-md plan``'s costs and report: FLOPs and communication of one step, the fit verdict, the table.

Memory and activations: ``memory.py``. All per-device numbers are for the worst pipeline stage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_md.mcore.families import family_of
from megatron_md.models.builder import padded_vocab_size
from megatron_md.models.presets import count_parameters
from megatron_md.parallel.orthogonalize import msign_flops
from megatron_md.training.planning import memory as P
from megatron_md.training.observability.throughput import model_flops_per_step

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
MIB = 2**20


@dataclass(frozen=True)
class Device:
    """A device and the memory it reports to CUDA (``torch.cuda.get_device_properties(0).total_memory``),
    or, where no such reading was found, nvidia-smi's total (CUDA's figure is 400-600 MiB lower on the
    cards where both were seen)."""

    name: str
    mib: int
    source: str  # "cuda" or "nvidia-smi"
    note: str
    aliases: tuple = ()

    @property
    def memory(self) -> int:
        return self.mib * MIB


# Readings of public logs (torch's _CudaDeviceProperties repr, nvidia-smi), not of this project's machines;
# CUDA's total varies by a few MiB with the driver. The smallest reading seen is listed.
DEVICES = (
    Device("H100-80GB", 81082, "cuda", "H100 SXM 80GB HBM3: CUDA 81,082-81,090 MiB seen; nvidia-smi 81,559 MiB",
           ("H100", "H100-SXM", "H100-SXM5", "H100-80GB-HBM3")),
    Device("H100-PCIe", 81008, "cuda", "H100 PCIe 80GB", ("H100-PCIE-80GB",)),
    Device("H100-NVL", 95830, "nvidia-smi", "H100 NVL 94GB (nvidia-smi's total; CUDA's not seen)", ("H100-94GB",)),
    Device("H200", 143156, "cuda", "H200 SXM 141GB: CUDA 143,156 MiB seen; nvidia-smi 143,771 MiB",
           ("H200-141GB", "H200-SXM")),
    Device("GH200", 97871, "nvidia-smi", "GH200 480GB, its 96 GB HBM3 (nvidia-smi's total; CUDA's not seen)",
           ("GH200-96GB", "GH200-480GB")),
    Device("H20", 97285, "cuda", "H20 96GB"),
    Device("B200", 182631, "cuda", "B200: CUDA 182,631-182,642 MiB seen"),
    Device("A100-80GB", 81049, "cuda", "A100 80GB (seen on the PCIe card); nvidia-smi 81,920 MiB",
           ("A100-SXM4-80GB", "A100-PCIE-80GB")),
    Device("A100-40GB", 40536, "cuda", "A100 SXM4 40GB; nvidia-smi 40,960 MiB", ("A100-SXM4-40GB",)),
    Device("A100-PCIe-40GB", 40326, "cuda", "A100 PCIe 40GB"),
    Device("L40S", 45589, "cuda", "L40S 48GB"),
)
CPU = "cpu"


def _key(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip()).upper()


def find_device(name: str) -> Device | None:
    k = _key(name)
    return next((d for d in DEVICES if k in {_key(d.name), *map(_key, d.aliases)}), None)


def device_names() -> str:
    return ", ".join(d.name for d in DEVICES) + ", cpu"


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """'80GiB' (2^30), '81559MiB', '80GB' (10^9) -> bytes. A size needs its unit: a bare number is refused,
    naming ``flag``, since '80' would otherwise be 80 bytes."""
    mt = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if mt and not mt.group(2) and float(mt.group(1)) > 0:
        raise ValueError(f"{flag} {text}: give a unit ({text}GiB; {text}GB is {text}·10^9 bytes; or MiB as CUDA "
                         f"reports them, e.g. 81082MiB for an H100 80GB) or a device name (--device H100-80GB; "
                         f"`megatron-md plan --list-devices`)")
    unit = mt.group(2).upper() if mt else None
    if not mt or unit not in _UNITS or float(mt.group(1)) <= 0:
        raise ValueError(f"{flag} {text!r}: expected a positive size with a unit, like 79GiB, 81082MiB or 80GB "
                         f"(units: B, KB, MB, GB, TB (10^3-based), KiB, MiB, GiB, TiB (2^10-based)), "
                         f"or a device name (--device H100-80GB)")
    return int(float(mt.group(1)) * _UNITS[unit])


def parse_headroom(text) -> float:
    """'5%' or '0.05' -> 0.05."""
    t = str(text).strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        v = -1.0
    if not 0 <= v < 1:
        raise ValueError(f"--headroom {text!r}: expected a fraction of device memory, like 5% or 0.05")
    return v


def resolve_target(name: str | None, memory: str | int | None, memory_flag: str = "--device-memory",
                   name_flag: str = "--device") -> dict | None:
    """The device the plan checks against, from a device name and/or a memory size (a size beats the name's
    memory; a device name given as the memory is that device). None when neither is given."""
    dev = None
    if isinstance(memory, str) and find_device(memory):
        name, memory = memory, None
    if name is not None:
        dev = CPU if _key(name) == "CPU" else find_device(name)
        if dev is None:
            raise ValueError(f"{name_flag} {name!r}: unknown device; known: {device_names()} (names are "
                             "case-insensitive), or give its memory with --device-memory (e.g. 79GiB)")
    if dev == CPU and memory is None:
        raise ValueError(f"{name_flag} cpu: give the memory of one rank with --device-memory (e.g. 4GiB)")
    if dev is None and memory is None:
        return None
    out = {"name": CPU if dev == CPU else (dev.name if dev else None)}
    if memory is not None:
        out.update(memory=memory if isinstance(memory, int) else parse_bytes(memory, memory_flag), source="given")
    else:
        out.update(memory=dev.memory, source=dev.source, note=dev.note)
    return out


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
    m = cfg.model
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
    family, total = family_of(cfg), 0.0
    for role, blocks in shapes.items():
        work = family.ns_work(cfg, role)
        if work is None:
            continue
        calls, steps, fused_qkv = work
        if role == "attention.qkv" and fused_qkv:
            blocks = [(sum(r for r, _ in blocks), h)]  # one msign on the fused QKV matrix
        total += calls * sum(msign_flops(r, c, steps) for r, c in blocks)
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


DEFAULT_HEADROOM = 0.05


def make_plan(cfg, world: int, target: dict | int | None = None, headroom: float = DEFAULT_HEADROOM) -> dict:
    """The plan of ``cfg`` on ``world`` devices; with ``target`` (``resolve_target``'s dict, or a byte count)
    the fit verdict: a mode fits when its total leaves at least ``headroom`` of the device's memory spare (for
    the CUDA context, NCCL's buffers, allocator fragmentation and the optimizer step's temporaries, which the
    plan does not count)."""
    if isinstance(target, int):
        target = {"name": None, "memory": target, "source": "given"}
    if cfg.model.num_experts and str(cfg.model.moe_layer_freq).strip() != "1":
        raise ValueError(f"--moe-layer-freq {cfg.model.moe_layer_freq}: the plan counts every layer as an MoE layer "
                         "and does not yet size models with dense layers; plan it with --moe-layer-freq 1 (an upper "
                         "bound on the MLP memory)")
    lay = P.layout_of(cfg, world)
    on_cpu = cfg.training.device == "cpu" or (target is not None and target.get("name") == "cpu")
    if target is not None and target.get("name") == "cpu" and cfg.training.device == "cuda":
        raise ValueError("--device cuda with a CPU target (target_device: cpu): the plan cannot be both")
    attn = P.attention_for(cfg, on_cpu, lay.micro_batch, lay.tp)
    stages = sorted({0, lay.pp - 1})
    worst, per_stage = None, {}
    for stage in stages:
        st = P.static_memory(cfg, lay, stage)
        act = P.activation_memory(cfg, lay, stage, attn, on_cpu)
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
                   "seq_length": cfg.model.seq_length, "attention": attn.kernel},
        "attention": {"kernel": attn.kernel, "layer_spec": attn.spec, "why": attn.why,
                      "counts": P.ATTENTION_KERNELS[attn.kernel],
                      "scores_per_layer": act["per_layer_scores"]},
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
    if target is not None:
        mem = target["memory"]
        out["device"] = {**target, "on_cpu": on_cpu}
        out["device_memory"] = mem
        out["headroom"] = headroom
        out["fits"] = {mode: totals[mode] <= mem * (1 - headroom) for mode in P.RECOMPUTE_MODES}
        out["spare"] = {mode: mem - totals[mode] for mode in P.RECOMPUTE_MODES}
        out["spare_fraction"] = {mode: 1 - totals[mode] / mem for mode in P.RECOMPUTE_MODES}
    return out


def verdict(plan: dict, mode: str) -> str:
    """'fits, 4.33 GiB (5.5%) spare' / 'TIGHT: ...' / 'DOES NOT FIT: ... over' for one recompute mode."""
    spare, frac, head = plan["spare"][mode], plan["spare_fraction"][mode], plan["headroom"]
    if plan["fits"][mode]:
        return f"fits, {human_bytes(spare)} ({frac:.1%}) spare"
    if spare >= 0:
        return f"TIGHT: {human_bytes(spare)} ({frac:.1%}) spare, under the {head:.0%} headroom"
    return f"DOES NOT FIT: {human_bytes(-spare)} over"


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
        f"({lay['micro_batches']} micro-batches per DP rank)",
        f"attention: {plan['attention']['kernel']} ({plan['attention']['why']})",
        f"  its activations: {plan['attention']['counts']}"
        + (f"; {human_bytes(plan['attention']['scores_per_layer'])} a layer per micro-batch"
           if plan["attention"]["scores_per_layer"] else ""),
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
        rows.append((f"total, recompute {mode}", dev["total"][mode],
                     f"  {verdict(plan, mode)}" if "fits" in plan else ""))
    width = max(len(r[0]) for r in rows)
    for r in rows:
        lines.append(f"  {r[0].ljust(width)}  {human_bytes(r[1]):>12}{r[2] if len(r) > 2 else ''}")
    if "device" in plan:
        d = plan["device"]
        what = {"cuda": "as CUDA reports it", "nvidia-smi": "nvidia-smi's total; CUDA's is lower",
                "given": "as given"}[d["source"]]
        name = f"{d['name']}, " if d.get("name") else ""
        mib = f"{plan['device_memory'] / 2**20:,.0f} MiB"
        mem = human_bytes(plan["device_memory"]) if d["source"] == "given" else mib
        lines.append(f"  {'device memory'.ljust(width)}  {human_bytes(plan['device_memory']):>12}  "
                     f"({name}{mem} {what}; a mode fits with {plan['headroom']:.0%} of it spare)")
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
    lines += ["", "(not counted: CUDA context, NCCL buffers, allocator fragmentation, temporary buffers of the "
              "optimizer step: what --headroom keeps free)"]
    return "\n".join(lines)
