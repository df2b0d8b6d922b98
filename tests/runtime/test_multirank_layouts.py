"""Parallel layouts on the CPU runtime: ONE 2-rank torchrun (gloo) running _layout_probe.py.

The probe checks, in one launch: dense forward/backward at TP=1 and TP=2, PP=2 through
get_forward_backward_func, EP=2 MoE (4 experts, top-2) with the allgather and alltoall
dispatchers, and megatron's muon at TP=2 in 'duplicated' mode. Each part prints a PROBE JSON line.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def probe():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--standalone", str(HERE / "_layout_probe.py"),  # its rendezvous binds port 0: no port can collide
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    parts = {}
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            rec = json.loads(line[len("PROBE ") :])
            parts[rec["part"]] = rec
    tail = f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    assert out.returncode == 0 and parts, f"torchrun failed:\n{tail}"
    return parts


def _ok(parts, name):
    rec = parts.get(name)
    assert rec is not None, f"probe part {name} did not report"
    assert rec["ok"], f"{name}: {rec.get('error')}\n{rec.get('tb')}"
    return rec


def _decreasing(losses):
    return all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@pytest.mark.multirank
def test_dense_tp2_matches_tp1(probe):
    tp1, tp2 = _ok(probe, "dense_tp1"), _ok(probe, "dense_tp2")
    assert tp2["tp_world"] == 2 and tp2["fc1_local_rows"] * 2 == tp1["fc1_local_rows"]
    assert tp1["grad_finite"] and tp2["grad_finite"]
    assert math.isclose(tp1["loss"], tp2["loss"], rel_tol=1e-5), (tp1["loss"], tp2["loss"])


@pytest.mark.multirank
def test_pp2_forward_backward_func(probe):
    rec = _ok(probe, "pp2")
    assert rec["pp_world"] == 2 and _decreasing(rec["losses"]), rec


@pytest.mark.multirank
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_moe_ep2(probe, dispatcher):
    rec = _ok(probe, f"moe_ep2_{dispatcher}")
    assert rec["ep_world"] == 2 and rec["local_experts"] == 2
    assert _decreasing(rec["losses"]), rec


@pytest.mark.multirank
def test_moe_alltoall_matches_allgather(probe):
    a, b = _ok(probe, "moe_ep2_allgather"), _ok(probe, "moe_ep2_alltoall")
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a["losses"], b["losses"]))


@pytest.mark.multirank
def test_muon_tp2_duplicated(probe):
    rec = _ok(probe, "muon_tp2_duplicated")
    assert any("Muon" in name for name in rec["inner"]), rec["inner"]
    assert _decreasing(rec["losses"]), rec
