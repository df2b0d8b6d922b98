"""What the log line reports besides the loss: model FLOP/s per device and MFU, optimizer-step time,
peak memory, and MoE load balance.

FLOPs follow Megatron-LM's ``num_floating_point_operations`` (model FLOPs, not hardware FLOPs: activation
recomputation does not raise them; MoE counts the experts a token is routed to). MFU divides by the
device's dense bf16 peak from a table (CUDA) or, on CPU, by a matmul peak measured once at start-up in
the run's parameter dtype with the run's threads, all ranks at once (they share the cores).
"""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s per GPU, from the vendors' datasheets.
BF16_PEAK_TFLOPS = {
    "A100": 312.0,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "H200": 989.4,
    "GH200": 989.4,
    "GB200": 2500.0,
    "B200": 2250.0,
}


def model_flops_per_step(m, vocab: int, global_batch: int) -> float:
    """Forward+backward FLOPs of one optimizer step over ``global_batch`` sequences (Megatron-LM's formula:
    QKV/output projections with GQA, causal attention scores, (gated) MLP or routed+shared experts, LM head)."""
    h, s, L = m.hidden_size, m.seq_length, m.num_layers
    glu = 1.5 if m.swiglu else 1.0
    q_ratio = m.kv_channels * m.num_attention_heads / h
    attention = (1 + m.num_query_groups / m.num_attention_heads + s / h / 2) * q_ratio
    mlp = m.ffn_hidden_size / h * glu
    if m.num_experts:  # the routed and shared experts' share of the layers (--moe-layer-freq), dense MLPs the rest
        from megatron_md.models.presets import moe_layer_pattern

        moe = sum(moe_layer_pattern(m)) / L
        routed = m.moe_ffn_hidden_size / h * m.moe_router_topk * glu
        routed += (m.moe_shared_expert_intermediate_size or 0) / h * glu
        mlp = moe * routed + (1 - moe) * mlp
    logit = vocab / (2 * L * h)
    return 12.0 * global_batch * s * L * h * h * (attention + mlp + logit)


def peak_tflops_for_name(name: str) -> float | None:
    for key in sorted(BF16_PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100", "GB200" first
        if key in name:
            return BF16_PEAK_TFLOPS[key]
    return None


def device_peak_tflops(device: torch.device) -> tuple[float | None, str]:
    """The device's bf16 peak and where it came from; (None, why) for a GPU the table lacks."""
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops_for_name(name)
    return (peak, f"{name} bf16 datasheet") if peak else (None, f"no bf16 peak known for {name}")


def measure_cpu_peak_tflops(dtype: torch.dtype, n: int = 512, seconds: float = 0.3) -> float:
    """Best matmul rate of this process on its threads (one n x n x n GEMM per try), in TFLOP/s."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best, stop = float("inf"), time.perf_counter() + seconds
    tries = 0
    while tries < 3 or (time.perf_counter() < stop and tries < 50):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        tries += 1
    return 2.0 * n**3 / best / 1e12


def peak_tflops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """Per-device peak for MFU: the table on CUDA; on CPU measured now, concurrently on every rank (a
    collective: call it on all ranks) and averaged, so each rank's share of the shared cores is what counts."""
    if device.type == "cuda":
        return device_peak_tflops(device)
    if dist.is_initialized():
        dist.barrier()
    mine = torch.tensor([measure_cpu_peak_tflops(dtype)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(mine)
        mine /= dist.get_world_size()
    return float(mine), f"measured {str(dtype).removeprefix('torch.')} matmul at start-up"


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the allocator's peak of allocated bytes; CPU: the process's peak resident set (Linux KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class StepTimer:
    """Accumulates the time of a region run once per step. CUDA regions are timed with events read only
    when the interval is reported (no host sync per step); CPU regions with the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self.seconds = 0.0
        self.count = 0

    def __enter__(self):
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self._start, end))
        else:
            self.seconds += time.perf_counter() - self._start
        self.count += 1
        return False

    def take_ms(self) -> float | None:
        """Mean milliseconds per region since the last call (None if it never ran), then reset."""
        if self.pending:
            self.pending[-1][1].synchronize()
            self.seconds += sum(s.elapsed_time(e) for s, e in self.pending) / 1000.0
            self.pending.clear()
        mean = self.seconds / self.count * 1000.0 if self.count else None
        self.seconds, self.count = 0.0, 0
        return mean


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer during training forwards, from megatron's routers'
    routing maps; reports the spread max/mean and min/mean over experts (1.0 = perfectly even), the worst
    layer across the whole model."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.counts = {id(r): None for r in self.routers}
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, module, _inputs, outputs) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        routing_map = outputs[1]
        n = routing_map.sum(dim=0, dtype=torch.float64).detach()
        key = id(module)
        self.counts[key] = n if self.counts[key] is None else self.counts[key] + n

    def take(self, device: torch.device) -> tuple[float, float] | None:
        """(max/mean, min/mean) over experts, worst layer over the model; a collective over all ranks."""
        from megatron.core import parallel_state as ps

        worst = torch.tensor([0.0, -float("inf")], dtype=torch.float64, device=device)  # (max, -min)
        for r in self.routers:
            n = self.counts[id(r)]
            if n is None:
                continue
            n = n.to(device)
            dist.all_reduce(n, group=ps.get_data_parallel_group())  # every DP rank routed other tokens
            mean = n.mean().clamp_min(1e-12)
            worst[0] = torch.maximum(worst[0], n.max() / mean)
            worst[1] = torch.maximum(worst[1], -(n.min() / mean))
            self.counts[id(r)] = None
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if worst[0] == 0:
            return None
        return float(worst[0]), float(-worst[1])


def moe_loss_names(m) -> list[str]:
    """The names megatron's routers record their auxiliary losses under, for this model."""
    names = {"aux_loss": ["load_balancing_loss"], "seq_aux_loss": ["seq_load_balancing_loss"]}.get(
        m.moe_router_load_balancing_type, [])
    if m.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def take_moe_losses(m, iterations: int, micro_batches: int, iteration: int) -> dict[str, float]:
    """Mean per step of the MoE auxiliary losses the routers recorded since the last call (unscaled by their
    coefficients), averaged over MoE layers and data-parallel ranks; a collective over PP and DP."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    names = moe_loss_names(m)
    if not names or iterations == 0:
        return {}
    out: dict = {}
    get_moe_metrics_tracker().report(
        loss_scale=1.0 / (iterations * micro_batches), iteration=iteration, track_names=names,
        force_initialize=True, num_layers=m.num_layers, total_loss_dict=out,
    )
    return {f"moe_{k}": float(v) for k, v in out.items()}

