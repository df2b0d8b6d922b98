"""benchmarks/ns_engine.py: the counting pieces, one cheap section end to end, and its docs table.

No timing thresholds: the committed results carry the measured figures; here only that each figure is
computed from what the run counted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]


def _load(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load("benchmarks/ns_engine.py", "ns_engine_bench")
render = _load("tools/render_readme_tables.py", "render_readme_tables")


def test_comm_counter_counts_payload_and_undoes(tmp_path):
    from comm_counter import CommCounter  # benchmarks/ is on sys.path once the benchmark is loaded

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        orig = dist.all_reduce
        with CommCounter() as c:
            dist.all_reduce(torch.ones(10))
            out = torch.empty(6)
            dist.all_to_all_single(out, torch.ones(6), [6], [6])  # to itself: no payload
            dist.all_gather_into_tensor(torch.empty(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
        assert dist.all_reduce is orig
        s = c.summary()
        assert s["by_op"]["all_reduce"] == [1, 40]
        assert s["by_op"]["all_to_all_single"] == [1, 0]
        assert s["by_op"]["all_gather_into_tensor"] == [1, 32]
        assert s["bytes"] == 72 and s["calls"] == 3
    finally:
        dist.destroy_process_group()


def test_verdicts_follow_the_figures():
    sections = {
        "tp2_time": {"ratios": {"muon_md/muon_md_duplicated": 0.59, "muon_md/muon_duplicated": 0.8}},
        "flops": {"rows": {"TP2": {"sum_over_analytic": 1.004, "max_over_mean": 1.2}}},
        "comm": {"ratio": {"muon_md/adam": 1.1}},
        "ns_rate": {"min_fraction": 0.69},
    }
    v = bench.verdicts(sections)
    assert v["tp2 muon_md/muon_md_duplicated"]["met"] and not v["tp2 muon_md/muon_duplicated"]["met"]
    assert v["flops TP2 sum/analytic"]["met"] and not v["flops TP2 max/mean"]["met"]
    assert v["comm muon_md/adam"]["met"] and not v["ns_rate min fraction of GEMM"]["met"]


@pytest.mark.multirank
def test_moe64_section_counts_one_call_per_bucket(tmp_path):
    out = tmp_path / "ns.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ns_engine.py"), "--sections", "moe64",
                           "--steps", "1", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    m = r["sections"]["moe64"]
    batched, single = m["engine"]["batched"], m["engine"]["per_matrix"]
    assert batched["matrices"] == single["matrices"] == single["ns_calls"] > 64  # 64 experts x 2 layers x 2 + dense
    assert batched["ns_calls"] == batched["buckets"] < 10
    assert m["calls_equal_buckets"] and r["verdicts"]["moe64 calls == buckets"]["met"]
    assert m["ratio"]["batched/per_matrix"] == pytest.approx(m["median_step_s"]["batched"] / m["median_step_s"]["per_matrix"])
    assert out.with_suffix(".md").read_text().strip() == render.ns_engine_markdown(r)


def test_committed_results_render_and_are_consistent():
    path = REPO / "benchmarks" / "results" / "ns_engine_cpu.json"
    if not path.exists():
        pytest.skip("no committed ns_engine results")
    r = json.loads(path.read_text())
    assert r["verdicts"] == bench.verdicts(r["sections"])
    for label, row in r["sections"].get("flops", {}).get("rows", {}).items():
        assert row["sum_over_analytic"] == pytest.approx(sum(row["flops_per_rank"]) / row["analytic_flops"])
    assert render.ns_engine_markdown(r).startswith("Orthogonalisation engine on CPU")
