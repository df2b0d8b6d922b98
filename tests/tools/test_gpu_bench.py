"""The GPU benchmark without a GPU: its docs block rendered from a recorded sample (and from a partial
run), the driver's --help, its refusal on a machine without CUDA, its time budget, and the shell script.

``data/gpu_bench_sample.json`` is hand-made in the schema ``benchmarks/gpu_bench.py`` writes (its
timings are invented; ``"sample": true``); the real result lives in benchmarks/results/gpu_bench_h200.json.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLE = Path(__file__).resolve().parent / "data" / "gpu_bench_sample.json"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def render():
    return _load("render_readme_tables", REPO / "tools" / "render_readme_tables.py")


@pytest.fixture(scope="module")
def bench():
    return _load("gpu_bench", REPO / "benchmarks" / "gpu_bench.py")


@pytest.fixture
def sample():
    return json.loads(SAMPLE.read_text())


def _rows(markdown: str) -> dict[tuple[str, str], list[str]]:
    """Table rows keyed by (model, optimizer), cells stripped."""
    out = {}
    for line in markdown.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[(cells[0].strip("`"), cells[1].split()[0].strip("`"))] = cells[2:]
    return out


def test_sample_is_consistent(sample, bench):
    """The sample's derived numbers follow from its inputs as the driver derives them."""
    assert sample["sample"] is True and sample["benchmark"] == "gpu_bench" and sample["schema"] == bench.SCHEMA
    assert sample["flops"]["formula"] == bench.FLOPS_FORMULA
    from megatron_md.models.presets import count_parameters
    from megatron_md.training import config as C

    spec, gemm = sample["peak"]["spec_tflops"], sample["peak"]["measured_gemm_tflops"]
    for name, sec in sample["sections"].items():
        if sec["kind"] not in ("train", "moe"):
            continue
        m = C.resolve(sec["preset"], None, {"seq_length": sec["seq_length"]}).model
        n, per_token = bench.flops_per_token(m, m.vocab_size, count_parameters(m).active)
        assert (sec["model"]["parameters_flops"], sec["flops_per_token"]) == (n, per_token), name
        assert sec["model_tflops"] == pytest.approx(per_token * sec["tokens_per_s"] / 1e12, rel=1e-4), name
        assert sec["mfu_spec"] == pytest.approx(sec["model_tflops"] / spec, rel=1e-3), name
        assert sec["mfu_gemm"] == pytest.approx(sec["model_tflops"] / gemm, rel=1e-3), name
        assert sec["iter_ms"] == pytest.approx(sec["tokens_per_iter"] / sec["tokens_per_s"] * 1e3, rel=1e-4), name
        assert sec["optimizer_step_share"] == pytest.approx(sec["optimizer_step_ms"] / sec["iter_ms"], rel=1e-3)
    dense = sample["sections"]["train_adam"]["model"]
    assert (dense["vocab_size"], dense["num_layers"], dense["hidden_size"]) == (131072, 12, 512)
    assert dense["parameters_flops"] == 181_419_520 - 131072 * 512  # all but the input embedding


def test_renders_sample_table(sample, render):
    md = render.gpu_bench_markdown(sample, source="benchmarks/results/gpu_bench_h200.json")
    assert md.startswith("**Sample data for the tests, not a measurement.**")
    assert "NVIDIA H200" in md and "layer spec local, no Transformer Engine" in md
    assert "989.4 TFLOP/s bf16 dense spec and 788 TFLOP/s measured (bfloat16 8192^3" in md
    assert "12*L*h^2*((1 + g/a + s/(2h))" in md and "`dense-181m` (12 layers, hidden 512, vocab 131072" in md
    assert "Partial run" not in md
    rows = _rows(md)
    assert list(rows) == [("dense-181m", "adam"), ("dense-181m", "muon"), ("dense-181m", "muon_md"),
                          ("dense-181m", "manifold_muon"), ("moe-0.9b", "adam"), ("moe-0.9b", "muon_md")]
    # tokens/s | TFLOP/s | MFU spec | MFU GEMM | iteration ms | step ms | step share | peak GiB
    assert rows[("dense-181m", "adam")] == ["180,000", "150.6", "15.2%", "19.1%", "91.0", "3.2", "3.5%", "38.4"]
    assert rows[("dense-181m", "manifold_muon")] == ["150,000", "125.5", "12.7%", "15.9%", "109.2", "21.3",
                                                     "19.5%", "37.2"]
    assert rows[("moe-0.9b", "muon_md")] == ["57,500", "102.7", "10.4%", "13.0%", "142.5", "18.7", "13.1%", "40.2"]
    assert "grouped GEMM was asked for (`--moe-grouped-gemm`) but is off" in md
    assert ("Save and resume (`muon_md`, `dense-181m` at sequence 1024, 3 iterations, save, resume, 3 more): "
            "resumed losses match the straight run's within rel 0.001 (max rel difference 9.3e-07); "
            "checkpoint 1.87 GiB.") in md


def test_partial_run_renders_failures(sample, render):
    r = copy.deepcopy(sample)
    r["status"] = "partial"
    r["peak"]["measured_gemm_tflops"] = None
    r["sections"]["gemm"] = {"kind": "gemm", "status": "timeout", "error": "killed after its 45 s timeout"}
    r["sections"]["train_manifold_muon"] = {
        "kind": "train", "preset": "dense-181m", "optimizer": "manifold_muon", "status": "failed",
        "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB\nmore text",
        "traceback": "...", "timeout_s": 90, "wall_s": 12.0}
    r["sections"]["moe_muon_md"] = {"kind": "moe", "preset": "moe-0.9b", "optimizer": "muon_md",
                                    "status": "skipped", "error": "out of time (--budget-s)"}
    sr = r["sections"]["save_resume"]
    sr.update(status="mismatch", max_rel_diff=0.02, losses_match=False)
    md = render.gpu_bench_markdown(r)
    assert "Partial run: 4 of 8 sections finished (gemm, train_manifold_muon, save_resume, moe_muon_md did not)." in md
    assert "GEMM **timeout**: killed after its 45 s timeout" in md
    rows = _rows(md)
    assert rows[("dense-181m", "manifold_muon")][0] == "**failed**: OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"
    assert rows[("moe-0.9b", "muon_md")][0] == "**skipped**: out of time (--budget-s)"
    assert rows[("dense-181m", "adam")][3] == "19.1%"  # the section's own MFU stays as recorded
    assert "the resume ran, but its losses differ from the straight run's (max rel 2.0e-02 > 0.001)" in md
    sr.update(status="failed", error="resumed run: exit 2: megatron-md train: error: checkpoint corrupted")
    assert "3 more): **failed**: resumed run: exit 2: megatron-md train: error: checkpoint corrupted." in \
        render.gpu_bench_markdown(r)


def test_readme_block(tmp_path, render, sample):
    assert "gpu_bench" in render.BLOCKS
    render.locate(render.doc_files(REPO), ["gpu_bench"])  # exactly once across README.md and docs/*.md
    absent = render.render_gpu_bench(tmp_path)
    assert "has not been run on a device yet" in absent and "bash tools/gpu_bench.sh" in absent
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "gpu_bench_h200.json").write_text(json.dumps(sample))
    block = render.render_gpu_bench(tmp_path)
    assert "(`benchmarks/results/gpu_bench_h200.json`, 2026-12-03)" in block and "| `dense-181m` | `adam` |" in block
    # the optimizer_step block reads every results/*.json and must pass over this one
    assert render.render_optimizer_step(tmp_path).startswith("_No results yet")
    text = render.render("<!-- BEGIN gpu_bench -->\nSTALE\n<!-- END gpu_bench -->\n", tmp_path, ["gpu_bench"])
    assert "STALE" not in text and "| `moe-0.9b` | `adam` |" in text


def test_help():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_bench.py", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--budget-s", "--steps", "--sections", "--optimizers", "--moe-preset", "--peak-tflops"):
        assert flag in proc.stdout


def test_refuses_without_cuda(tmp_path):
    out = tmp_path / "gpu_bench.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_bench.py", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_bench: error: no CUDA device is visible" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and not (tmp_path / "gpu_bench.log").exists()


def test_bad_arguments():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_bench.py", "--sections", "train,nope"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--sections: unknown ['nope']" in proc.stderr


def test_budget_leaves_later_sections_their_floor(bench):
    class Clock:
        def __init__(self, left):
            self.left = left

        def remaining(self):
            return self.left

    cap, floor = bench.BUDGET["train"]
    later = ["train", "retraction", "moe_whole"]
    need = sum(bench.BUDGET[k][1] for k in later)
    assert bench.Bench.timeout_for(Clock(1000), "train", later) == cap
    assert bench.Bench.timeout_for(Clock(need + 60), "train", later) == 60
    assert bench.Bench.timeout_for(Clock(need + 10), "train", later) == floor  # never under its floor
    assert bench.Bench.timeout_for(Clock(30), "train", later) == 30  # nor over what is left


def test_knobs_are_best_effort(bench):
    """No section is cut short to keep the knobs' floors: they run last on whatever time is left."""
    class Clock:
        left = 100.0

        def remaining(self):
            return self.left

    assert bench.Bench.timeout_for(Clock(), "train", ["knobs", "knobs", "knobs"]) == 90
    assert bench.Bench.timeout_for(Clock(), "train", ["moe", "save_resume"]) == 90  # re-measurements: best effort
    assert bench.Bench.timeout_for(Clock(), "train", ["retraction"]) == 80


def test_default_budget_holds_every_reserved_floor(bench):
    """Each part's sections reserve less than its default budget, leaving room above the floors: a first
    section that compiles (torch.compile) is not held to its floor."""
    for part in ("1", "2", "all"):
        args = bench.parse_args(["--part", part, "--dry-run"])
        kinds = [k for _, k, _, _ in bench.Bench(args, cuda=True).plan() if k not in bench.BEST_EFFORT]
        reserved = sum(bench.BUDGET[k][1] for k in kinds)
        assert reserved + 100 <= args.budget_s == bench.DEFAULT_BUDGET_S[part], (part, reserved, args.budget_s)
    assert all(k in bench.BUDGET for k in bench.BEST_EFFORT)


# ----------------------------------------------------------------------------- issue 30's sections

ISSUE30_SAMPLE = SAMPLE.with_name("gpu_bench_issue30_sample.json")


def _names(bench, *argv):
    return [n for n, _, _, _ in bench.Bench(bench.parse_args([*argv, "--dry-run"]), cuda=True).plan()]


def test_parts_order_the_headline_first(bench):
    first = _names(bench, "--part", "1")
    assert first == ["gemm", "train_adam_local", "train_adam_sdpa", "train_muon_md_local", "train_muon_md_sdpa"]
    rest = _names(bench, "--part", "2")
    assert rest[:6] == ["train_muon_local", "train_muon_sdpa", "train_manifold_muon_local",
                        "train_manifold_muon_sdpa", "retraction", "moe_whole"]
    assert _names(bench) == first + rest  # --part all
    assert _names(bench, "--part", "1", "--attention-backends", "") == ["gemm", "train_adam", "train_muon_md"]


def test_dry_run_commands(bench):
    args = bench.parse_args(["--dry-run", "--part", "2", "--sections", "train,moe_whole"])
    rows = bench.Bench(args, cuda=True).dry_run()
    by = {r["name"]: r for r in rows}
    cmd = by["train_manifold_muon_sdpa"]["command"]
    assert "--geometry hetero" in cmd and "--device cuda --bf16" in cmd
    assert cmd.endswith("--transformer-impl local --attention-backend sdpa")
    whole = by["moe_whole"]
    assert "--model moe-6.7b --optimizer muon_md" in whole["command"] and "--micro-batch-size 1" in whole["command"]
    assert "--seq-length 4096" in whole["command"] and "plan" in whole  # predicted, or why not (no sdpa here)
    assert "predicted_gib" in whole["plan"] or "error" in whole["plan"]


def test_dry_run_through_the_script(tmp_path):
    """``DRY_RUN=1 bash tools/gpu_bench.sh`` on a machine without a GPU: the sections, no files, exit 0."""
    env = dict(os.environ, DRY_RUN="1", PART="1", OUT=str(tmp_path / "out"), PY=sys.executable,
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", "tools/gpu_bench.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[part 1] train_muon_md_sdpa" in proc.stdout
    assert "dry run: 5 sections in --part 1, budget 300 s" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_merge_keeps_the_other_parts_sections(bench, tmp_path):
    b = bench.Bench(bench.parse_args(["--dry-run", "--part", "2", "--merge", str(ISSUE30_SAMPLE)]), cuda=True)
    assert "train_adam_sdpa" in b.result["sections"] and b.result["peak"]["measured_gemm_tflops"] == 788.18
    assert b.result["merged_from"]["file"] == ISSUE30_SAMPLE.name
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(SystemExit):
        bench.Bench(bench.parse_args(["--dry-run", "--merge", str(tmp_path / "x.json")]), cuda=True)


def test_renders_issue30_sample(render):
    r = json.loads(ISSUE30_SAMPLE.read_text())
    assert r["sample"] is True and "not a measurement" in r["note"]
    md = render.gpu_bench_markdown(r)
    assert md.startswith("**Sample data for the tests, not a measurement.**")
    assert "| `dense-181m` | `adam`, sdpa attention | 163,840 |" in md
    assert "`adam` 1.60x tokens/s (160.0 → 100.0 ms an iteration, peak 46.0 → 30.0 GiB)" in md
    assert "| `train_muon_md_local` | 3,500 | 130.0 | 130.0 | 12% |" in md  # per step: the sample's 2 steps halved
    assert "| `train_muon_md_sdpa` | **failed**: RuntimeError: profiler failed to start |" in md
    assert "| eigh_fp64 (DGram.retract_gram) | 12 × 4096×512 | 40.00 | 1.0e-15 | 0.0e+00 |" in md
    assert "| retract_gram_ns | 12 × 4096×512 | **failed**: TypeError" in md
    assert "`megatron-md plan` predicted 104.8 GiB (recompute none, sdpa attention): measured/predicted 1.05." in md
    assert "grouped GEMM was asked for" not in md  # the whole MoE does not ask for it
    r["sections"]["moe_whole"]["plan"] = {"error": "SystemExit: 2"}
    assert "no plan prediction (SystemExit: 2)" in render.gpu_bench_markdown(r)


def test_peak_by_device_name(bench):
    assert bench.peak_for("NVIDIA H200") == 989.4
    assert bench.peak_for("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_for("NVIDIA H100 80GB HBM3") == 989.4
    assert bench.peak_for("Tesla T4") is None


def test_shell_script():
    script = REPO / "tools" / "gpu_bench.sh"
    assert os.access(script, os.X_OK)
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    for kept in (".whl/*.whl", "--target /tmp/site", "transformer_engine", "torch.cuda.is_available()",
                 "benchmarks/gpu_bench.py", "${OUT:-runs/gpu_bench}", "gpu_bench.json"):
        assert kept in text, kept
    exe = Path(sys.executable).parent / "shellcheck"
    shellcheck = str(exe) if exe.exists() else shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed")
    proc = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
