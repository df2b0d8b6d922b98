"""benchmarks/gpu_bench_sections.py without a GPU: the profile summary on made-up events, the retraction
micro-benchmark on CPU, and the plan's prediction for a training command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_bench_sections as S  # noqa: E402


def _ev(name, on_gpu, a, b):
    return S._Event(name, on_gpu, a, b)


def test_profile_summary_counts_inside_the_steps_only():
    events = [
        _ev(S.STEP_RANGE, False, 0, 100), _ev(S.STEP_RANGE, False, 200, 300),
        _ev("cudaLaunchKernel", False, 10, 11), _ev("cudaLaunchKernel", False, 210, 211),
        _ev("cudaLaunchKernel", False, 150, 151),  # between the steps: not counted
        _ev("cudaStreamSynchronize", False, 50, 60), _ev("cudaMemcpy", False, 250, 260),
        _ev("cudaDeviceSynchronize", False, 310, 400),  # the pass's closing sync: outside
        _ev("void gemm_kernel", True, 20, 70), _ev("void add_kernel", True, 60, 90),  # overlap: busy 70
        _ev("Memcpy DtoH (Device -> Pageable)", True, 240, 250), _ev("void k", True, 280, 320),
    ]
    p = S.profile_summary(events, steps=2)
    assert p["launches"] == 2 and p["launches_per_step"] == 1.0 and p["gpu_kernels"] == 3
    assert p["syncs"] == 2 and p["sync_calls"]["cudaStreamSynchronize"] == 1 and p["memcpy_dtoh"] == 1
    assert p["window_ms"] == pytest.approx(0.320) and p["gpu_busy_ms"] == pytest.approx(0.120)
    assert p["gpu_busy_fraction"] == pytest.approx(120 / 320)
    with pytest.raises(ValueError, match="no 'gpu_bench/optimizer_step' range"):
        S.profile_summary(events[2:], steps=2)


def test_profile_pass_on_cpu_runs():
    import torch

    x = torch.ones(8)
    p = S.profile_optimizer_steps(lambda: x.mul_(1.0), steps=2, cuda=False)
    assert p["steps"] == 2 and p["launches"] == 0 and p["gpu_busy_fraction"] == 0.0 and p["wall_ms"] > 0


def test_retraction_candidates_and_worker_on_cpu():
    names = [n for n, _ in S.retraction_candidates()]
    assert any(n.startswith("eigh_fp64") for n in names)
    r = S.worker_retraction({"device": "cpu", "shapes": [[2, 32, 8]], "reps": 1})
    assert r["status"] == "ok" and len(r["rows"]) == len(names)
    exact = next(x for x in r["rows"] if x["name"].startswith("eigh_fp64"))
    assert exact["status"] == "ok" and exact["off_gram_rel"] < 1e-6 and exact["diff_to_exact_rel"] == 0.0


def test_planned_memory_for_a_train_command():
    p = S.planned_memory(["--model", "tiny-moe", "--optimizer", "muon_md", "--device", "cuda", "--bf16",
                          "--seq-length", "64", "--micro-batch-size", "1", "--transformer-impl", "local"])
    assert p["recompute"] == "none" and p["predicted_gib"] == p["total_gib"]["none"] > p["static_gib"] > 0
