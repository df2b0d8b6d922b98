"""The throughput report's pieces: the model-FLOP formula against counted matmuls, peaks, timers, the log line."""

from __future__ import annotations

import torch

from megatron_md.training.observability import throughput as tp


def _counted_flops(preset: str, batch: int, seq: int) -> tuple[float, float, object]:
    """(matmul FLOPs torch counts for one forward+backward, the formula's FLOPs, the model config)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_md.models.builder import build_model
    from megatron_md.training.config import resolve

    # megatron's own attention: its QK^T and AV are matmuls the counter sees (SDPA's CPU kernel hides them)
    cfg = resolve(preset, None, {"seq_length": seq, "attention_backend": "local"})
    model = build_model(cfg, 4096, cpu=True)
    tokens = torch.randint(0, 4096, (batch, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        loss = model(tokens, torch.arange(seq).expand(batch, seq), None, labels=tokens).sum()
        loss.backward()
    return counter.get_total_flops(), tp.model_flops_per_step(cfg.model, 4096, batch), cfg.model


def test_flop_formula_is_every_matmul_but_the_masked_half_of_attention(mcore_world):
    counted, formula, m = _counted_flops("tiny-dense", 2, 64)
    # The model computes QK^T and AV whole (4 b s^2 a d per layer forward, x3 with backward); the formula, like
    # Megatron-LM's, counts the causal half.
    masked_half = 3 * 2 * 2 * 64 * 64 * m.num_attention_heads * m.kv_channels * m.num_layers
    assert counted == formula + masked_half, (counted, formula, masked_half)


def test_moe_flop_formula_counts_the_routed_experts(mcore_world):
    counted, formula, m = _counted_flops("tiny-moe", 2, 32)
    masked_half = 3 * 2 * 2 * 32 * 32 * m.num_attention_heads * m.kv_channels * m.num_layers
    router = 3 * 2 * 2 * 32 * m.hidden_size * m.num_experts * m.num_layers  # the gate's matmul, left out
    assert counted == formula + masked_half + router, (counted, formula)


def test_peak_table_and_cpu_measurement():
    assert tp.peak_tflops_for_name("NVIDIA H100 PCIe") == 756.0
    assert tp.peak_tflops_for_name("NVIDIA H100 80GB HBM3") == 989.4
    assert tp.peak_tflops_for_name("NVIDIA GB200") == 2500.0 and tp.peak_tflops_for_name("NVIDIA B200") == 2250.0
    assert tp.peak_tflops_for_name("Tesla T4") is None
    peak = tp.measure_cpu_peak_tflops(torch.float32, n=128, seconds=0.05)
    assert 1e-4 < peak < 100  # a real rate: one core does some GFLOP/s, no CPU does 100 TFLOP/s


def test_step_timer_means_and_resets():
    import time

    timer = tp.StepTimer(torch.device("cpu"))
    assert timer.take_ms() is None
    for _ in range(2):
        with timer:
            time.sleep(0.02)
    ms = timer.take_ms()
    assert 15 < ms < 200 and timer.take_ms() is None


def test_log_line_shows_the_report_fields():
    from megatron_md.training.observability.run_logging import fmt_log_line

    rec = dict(iteration=10, consumed_samples=160, iter_time_ms=12.5, tokens_per_s=1000.0, tflops_per_device=0.5,
               mfu=0.0123, optimizer_ms=3.25, peak_memory_gib=1.5, lr=1e-3, global_batch_size=16, lm_loss=2.0,
               moe_load_balancing_loss=1.1, moe_z_loss=0.5, moe_expert_load_max=1.4, moe_expert_load_min=0.6,
               grad_norm=1.0, skipped=0, nan=0)
    line = fmt_log_line(rec, 100)
    for text in ("TFLOP/s per device: 0.5", "MFU: 1.23%", "optimizer (ms): 3.2", "peak memory (GiB): 1.50",
                 "load balancing loss: 1.100000E+00", "z loss: 5.000000E-01", "expert load max/min vs mean: 1.40/0.60"):
        assert text in line, text
    plain = fmt_log_line(dict(rec, mfu=None, moe_load_balancing_loss=None, moe_z_loss=None, moe_expert_load_max=None),
                         100)
    assert "MFU" not in plain and "load balancing" not in plain
