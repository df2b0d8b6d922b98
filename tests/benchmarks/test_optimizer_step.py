"""benchmarks/optimizer_step.py at a tiny size, and tools/render_readme_tables.py on a temp README.

No timing thresholds: only the structure of the results and that every derived number is computed
from the measured step times.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OPTIMIZERS = ("muon_md", "muon", "adam")


def _load(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load("benchmarks/optimizer_step.py", "optimizer_step_bench")
render = _load("tools/render_readme_tables.py", "render_readme_tables")

TINY = ["--preset", "tiny-dense", "--hidden-size", "64", "--layers", "2", "--vocab-size", "512",
        "--steps", "2", "--warmup", "1", "--phase-steps", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "optimizer_step_test.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "optimizer_step.py"), *TINY, "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    return out, json.loads(out.read_text()), proc.stdout


def test_results_structure(tiny_run):
    out, r, stdout = tiny_run
    assert r["benchmark"] == "optimizer_step"
    for k in ("cpu", "threads", "torch", "megatron_core", "logical_cpus", "repo_commit", "env"):
        assert k in r["machine"], k
    assert r["machine"]["threads"] == 1
    s = r["settings"]
    assert (s["hidden_size"], s["num_layers"], s["vocab_size"], s["steps"], s["warmup"]) == (64, 2, 512, 2, 1)
    assert s["optimizers"] == list(OPTIMIZERS)
    assert f"{s['parameters']['total']:,} parameters" in stdout  # the count is printed
    assert set(r["results"]) == set(OPTIMIZERS)
    for name, res in r["results"].items():
        assert len(res["step_s"]) == 2 and all(t > 0 for t in res["step_s"]), name
        assert res["state_bytes"] == sum(p["state_bytes"] + p["master_bytes"] for p in res["state_by_optimizer"])
        assert res["state_bytes_per_param"] == pytest.approx(res["state_bytes"] / s["parameters"]["total"])
    assert out.with_suffix(".md").exists()


def test_state_bytes_cover_every_inner_optimizer(tiny_run):
    _, r, _ = tiny_run
    total = r["settings"]["parameters"]["total"]
    res = r["results"]
    assert res["adam"]["state_bytes"] >= 8 * total  # fp32 exp_avg + exp_avg_sq for every parameter
    md = {p["optimizer"]: p for p in res["muon_md"]["state_by_optimizer"]}
    assert {"MegatronMD", "AdamW"} <= set(md)
    assert {"rho_row", "rho_col", "exp_avg_row", "momentum_buffer"} <= set(md["MegatronMD"]["state_keys"])
    muon = {p["optimizer"]: p for p in res["muon"]["state_by_optimizer"]}
    assert "TensorParallelMuon" in muon and muon["TensorParallelMuon"]["state_keys"] == ["momentum_buffer"]
    # Every parameter is managed by exactly one inner optimizer.
    for name in OPTIMIZERS:
        assert sum(p["params"] for p in res[name]["state_by_optimizer"]) == total, name


def test_statistics_and_ratios_come_from_the_measured_times(tiny_run):
    _, r, _ = tiny_run
    res = r["results"]
    for name, x in res.items():
        ts = x["step_s"]
        assert x["median_s"] == pytest.approx(statistics.median(ts), rel=1e-12)
        assert x["q1_s"] <= x["median_s"] <= x["q3_s"]
        assert x["iqr_s"] == pytest.approx(x["q3_s"] - x["q1_s"])
    assert set(r["ratios"]) == {"muon_md/muon", "muon_md/adam", "muon/adam"}
    for key, value in r["ratios"].items():
        a, b = key.split("/")
        assert value == pytest.approx(res[a]["median_s"] / res[b]["median_s"], rel=1e-12)
        paired = statistics.median(x / y for x, y in zip(res[a]["step_s"], res[b]["step_s"]))
        assert r["paired_ratios"][key] == pytest.approx(paired, rel=1e-12)
        cpu = res[a]["cpu_median_s"] / res[b]["cpu_median_s"]
        assert r["cpu_time_ratios"][key] == pytest.approx(cpu, rel=1e-12)
    for name, x in res.items():
        assert len(x["cpu_s"]) == 2 and x["cpu_median_s"] == pytest.approx(statistics.median(x["cpu_s"]))
    assert r["warnings"] == bench.consistency_warnings(r["ratios"], r["paired_ratios"])
    t = r["target"]["muon_md/muon"]
    assert t["value"] == r["ratios"]["muon_md/muon"] and t["met"] == (t["value"] <= t["max"])


def test_phase_breakdown(tiny_run):
    _, r, _ = tiny_run
    ph = r["phases"]
    assert set(ph) == set(OPTIMIZERS)
    md = {row["name"]: row for row in ph["muon_md"]["phases"]}
    for name in ("msign", "inner step: MegatronMD", "md_prepare [hidden]", "md_finish_ [hidden]",
                 "md_prepare [embedding]", "md_finish_ [output]", "gains' Adam (foreach, all stacks)",
                 "sphere norms (stacked)", "engine.run (gather, msign, scatter)"):
        assert name in md and md[name]["seconds"] > 0, name
    # 12 blocks (2 layers x Q, K, V, proj, fc1, fc2) in one kernel call per distinct shape: Q and proj
    # (64 x 64), K and V (32 x 64: 2 query groups of 16 channels), fc1 (SwiGLU 512 x 64), fc2 (64 x 256)
    assert md["msign"]["calls"] == 4
    assert "msign" in {row["name"] for row in ph["muon"]["phases"]}


def test_phase_timers_undo_every_patch():
    import types

    class Base:
        def update(self, x):
            return x + 1

    mod = types.SimpleNamespace(fn=lambda x: 2 * x)
    obj = Base()
    orig_fn, orig_update = mod.fn, Base.__dict__["update"]
    from phase_timers import PhaseTimers  # benchmarks/ is on sys.path once the benchmark is loaded

    t = PhaseTimers()
    t.patch(mod, "fn", "fn")
    t.patch(Base, "update", "update")
    t.patch(obj, "update", "instance update")
    assert (mod.fn(3), obj.update(1), Base().update(1)) == (6, 2, 2)
    assert t.calls == {"fn": 1, "update": 2, "instance update": 1}
    t.undo()
    assert mod.fn is orig_fn and Base.__dict__["update"] is orig_update and "update" not in obj.__dict__


def test_markdown_beside_json_is_the_rendered_table(tiny_run):
    out, r, _ = tiny_run
    assert out.with_suffix(".md").read_text().strip() == render.optimizer_step_markdown(r, source=out.name).strip()


def test_summarize_and_ratios_helpers():
    s = bench.summarize([3.0, 1.0, 2.0, 10.0])
    assert s["median_s"] == 2.5 and s["min_s"] == 1.0 and s["max_s"] == 10.0
    res = {"muon_md": {"median_s": 3.0, "step_s": [3.0, 6.0]}, "muon": {"median_s": 2.0, "step_s": [2.0, 3.0]}}
    assert bench.ratios_of(res) == {"muon_md/muon": 1.5}
    assert bench.paired_ratios_of(res) == {"muon_md/muon": pytest.approx((1.5 + 2.0) / 2)}


def test_consistency_warning_when_the_two_ratio_estimates_disagree():
    assert bench.consistency_warnings({"muon_md/muon": 1.08}, {"muon_md/muon": 1.09}) == []
    (w,) = bench.consistency_warnings({"muon_md/muon": 1.43}, {"muon_md/muon": 1.03})
    assert "muon_md/muon" in w and "rerun" in w


def test_bad_optimizer_flag():
    with pytest.raises(SystemExit):
        bench.parse_args(["--optimizers", "muon,sgd"])


# ----------------------------------------------------------------------------- render_readme_tables

README = """# Title

Intro.

<!-- BEGIN optimizer_step -->
stale text
<!-- END optimizer_step -->

Outro.
"""


def _temp_repo(tmp_path: Path, result_json: Path | None) -> Path:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    if result_json is not None:
        shutil.copy(result_json, tmp_path / "benchmarks" / "results" / "optimizer_step_cpu.json")
    (tmp_path / "benchmarks" / "results" / "other.json").write_text(json.dumps({"benchmark": "something_else"}))
    return tmp_path


def test_render_rewrites_only_the_marked_block(tiny_run, tmp_path, capsys):
    out, r, _ = tiny_run
    repo = _temp_repo(tmp_path, out)
    readme = repo / "README.md"
    readme.write_text(README)
    args = ["--file", str(readme), "--repo", str(repo), "--block", "optimizer_step"]
    assert render.main([*args, "--check"]) == 1  # stale
    assert render.main(args) == 0
    text = readme.read_text()
    assert text.startswith("# Title\n\nIntro.\n\n<!-- BEGIN optimizer_step -->\n")
    assert text.endswith("<!-- END optimizer_step -->\n\nOutro.\n")
    assert "stale text" not in text
    block = text.split("<!-- BEGIN optimizer_step -->")[1].split("<!-- END optimizer_step -->")[0]
    assert "| `muon_md` |" in block and "| `muon` |" in block and "| `adam` |" in block
    assert f"{r['ratios']['muon_md/muon']:.3f}" in block
    assert "benchmarks/results/optimizer_step_cpu.json" in block
    assert render.main([*args, "--check"]) == 0  # up to date now
    assert render.main(args) == 0 and readme.read_text() == text  # idempotent


def test_render_without_results_and_without_markers(tmp_path, capsys):
    repo = _temp_repo(tmp_path, None)
    readme = repo / "README.md"
    readme.write_text(README)
    one = ["--block", "optimizer_step"]
    assert render.main(["--file", str(readme), "--repo", str(repo), *one]) == 0
    assert "No results yet" in readme.read_text()
    readme.write_text("# No markers here\n")
    capsys.readouterr()
    assert render.main(["--file", str(readme), "--repo", str(repo)]) == 2
    err = capsys.readouterr().err
    assert "<!-- BEGIN optimizer_step -->" in err and "<!-- END optimizer_step -->" in err
    assert readme.read_text() == "# No markers here\n"  # untouched
    assert render.main(["--file", str(readme), "--repo", str(repo), "--check"]) == 2


def _page(*names: str, stale: str = "stale text") -> str:
    return "# Page\n\n" + "".join(f"<!-- BEGIN {n} -->\n{stale}\n<!-- END {n} -->\n\n" for n in names)


def test_blocks_are_found_in_readme_or_docs(tmp_path, capsys):
    """Without --file the pages are README.md and docs/*.md of --repo; each block is rewritten where it is."""
    repo = _temp_repo(tmp_path, None)
    (repo / "docs").mkdir()
    readme, perf, other = repo / "README.md", repo / "docs" / "performance.md", repo / "docs" / "other.md"
    readme.write_text(_page("optimizer_state"))
    perf.write_text(_page("optimizer_step"))
    other.write_text("# Other\n\nNo blocks; `<!-- BEGIN optimizer_step -->` quoted in prose is no marker.\n")
    two = ["--repo", str(repo), "--block", "optimizer_step", "--block", "optimizer_state"]
    assert render.main([*two, "--check"]) == 1
    assert render.main(two) == 0
    assert "No results yet: run `make bench`" in perf.read_text() and "stale" not in perf.read_text()
    assert "No results yet: run `python benchmarks/optimizer_state.py`" in readme.read_text()
    assert other.read_text().startswith("# Other") and "No results" not in other.read_text()
    assert render.main([*two, "--check"]) == 0
    assert render.locate(render.doc_files(repo), ["optimizer_step", "optimizer_state"]) == {
        "optimizer_step": perf, "optimizer_state": readme}

    def fails(*must_say: str) -> None:
        before = {f: f.read_text() for f in (readme, perf, other) if f.exists()}
        capsys.readouterr()
        assert render.main(two) == 2
        err = capsys.readouterr().err
        for s in must_say:
            assert s in err, err
        assert {f: f.read_text() for f in before} == before  # nothing written

    other.write_text(_page("optimizer_step"))  # the same block on a second page
    fails("block 'optimizer_step' must appear exactly once", "docs/other.md", "docs/performance.md")
    other.write_text(_page("optimizer_setp"))  # a typo: unknown, not silently left stale
    fails("unknown block 'optimizer_setp'")
    other.write_text("<!-- BEGIN optimizer_step -->\n")  # a BEGIN with no END, beside a whole pair
    fails("block 'optimizer_step' must appear exactly once")
    other.unlink()
    perf.write_text("# Performance\n")  # gone from every page
    fails("no '<!-- BEGIN optimizer_step -->' ... '<!-- END optimizer_step -->'")


def test_links_are_relative_to_the_page(tmp_path):
    """A generated link is written from the repository root and lands relative to its page's folder."""
    repo = tmp_path
    page = repo / "docs" / "results.md"
    body = "See ![plot](records/r/p.png), [page](docs/usage.md#logs), [web](https://example.org/a.png), [here](#top)."
    out = render.relink(body, repo, page)
    assert out == ("See ![plot](../records/r/p.png), [page](usage.md#logs), [web](https://example.org/a.png), "
                   "[here](#top).")
    assert render.relink(body, repo, repo / "README.md") == body
