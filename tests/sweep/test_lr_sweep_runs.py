"""`megatron-md lr-sweep` training tiny cells: end to end, --jobs, signals, divergence, coord check, resumed cells.

Every sweep here runs through the real CLI (lr-sweep is not a pooled command: it starts a process per cell, and these
tests are about that), so every case is end to end; test_diverged_cell_is_recorded_once carries the e2e mark."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mdtest import REPO, run_cli

from megatron_md.sweep import runner

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _lr_sweep.py, beside this file
from _lr_sweep import TINY, rows, spec  # noqa: E402


# ----------------------------------------------------------------------------- end to end


def test_tiny_sweep_resumes_after_interruption_and_writes_csv_and_png(tmp_path):
    out = tmp_path / "sweep"
    argv = ["lr-sweep", "--model", "tiny-dense", "--out", str(out), "--widths", "32,64", "--lrs", "2",
            "--steps", "3", "--optimizers", "adamw,muon_md", "--", *TINY]
    first = run_cli(argv[:-len(TINY) - 1] + ["--max-cells", "3", "--", *TINY], timeout=300)
    assert "stopped after 3 new cells" in first.stdout
    done = sorted(out.glob("cells/*/result.json"))
    assert len(done) == 3
    mtimes = {p: p.stat().st_mtime_ns for p in done}
    assert len(rows(out / "results.csv")) == 3 and (out / "lr_transfer.png").exists()

    second = run_cli(argv, timeout=300)
    assert second.stdout.count("skipped (finished)") == 3 and second.stdout.count(": ok (") == 5
    assert {p: p.stat().st_mtime_ns for p in done} == mtimes  # finished cells were not rerun
    res = rows(out / "results.csv")
    assert len(res) == 8 and {r["status"] for r in res} == {"ok"}
    assert {(r["optimizer"], r["width"]) for r in res} == {(o, w) for o in ("adamw", "muon_md") for w in ("32", "64")}
    for r in res:
        assert math.isfinite(float(r["final_train_loss"])) and math.isfinite(float(r["final_eval_loss"]))
        assert r["steps"] == "3" and int(r["params"]) > 0 and r["k"] != ""
    assert {r["params"] for r in res if r["width"] == "32"} != {r["params"] for r in res if r["width"] == "64"}
    opt = rows(out / "optima.csv")
    assert len(opt) == 4 and all(r["inside_grid"] == "false" for r in opt)  # 2 LRs: the optimum is an edge
    assert (out / "lr_transfer.png").read_bytes()[:4] == b"\x89PNG" and (out / "lr_transfer.csv").exists()


def _cell_names(grid: list[str]) -> list[str]:
    dry = run_cli(grid + ["--dry-run", "--", *TINY], timeout=120).stdout
    return [line.split("--run-dir ")[1].split("/cells/")[1].split()[0] for line in dry.splitlines()
            if "--run-dir " in line]


def test_jobs_run_cells_at_once_and_leave_a_cell_another_sweep_runs_alone(tmp_path):
    import fcntl

    out = tmp_path / "sweep"
    grid = ["lr-sweep", "--model", "tiny-dense", "--out", str(out), "--widths", "32", "--lrs", "2", "--seeds", "1,2",
            "--steps", "3", "--optimizers", "adamw", "--no-plot"]
    names = _cell_names(grid)
    assert len(names) == 4
    # another sweep is running names[1]: its lock is held and its directory holds a partial run
    partial = out / "cells" / names[1] / "metrics.jsonl"
    partial.parent.mkdir(parents=True)
    partial.write_text('{"iteration": 1, "lm_loss": 6.0}\n')
    (out / runner.LOCKS).mkdir(parents=True)
    with open(out / runner.LOCKS / f"{names[1]}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        first = run_cli(grid + ["--jobs", "2", "--", *TINY], timeout=300)
    events = [x.split(": ")[1].split(" (")[0] for x in first.stdout.splitlines()
              if x.startswith("[lr-sweep] ") and "/4 " in x and (": running (" in x or ": ok (" in x)]
    assert events[:2] == ["running", "running"]  # two cells started before either ended
    assert first.stdout.count(": ok (") == 3
    assert f"{names[1]}: skipped (another lr-sweep on this --out is running it)" in first.stdout
    assert "1 cells were running in another lr-sweep" in first.stdout
    assert partial.read_text() == '{"iteration": 1, "lm_loss": 6.0}\n'  # not wiped
    assert len(rows(out / "results.csv")) == 3
    # the other sweep is gone (its lock released): a rerun runs that cell and skips the rest
    second = run_cli(grid + ["--jobs", "2", "--", *TINY], timeout=300)
    assert second.stdout.count("skipped (finished)") == 3 and second.stdout.count(": ok (") == 1
    assert len(rows(out / "results.csv")) == 4


def test_a_signal_stops_every_running_cell_and_records_none(tmp_path):
    import signal
    import time

    out = tmp_path / "sweep"
    argv = ["lr-sweep", "--model", "tiny-dense", "--out", str(out), "--widths", "32", "--lrs", "2", "--steps", "2000",
            "--optimizers", "adamw", "--no-plot", "--jobs", "2", "--", *TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    proc = subprocess.Popen([sys.executable, "-m", "megatron_md.cli", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "".join(seen).count(": running (") == 2:
                break
        time.sleep(3)  # both trainers past their start-up
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(seen) + rest
    assert proc.returncode == 130, text
    assert "interrupted" in text and not list(out.glob("cells/*/result.json"))  # neither recorded as failed
    assert not processes_mentioning(str(out))  # the trainers were stopped, not orphaned


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (from /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_extend_edges_runs_until_the_optimum_is_inside(tmp_path):
    out = tmp_path / "sweep"
    argv = ["lr-sweep", "--model", "tiny-dense", "--out", str(out), "--widths", "32", "--lrs", "1", "--steps", "3",
            "--optimizers", "muon_md", "--extend-edges", "1", "--no-plot", "--", *TINY]
    first = run_cli(argv, timeout=300)
    assert "extend-edges 1/1" in first.stdout and first.stdout.count(": ok (") == 3
    (best,) = rows(out / "optima.csv")
    assert best["n_lrs"] == "3"  # k 11, 12, 13: the centre plus one point on each side
    again = run_cli(argv, timeout=300)  # resuming re-derives the same added cells and skips them
    assert again.stdout.count("skipped (finished)") >= 1 and "running" not in again.stdout


@pytest.mark.e2e
def test_diverged_cell_is_recorded_once(tmp_path):
    out = tmp_path / "sweep"
    argv = ["lr-sweep", "--model", "tiny-dense", "--out", str(out), "--widths", "32", "--lrs", "1", "--steps", "4",
            "--optimizers", "adamw", "--no-plot", "--", *TINY, "--inject-nan-at", "1", "--inject-nan-iters", "4",
            "--max-consecutive-skips", "2"]
    first = run_cli(argv, timeout=120)
    assert ": diverged (" in first.stdout
    (res,) = [json.loads(p.read_text()) for p in out.glob("cells/*/result.json")]
    assert res["diverged"] is True and res["returncode"] == 3 and res["status"] == "diverged"
    (row,) = rows(out / "results.csv")
    assert row["diverged"] == "true" and row["final_train_loss"] == ""
    (best,) = rows(out / "optima.csv")
    assert best["best_lr"] == "" and best["inside_grid"] == "false"
    again = run_cli(argv, timeout=120)
    assert "skipped (finished)" in again.stdout and "running" not in again.stdout


def test_coord_check_writes_one_row_per_optimizer_width_layer_step(tmp_path):
    out = tmp_path / "cc"
    run_cli(["lr-sweep", "--coord-check", "--model", "tiny-dense", "--out", str(out), "--widths", "32,64",
             "--steps", "2", "--optimizers", "adamw,muon_md", "--", *TINY], timeout=300)
    rs = rows(out / "coord_check.csv")
    keys = [(r["optimizer"], r["width"], r["layer"], r["step"]) for r in rs]
    layers = ["embedding", "L0", "L1", "output"]  # tiny-dense has 2 layers
    assert sorted(keys) == sorted((o, w, lay, s) for o in ("adamw", "muon_md") for w in ("32", "64")
                                  for lay in layers for s in ("0", "1", "2"))
    for r in rs:
        assert float(r["act_rms"]) > 0
        assert (r["rel_update"] == "") == (r["step"] == "0")
    # MD with shape_up: each hidden matrix's direction moves by the matrix LR per step at every width
    for r in rs:
        if r["optimizer"] == "muon_md" and r["layer"].startswith("L") and r["step"] == "1":
            assert 0.5 * float(r["lr"]) < float(r["rel_update_mlp_fc1"]) < 1.5 * float(r["lr"])
    assert (out / "coord_check.png").read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- resumable cells


def _metrics(cell: Path) -> dict[int, float]:
    out = {}
    for line in (cell / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "lm_loss" in rec and "eval_lm_loss" not in rec:
            out[rec["iteration"]] = rec["lm_loss"]
    return out


RESUME_GRID = ["--model", "tiny-dense", "--widths", "32", "--lrs", "1", "--steps", "120", "--log-interval", "1",
               "--optimizers", "muon_md", "--no-plot"]


@pytest.fixture(scope="module")
def straight_cell(tmp_path_factory) -> Path:
    """The one cell of RESUME_GRID, run straight through."""
    straight = tmp_path_factory.mktemp("straight")
    run_cli(["lr-sweep", "--out", str(straight), *RESUME_GRID, "--", *TINY], timeout=300)
    (cell,) = straight.glob("cells/*")
    return cell


@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_resume_cells_continues_a_stopped_cell_from_its_checkpoint_bit_for_bit(tmp_path, straight_cell, stop):
    """A sweep stopped mid-cell with --resume-cells (SIGTERM to the sweep, as a batch system sends it, or Ctrl-C,
    SIGINT to the terminal's whole process group) leaves the cell's checkpoint; the rerun continues from it, and
    the cell's losses, step by step and final, equal those of a cell that ran straight through."""
    import signal
    import time

    ref_cell, grid = straight_cell, RESUME_GRID
    ref = json.loads((ref_cell / "result.json").read_text())

    out = tmp_path / "stopped"
    argv = ["lr-sweep", "--out", str(out), *grid, "--resume-cells", "--cell-save-interval", "10", "--", *TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    # A terminal's foreground job has SIGINT at its default; a job started in the background of a shell without
    # job control (`make test &`, CI) inherits it ignored, and Python then never raises KeyboardInterrupt, so the
    # sweep is given the terminal's disposition here whatever this test was started from.
    proc = subprocess.Popen([sys.executable, "-m", "megatron_md.cli", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        metrics = out / "cells" / ref_cell.name / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 20):
            time.sleep(0.2)
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, text
    cell = out / "cells" / ref_cell.name
    assert not (cell / "result.json").exists()
    saved_at = int((cell / "checkpoint" / "latest_checkpointed_iteration.txt").read_text())
    assert 20 <= saved_at < 120, saved_at  # stopped mid-run, checkpointed at the step it finished
    assert [p.name for p in (cell / "checkpoint").glob("iter_*")] == [f"iter_{saved_at:07d}"]  # only the newest kept

    second = run_cli(argv, timeout=300)
    assert f"resumed from its iteration {saved_at}" in second.stdout, second.stdout
    res = json.loads((cell / "result.json").read_text())
    assert res["status"] == "ok" and res["attempts"] == 2 and res["iterations"] == 120
    assert res["final_train_loss"] == ref["final_train_loss"] and res["final_eval_loss"] == ref["final_eval_loss"]
    assert _metrics(cell) == _metrics(ref_cell)  # every step, bit for bit
    assert res["args"] == ref["args"]  # the checkpoint flags are the runner's, not the cell's identity
    assert not (cell / "checkpoint").exists()  # deleted once the result is written
    attempts = json.loads((cell / "attempts.json").read_text())["attempts"]
    assert [a["from_iteration"] for a in attempts] == [0, saved_at]


def test_a_cell_with_changed_flags_or_a_result_starts_over(tmp_path):
    s = spec(optimizers=["adamw"])
    (cell,) = s.cells()
    d = runner.cell_dir(tmp_path, cell)
    (d / runner.CHECKPOINT).mkdir(parents=True)
    (d / runner.CHECKPOINT / "latest_checkpointed_iteration.txt").write_text("7")
    args = s.train_args(cell)
    (d / runner.ATTEMPTS).write_text(json.dumps({"args": args, "attempts": [{"from_iteration": 0, "wall_s": 1.0}]}))
    assert runner.resumable_from(d, args) == 7
    assert runner.resumable_from(d, args + ["--weight-decay", "0.2"]) is None  # flags changed since
    (d / runner.RESULT).write_text("{}")
    assert runner.resumable_from(d, args) is None  # a (failed) result: --retry-failed starts over
    assert runner.resumable_from(tmp_path / "nowhere", args) is None


def test_metrics_of_a_resumed_cell_count_each_iteration_once(tmp_path):
    """A cell killed after its last checkpoint logs some steps twice; the resumed values win."""
    lines = [{"iteration": i, "lm_loss": 10.0 - i, "skipped_total": 0} for i in range(1, 6)]
    lines += [{"iteration": i, "lm_loss": 20.0 - i, "skipped_total": 1} for i in range(4, 11)]  # resumed at 3
    lines += [{"iteration": 10, "eval_lm_loss": 9.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    m = runner.summarize_metrics(tmp_path)
    assert m["iterations"] == 10 and m["logged"] == 10 and m["skipped_total"] == 1
    assert m["final_train_loss"] == 10.0 and m["final_eval_loss"] == 9.5  # the last 10%: iteration 10 alone

