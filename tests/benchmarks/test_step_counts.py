"""benchmarks/step_counts.py: the counter on toy steps (it can fail), one real count at a tiny width, the targets'
verdicts, and the docs block rendered from results (no timing anywhere)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sys.path.insert(0, str(REPO / "benchmarks"))
counts = _load("benchmarks/step_counts.py", "step_counts_bench")
render = _load("tools/render_readme_tables.py", "render_readme_tables")


# ----------------------------------------------------------------------------- the counter

def test_item_in_a_toy_step_is_one_sync():
    x = torch.ones(4)
    with counts.OpCounter() as c:
        y = x * 2.0
        y.view(2, 2).t()  # views: not counted
        total = float(y.sum().item())
    assert total == 8.0
    s = c.summary()
    assert s["syncs"] == 1 and s["local_scalar_dense"] == 1
    assert s["ops"] == 3  # mul, sum, _local_scalar_dense
    assert s["views_skipped"] >= 2 and s["dynamic_shape"] == 0


def test_foreach_counts_once_and_dynamic_shapes_apart():
    ts = [torch.ones(3) for _ in range(5)]
    with counts.OpCounter() as c:
        torch._foreach_add_(ts, 1.0)
        torch.nonzero(ts[0])
        if bool(ts[0].sum() > 0):  # bool(tensor): a sync
            pass
    s = c.summary()
    assert c.ops["aten._foreach_add_.Scalar"] == 1
    assert s["dynamic_shape"] == 1 and s["syncs"] == 1


def test_host_reads_count_as_syncs_and_are_restored():
    original = torch.Tensor.tolist
    with counts.OpCounter() as c:
        torch.arange(3).tolist()
        torch.zeros(2).cpu()
    assert c.summary()["host_reads"] == 2 and c.summary()["syncs"] == 2
    assert torch.Tensor.tolist is original


def test_profiler_annotations_are_not_ops():
    with counts.OpCounter() as c:
        with torch.profiler.record_function("annotation"):
            torch.ones(2).add_(1.0)
    assert c.summary()["annotations_skipped"] >= 1
    assert all(not k.startswith("profiler.") for k in c.ops)


def test_no_step_no_counts():
    with counts.OpCounter() as c:
        pass
    assert c.summary()["ops"] == 0 and c.summary()["syncs"] == 0


# ----------------------------------------------------------------------------- targets

def _row(ops, syncs, dyn=0):
    return {"ops": ops, "syncs": syncs, "dynamic_shape": dyn}


def test_judge_absolute_and_relative_targets():
    results = {"dense-181m": {"muon_md": _row(400, 1, 1), "adam": _row(151, 0), "muon": _row(9, 9)},
               "moe-0.9b": {"muon_md": _row(800, 2)}, "moe-6.7b-ep8": {"muon_md": _row(1201, 2)}}
    t = counts.judge(results)
    assert t["dense-181m/muon_md"]["met"] is True  # 1 sync + 1 dynamic shape = 2
    assert t["dense-181m/adam"]["met"] is False  # 151 > 150
    assert t["moe-6.7b-ep8/muon_md"]["max_ops"] == 1200 and t["moe-6.7b-ep8/muon_md"]["met"] is False
    assert "dense-181m/muon" not in t and "dense-181m/manifold_muon" not in t
    del results["moe-0.9b"]  # the relative bound needs its reference in the same run
    assert "moe-6.7b-ep8/muon_md" not in counts.judge(results)


def test_bad_arguments():
    with pytest.raises(SystemExit):
        counts.parse_args(["--presets", "dense-9b"])
    with pytest.raises(SystemExit):
        counts.parse_args(["--optimizers", "sgd"])


# ----------------------------------------------------------------------------- one real count

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """dense-181m's structure at hidden 16 with adam, and at hidden 32 for the width check (seconds)."""
    out = tmp_path_factory.mktemp("counts") / "step_counts_test.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, str(REPO / "benchmarks" / "step_counts.py"), "--presets", "dense-181m", "--optimizers",
           "adam", "--hidden-size", "16", "--check-width", "32", "--vocab-size", "256", "--threads", "1",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    return out, json.loads(out.read_text())


def test_tiny_run_counts(tiny_run):
    out, r = tiny_run
    assert r["benchmark"] == "step_counts" and r["settings"]["hidden_size"] == 16
    a = r["results"]["dense-181m"]["adam"]
    assert a["ops"] > 0 and a["syncs"] == 0 and a["top_ops"] and sum(a["by_op"].values()) == a["ops"]
    assert a["structure"]["layers"] == 12 and a["structure"]["heads"] == 4 and a["structure"]["query_groups"] == 2
    assert a["matrices"] > 12 and a["cpu_only_paths"] == []
    assert r["targets"]["dense-181m/adam"]["ops"] == a["ops"]
    assert r["width_check"]["hidden_sizes"] == [16, 32] and r["width_check"]["same"] is True
    assert out.with_suffix(".md").read_text().strip() == render.step_counts_markdown(r, source=out.name).strip()


# ----------------------------------------------------------------------------- the docs block

def _sample():
    row = {"ops": 3688, "syncs": 106, "dynamic_shape": 0, "matrices": 50,
           "top_ops": [["aten.mul_.Tensor", 492], ["aten.softplus.default", 294]]}
    return {"benchmark": "step_counts", "created": "2026-12-06T00:00:00+00:00",
            "machine": {"torch": "2.13", "megatron_core": "0.19.2", "repo_commit": {"commit": "abc1234"}},
            "settings": {"warmup": 2, "precision": "bf16", "hidden_size": 64, "vocab_size": 1024,
                         "models": {"moe-6.7b-ep8": {"approximation": "one EP8 rank"}}},
            "results": {"dense-181m": {"muon_md": row, "muon": dict(row, ops=2613, syncs=55)}},
            "targets": counts.judge({"dense-181m": {"muon_md": row}}),
            "width_check": {"model": "dense-181m", "hidden_sizes": [64, 48], "vocab_sizes": [1024, 2048],
                            "same": True, "differences": {}}}


def test_table_rows_targets_and_baseline():
    r = _sample()
    md = render.step_counts_markdown(r, source="x.json")
    assert "| `dense-181m` | `muon_md` | 50 | 3,688 | 106 | ≤ 400, ≤ 2 syncs | **no** |" in md
    assert "| `dense-181m` | `muon` | 50 | 2,613 | 55 | — | — |" in md
    assert "`mul_.Tensor` 492, `softplus` 294" in md and "gave the same counts" in md
    assert "`moe-6.7b-ep8`: one EP8 rank." in md
    after = copy.deepcopy(r)
    after["results"]["dense-181m"]["muon_md"].update(ops=390, syncs=1)
    after["targets"] = counts.judge(after["results"])
    md = render.step_counts_markdown(after, baseline=r, baseline_source="base.json")
    assert "| `dense-181m` | `muon_md` | 50 | 390 | 1 | ≤ 400, ≤ 2 syncs | yes | 3,688 | 106 |" in md
    assert "Baseline: `base.json` (commit abc1234, 2026-12-06)." in md


def test_docs_block(tmp_path):
    assert "step_counts" in render.BLOCKS
    render.locate(render.doc_files(REPO), ["step_counts"])  # exactly once across README.md and docs/*.md
    assert render.render_step_counts(tmp_path).startswith("_No results yet")
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "step_counts_cpu.json").write_text(json.dumps(_sample()))
    assert "baseline ops" not in render.render_step_counts(tmp_path)
    (results / "step_counts_cpu_baseline.json").write_text(json.dumps(_sample()))
    block = render.render_step_counts(tmp_path)
    assert "baseline ops" in block and "(`benchmarks/results/step_counts_cpu.json`, 2026-12-06)" in block
    assert render.render_optimizer_step(tmp_path).startswith("_No results yet")  # passes over these files
    text = render.render("<!-- BEGIN step_counts -->\nSTALE\n<!-- END step_counts -->\n", tmp_path, ["step_counts"])
    assert "STALE" not in text and "| `dense-181m` | `muon_md` |" in text
