"""benchmarks/optimizer_state.py on tiny-dense: each DP2 rank holds at most 0.55x the DP1 MD state.

The bound is issue 14's: under the layer-wise distributed optimizer a rank keeps MD / Manifold-Muon
state (momentum or Adam moments, gains and their moments, duals) only for the matrices it owns.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank


def test_md_state_is_sharded_over_data_parallel(tmp_path):
    out = tmp_path / "optimizer_state.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/optimizer_state.py", "--model", "tiny-dense",
         "--optimizers", "muon_md,adam_md,manifold_muon", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name, row in result["results"].items():
        dp1 = row["dp1"]["md_state"]
        ranks = [r["md_state"] for r in row["dpn"]]
        assert dp1 > 0 and len(ranks) == 2, (name, row)
        assert max(ranks) <= 0.55 * dp1, (name, dp1, ranks)
        assert row["md_state_ratio"] == max(ranks) / dp1
        # every matrix is owned by exactly one rank
        assert sum(r["md_matrices"] for r in row["dpn"]) == row["dp1"]["md_matrices"], (name, row)
    table = out.with_suffix(".md").read_text()
    assert "| muon_md |" in table and "(met)" in table
