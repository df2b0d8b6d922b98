"""`megatron-md lr-sweep` without training: the grid, bad input, dry runs, fake cells' optima, SLURM grid, tools."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_md.training.arguments import train_parser
from mdtest import REPO

from megatron_md.sweep import command, grid as G, results as R, runner

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _lr_sweep.py, beside this file
from _lr_sweep import TINY, rows, spec  # noqa: E402


# ----------------------------------------------------------------------------- grid


def test_sqrt2_ladder_and_centring():
    assert G.lr_of_k(0) == pytest.approx(1e-3)
    assert [round(G.lr_of_k(k), 5) for k in range(3, 9)] == [0.00283, 0.004, 0.00566, 0.008, 0.01131, 0.016]
    assert G.k_label(G.lr_of_k(-3)) == -3 and G.k_label(0.0123) is None
    ks = lambda opt, n, centers={}, ranges={}: [G.k_label(x) for x in G.lr_grid(opt, n, centers, ranges)]  # noqa: E731
    c = G.RECIPES["muon_md"].k_center
    assert ks("muon_md", 3) == [c - 1, c, c + 1]
    assert ks("muon_md", 1) == [c] and ks("muon_md", 2) == [c, c + 1] and ks("muon_md", 4) == [c - 1, c, c + 1, c + 2]
    assert ks("adamw", 3, {"adamw": 0}) == [-1, 0, 1]
    assert ks("adamw", 3, {}, {"adamw": (2, 4)}) == [2, 3, 4]  # --k-range wins over --lrs
    assert G.lr_grid("muon", [0.01, 0.02], {}, {}) == [0.01, 0.02]
    # --k-step 2: factors of 2 in LR, for --lrs N and --k-range alike
    assert [G.k_label(x) for x in G.lr_grid("adamw", 3, {"adamw": 4}, {}, 2)] == [2, 4, 6]
    assert [G.k_label(x) for x in G.lr_grid("adamw", 3, {}, {"adamw": (3, 8)}, 2)] == [3, 5, 7]
    # the measured centres: adamw in 3e-3..1e-2, megatron muon ~0.02, muon_md 0.05..0.1
    assert 3e-3 <= G.lr_of_k(G.RECIPES["adamw"].k_center) <= 1e-2
    assert 0.014 <= G.lr_of_k(G.RECIPES["muon"].k_center) <= 0.03
    assert 0.05 <= G.lr_of_k(G.RECIPES["muon_md"].k_center) <= 0.1
    assert G.parse_lrs("3") == 3 and G.parse_lrs("0.02,1e-2") == [0.01, 0.02]
    assert G.parse_k_centers(["muon_md=10,adam=3"]) == {"muon_md": 10, "adamw": 3}
    assert G.parse_k_ranges(["muon=-2:4"]) == {"muon": (-2, 4)}
    assert G.parse_warmups("0,10%") == [("iters", 0), ("frac", 0.1)]


def test_centres_follow_the_base_configs_own_lr_unless_k_center_says_otherwise(tmp_path, capsys):
    """A GPU recipe is swept around its own LR: examples/md_paper's --matrix-lr 1.13e-2 is k=7, so --lrs 5 is
    k 5..9, not the CPU-measured muon_md centre k=12 (which would leave 1.13e-2 outside the grid)."""
    from megatron_md.training import config as C

    recipe = str(REPO / "examples" / "md_paper" / "dense-181m_muon_md.yaml")
    cfg, explicit = C.resolve(None, recipe, {}), runner.base_explicit(["--config", recipe])
    # muon_md: the recipe's matrix LR; adamw and manifold_muon: the config trains muon_md, so its --lr (the LM
    # head's) and --matrix-lr say nothing about them: their fallback centres stay
    assert G.config_centers(["muon_md", "adamw", "manifold_muon"], cfg, explicit) == {"muon_md": (7, 1.13e-2)}
    assert G.config_centers(["muon_md"], cfg, set()) == {}  # a preset default is not the config's own choice
    adam = tmp_path / "adam.yaml"
    adam.write_text("preset: tiny-dense\noptimizer:\n  optimizer: adam\n  lr: 3.0e-3\n")
    got = G.config_centers(["adamw", "muon"], C.resolve(None, str(adam), {}), runner.base_explicit(["--config", str(adam)]))
    assert got == {"adamw": (3, 3e-3)}  # 3e-3 -> k = 2 log2(3) = 3.17 -> 3

    notes = []

    def ks(*argv):
        assert command.main(["--out", str(tmp_path / "o"), "--dry-run", *argv, "--", "--mock-data"]) == 0
        cap = capsys.readouterr()
        notes.append(cap.err)
        return sorted({G.k_label(float(shlex.split(line)[shlex.split(line).index("--matrix-lr") + 1]))
                       for line in cap.out.splitlines()})

    md = tmp_path / "md.yaml"  # the recipe's optimizer section on a CPU-sized model
    md.write_text("preset: tiny-dense\noptimizer:\n  optimizer: muon_md\n  matrix_lr: 1.13e-2\n")
    assert ks("--config", str(md), "--widths", "32", "--optimizers", "muon_md", "--lrs", "5") == [5, 6, 7, 8, 9]
    assert "muon_md: --lrs 5 centred on k=7" in notes[-1]
    assert ks("--config", str(md), "--widths", "32", "--optimizers", "muon_md", "--lrs", "3",
              "--k-center", "muon_md=12") == [11, 12, 13]
    assert ks("--config", str(md), "--widths", "32", "--optimizers", "muon_md", "--k-range", "muon_md=2:4") == [2, 3, 4]
    assert ks("--model", "tiny-dense", "--widths", "32", "--optimizers", "muon_md", "--lrs", "3") == [11, 12, 13]
    assert "centred on" not in notes[-1]
    # a config's own width is the default --widths; the md_paper recipe itself, as a SLURM grid
    grid = tmp_path / "g.tsv"
    assert command.main(["--config", recipe, "--optimizers", "muon_md", "--slurm-grid", str(grid), "--gpus-per-cell", "8",
                         "--", "--mock-data"]) == 0
    assert "GPUS_PER_CELL=8 sbatch --array=0-4 --gpus-per-node=8" in capsys.readouterr().out
    rows = [r.split("\t") for r in grid.read_text().splitlines()[1:]]
    assert [(r[0], r[1], r[5]) for r in rows] == [(f"muon_md-w512-k{k}-s1-wu0-wd0", "512", recipe) for k in range(5, 10)]


def test_records_pin_the_lrs_they_ran():
    """Every lr-sweep call of the records' reproduce.sh scripts names its LRs (--k-range, or explicit --lrs), so
    neither the fallback centres nor the centres taken from a config's own LR (the manifold_paper configs set
    --matrix-lr 0.05: k=11) change the grids those records ran."""
    scripts = sorted((REPO / "records").glob("*/reproduce.sh"))
    assert scripts
    for script in scripts:
        text = script.read_text()
        # every call of the sweep (directly, or through the script's sweep/variant/run_width helpers)
        calls = re.findall(r"^\s*(?:sweep|variant|run_width|\.venv/bin/megatron-md lr-sweep)\s.*$", text, re.M)
        assert calls, script
        for call in calls:
            if call.lstrip().startswith("run_width"):
                assert '--k-range "muon_md=$3"' in text and '--k-range "adamw=$4"' in text  # its ranges are $3..$5
                continue
            if call.lstrip().startswith(".venv/bin/megatron-md"):
                call = text[text.index(call):].split("\n  done")[0]  # the (continued) command
            pinned = "--k-range" in call or "${MD[@]}" in call or re.search(r"--lrs\s+\"?[\d$]", call)
            assert pinned, (script, call)


def test_lr_flag_per_optimizer_recipes_and_width_scaling(tmp_path):
    s = spec(optimizers=list(G.RECIPES), steps=20, widths=[32, 128])
    cells = s.cells()
    seen = {}
    for cell in cells:
        cfg = runner.resolve_cell(s, cell)
        o, m = cfg.optimizer, cfg.model
        seen[(cell.optimizer, cell.width)] = cfg
        assert o.optimizer == G.RECIPES[cell.optimizer].optimizer
        assert (m.hidden_size, m.kv_channels, m.num_attention_heads) == (cell.width, 16, cell.width // 16)
        assert m.ffn_hidden_size == 4 * cell.width
        assert cfg.training.train_iters == 20 and cfg.training.seed == 1
        if cell.optimizer in ("adamw", "muon"):
            # megatron-core's Muon takes its matrices' LR from --lr (config.lr -> every param group)
            assert o.lr == cell.lr and o.md.matrix_lr is None
            assert (o.lr_warmup_iters, o.weight_decay) == (2, 0.1)
        else:
            assert o.md.matrix_lr == cell.lr
        if cell.optimizer in ("muon_md", "adam_md"):
            assert (o.lr, o.md.embedding_lr, o.lr_warmup_iters, o.weight_decay) == (1e-3, 3e-3, 0, 0.0)
    assert runner.param_count(seen[("adamw", 128)]) > runner.param_count(seen[("adamw", 32)])
    # a base config that sets --lr keeps it; --warmups / --weight-decays override the recipes
    base = tmp_path / "base.yaml"
    base.write_text("preset: tiny-dense\noptimizer:\n  lr: 0.002\n")
    s = spec(optimizers=["muon_md", "adamw"], base=["--config", str(base)], warmups=[("frac", 0.25), ("iters", 1)],
             weight_decays=[0.0, 0.05], base_explicit=runner.base_explicit(["--config", str(base)]))
    cells = s.cells()
    assert len(cells) == 2 * 2 * 2 and {c.warmup for c in cells} == {5, 1}
    md = runner.resolve_cell(s, next(c for c in cells if c.optimizer == "muon_md"))
    assert md.optimizer.lr == 0.002 and md.optimizer.md.embedding_lr == 3e-3
    assert len({c.name for c in cells}) == len(cells)


@pytest.mark.parametrize("args, message", [
    (["--optimizers", "adamw,sgd"], "--optimizers: unknown optimizer 'sgd'"),
    (["--widths", ","], "--widths: empty list"),
    (["--widths", "32,-64"], "--widths: -64"),
    (["--widths", "40"], "--widths 40"),  # not a multiple of the head dim (16)
    (["--lrs", "fast"], "--lrs"),
    (["--lrs", "0"], "--lrs"),
    (["--lrs", "0.1,-1"], "--lrs"),
    (["--k-center", "muon_md"], "--k-center"),
    (["--k-range", "muon_md=5:2"], "--k-range"),
    (["--k-center", "muon=3"], "not in --optimizers"),
    (["--warmups", "x"], "--warmups"),
    (["--steps", "0"], "--steps"),
    (["--extend-edges", "-1"], "--extend-edges must be >= 0"),
    (["--k-step", "0"], "--k-step must be >= 1"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--extend-edges", "2"], "--extend-edges needs the results of the grid"),  # with --dry-run
    (["--cell-save-interval", "50"], "--cell-save-interval 50: give N >= 1, together with --resume-cells"),
    (["--resume-cells", "--cell-save-interval", "0"], "--cell-save-interval 0: give N >= 1"),
    (["--resume-cells", "--slurm-grid", "g.tsv"], "--resume-cells applies to cells this lr-sweep runs itself"),
    (["--", "--hidden-size", "64"], "use lr-sweep --widths"),
    (["--", "--matrix-lr", "0.1"], "carries the swept LR of muon_md"),
    (["--corpus", "unused", "--", "--mock-data"], "--corpus and --mock-data"),
    (["--corpus", "unused", "--corpus-vocab", "10"], "--corpus-vocab must be in [64, 65536]"),
])
def test_bad_input_names_the_flag(tmp_path, capsys, args, message):
    base = ["--model", "tiny-dense", "--out", str(tmp_path / "o"), "--widths", "32", "--optimizers", "adamw,muon_md",
            "--dry-run"]
    extra = args[args.index("--"):] if "--" in args else []
    own = args[:args.index("--")] if "--" in args else args
    assert command.main(base + own + extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_defaults_and_dry_run(tmp_path, capsys):
    # no base, no data: tiny-dense on mock data (said on stderr), so the bare command runs anywhere
    assert command.main(["--out", str(tmp_path / "d"), "--widths", "32", "--lrs", "1", "--optimizers", "adamw",
                         "--dry-run"]) == 0
    cap = capsys.readouterr()
    (line,) = cap.out.splitlines()
    assert line.startswith("megatron-md train --model tiny-dense") and "--mock-data" in line
    assert "--mock-data" in cap.err
    out = tmp_path / "o"
    argv = ["--model", "tiny-dense", "--out", str(out), "--widths", "32,64", "--lrs", "0.01,0.02",
            "--optimizers", "muon,muon_md", "--seeds", "1,2", "--steps", "4", "--dry-run", "--", *TINY]
    assert command.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * 2 * 2 * 2 and all(line.startswith("megatron-md train --model tiny-dense") for line in lines)
    cmd = shlex.split(lines[-1])
    assert cmd[cmd.index("--matrix-lr") + 1] == "0.02" and cmd[cmd.index("--run-dir") + 1].startswith(str(out))
    assert not out.exists()


def test_corpus_tokenises_the_embedded_corpus_once_for_every_cell(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    argv = ["--model", "tiny-dense", "--out", str(tmp_path / "o"), "--widths", "32,64", "--lrs", "1",
            "--optimizers", "adamw", "--corpus", str(corpus), "--dry-run"]
    assert command.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line in lines:
        cmd = shlex.split(line)
        assert "--mock-data" not in cmd
        prefix, model = cmd[cmd.index("--data-path") + 1], cmd[cmd.index("--tokenizer-model") + 1]
        assert Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file() and Path(model).is_file()
        assert Path(model).parent == corpus


# ----------------------------------------------------------------------------- results


def _fake(out: Path, opt, width, lr, seed, train, ev, diverged=False):
    d = out / "cells" / f"{opt}-{width}-{lr}-{seed}"
    d.mkdir(parents=True)
    (d / "result.json").write_text(json.dumps({
        "cell": d.name, "optimizer": opt, "width": width, "params": width * 10, "lr": lr, "k": G.k_label(lr),
        "seed": seed, "warmup": 0, "weight_decay": 0.0, "steps": 10, "final_train_loss": train,
        "final_eval_loss": ev, "diverged": diverged, "status": "diverged" if diverged else "ok", "wall_s": 1.0}))


def test_optima_inside_grid_seed_mean_and_divergence(tmp_path):
    lrs = [G.lr_of_k(k) for k in (4, 5, 6)]
    for seed, noise in ((1, 0.0), (2, 0.02)):
        _fake(tmp_path, "muon_md", 64, lrs[0], seed, 3.0, 3.0 + noise)
        _fake(tmp_path, "muon_md", 64, lrs[1], seed, 2.9, 2.9 + noise)
        _fake(tmp_path, "muon_md", 64, lrs[2], seed, 2.8, 2.8 + noise, diverged=seed == 2)  # one seed diverged
        _fake(tmp_path, "adamw", 64, lrs[0], seed, 3.0, None)  # no eval loss: ranked by train loss
        _fake(tmp_path, "adamw", 64, lrs[1], seed, 2.5, None)
    _, _, rs = R.write_all(tmp_path)
    assert len(rs) == 10 and len(rows(tmp_path / "results.csv")) == 10
    best = {(r["optimizer"], r["width"]): r for r in rows(tmp_path / "optima.csv")}
    md = best[("muon_md", "64")]
    assert float(md["best_lr"]) == lrs[1] and md["best_k"] == "5" and md["inside_grid"] == "true"
    assert float(md["loss"]) == pytest.approx(2.91) and md["loss_kind"] == "eval" and md["seeds"] == "2"
    ad = best[("adamw", "64")]
    assert ad["loss_kind"] == "train" and float(ad["best_lr"]) == lrs[1] and ad["inside_grid"] == "false"


def test_extend_edges_adds_the_next_ladder_point_beyond_an_edge_optimum(tmp_path):
    sp = spec(optimizers=("muon_md", "adamw"), widths=[64, 128], seeds=[1, 2], k_ranges={"muon_md": (4, 6),
              "adamw": (4, 6)})
    wu = {c.optimizer: c.warmup for c in sp.cells()}
    wd = {c.optimizer: c.weight_decay for c in sp.cells()}
    losses = {("muon_md", 64): (3.0, 2.9, 2.8),  # best at the top edge -> k 7
              ("muon_md", 128): (2.7, 2.8, 2.9),  # best at the bottom edge -> k 3
              ("adamw", 64): (3.0, 2.5, 2.9),  # inside: nothing added
              ("adamw", 128): (math.inf,) * 3}  # all diverged: no direction, nothing added
    rs = [{"cell": G.Cell(o, w, G.lr_of_k(k), s, wu[o], wd[o], sp.steps).name, "optimizer": o, "width": w,
           "warmup": wu[o], "weight_decay": wd[o], "lr": G.lr_of_k(k), "seed": s, "final_eval_loss": v if math.isfinite(v) else None, "final_train_loss": v if math.isfinite(v) else None,
           "diverged": not math.isfinite(v)}
          for (o, w), vs in losses.items() for k, v in zip((4, 5, 6), vs) for s in (1, 2)]
    n0 = len(sp.cells())
    from megatron_md.sweep.results import sweep_curves

    new = sp.extend_edges(sweep_curves(sp, rs))
    assert sorted((c.optimizer, c.width, c.k, c.seed) for c in new) == [
        ("muon_md", 64, 7, 1), ("muon_md", 64, 7, 2), ("muon_md", 128, 3, 1), ("muon_md", 128, 3, 2)]
    assert len(sp.cells()) == n0 + 4 and sp.extend_edges(sweep_curves(sp, rs)) == []  # already added: not added twice
    assert all(c.warmup == wu["muon_md"] and c.steps == sp.steps for c in new)
    # a curve of one LR grows on both sides; rows of cells outside the sweep do not count
    one = spec(optimizers=("muon_md",), widths=[64], seeds=[1, 2], k_ranges={"muon_md": (5, 5)})
    assert sorted({c.k for c in one.extend_edges(sweep_curves(one, rs))}) == [4, 6]
    # with --k-step 2 the walk keeps the grid's spacing
    two = spec(optimizers=("muon_md",), widths=[64], seeds=[1, 2], k_ranges={"muon_md": (5, 5)}, k_step=2)
    assert sorted({c.k for c in two.extend_edges(sweep_curves(two, rs))}) == [3, 7]


# ----------------------------------------------------------------------------- SLURM grid and tools


def test_slurm_grid_is_accepted_by_lr_sweep_sbatch(tmp_path, capsys):
    from megatron_md.training import config as C

    grid = tmp_path / "g.tsv"
    argv = ["--model", "tiny-dense", "--out", str(tmp_path / "o"), "--widths", "32,64", "--lrs", "2", "--steps", "7",
            "--optimizers", "adamw,muon_md", "--slurm-grid", str(grid), "--", "--mock-data"]
    assert command.main(argv) == 0
    printed = capsys.readouterr().out
    assert "sbatch --array=0-7 slurm/lr_sweep.sbatch" in printed and f"GRID={grid}" in printed
    config = tmp_path / "g.yaml"
    assert config.read_text() == "preset: tiny-dense\n"
    bash = shutil.which("bash") or "/bin/bash"
    env = {"HOME": str(tmp_path), "PATH": "/nonexistent", "GRID": str(grid), "CONFIG": str(config),
           "PYTHON": "/opt/venv/bin/python", "DRY_RUN": "1"}
    sbatch = str(REPO / "slurm" / "lr_sweep.sbatch")
    p = subprocess.run([bash, sbatch, "--array-range", str(grid)], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stdout == "0-7\n", p.stderr
    s = spec(optimizers=["adamw", "muon_md"], widths=[32, 64], lrs=2, steps=7, extra=["--mock-data"])
    for task, cell in enumerate(s.cells()):
        if task % 3:
            continue  # a few rows are enough
        p = subprocess.run([bash, sbatch], env=dict(env, SLURM_ARRAY_TASK_ID=str(task)), capture_output=True,
                           text=True, timeout=30, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        cmd = shlex.split(p.stdout)
        train = cmd[cmd.index("megatron_md.cli") + 2:]
        args = vars(train_parser().parse_args(train))
        got = C.resolve(None, args.pop("config"), args)
        want = runner.resolve_cell(s, cell)
        assert got.optimizer == want.optimizer and got.model == want.model
        assert got.training.train_iters == 7 and got.training.seed == 1 and got.data.mock_data
        assert train[train.index("--wandb-exp-name") + 1] == cell.name


def test_tools_wrap_the_same_main(tmp_path):
    env = dict(os.environ, PYTHONPATH="")
    p = subprocess.run([sys.executable, str(REPO / "tools" / "lr_sweep.py"), "--help"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0 and "--coord-check" in p.stdout and "--matrix-lr" in p.stdout
    _fake(tmp_path, "muon", 32, G.lr_of_k(8), 1, 3.0, 3.1)
    _fake(tmp_path, "muon", 32, G.lr_of_k(9), 1, 2.9, 2.8)
    R.write_all(tmp_path)
    png = tmp_path / "plots" / "t.png"
    p = subprocess.run([sys.executable, str(REPO / "tools" / "plot_lr_transfer.py"), str(tmp_path / "results.csv"),
                        "--out", str(png)], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:4] == b"\x89PNG" and (tmp_path / "plots" / "t.csv").read_text() == (
        tmp_path / "results.csv").read_text()


def test_collect_gathers_a_slurm_array_run(tmp_path, capsys):
    flags = ["--model", "tiny-dense", "--widths", "32,64", "--lrs", "2", "--steps", "7", "--optimizers", "muon_md",
             "--", "--mock-data"]
    s = spec(optimizers=["muon_md"], widths=[32, 64], lrs=2, steps=7, extra=["--mock-data"])
    cells = s.cells()
    slurm_out = tmp_path / "slurm"
    for i, cell in enumerate(cells):  # what lr_sweep.sbatch leaves: OUT/<name>/run/metrics.jsonl
        run = slurm_out / cell.name / "run"
        run.mkdir(parents=True)
        last = 7 if i != 1 else 4  # row 1 is still running
        loss = math.nan if i == 2 else 3.0 - 0.1 * i
        recs = [{"iteration": it, "lm_loss": loss} for it in range(1, last + 1)]
        if last == 7 and i != 2:
            recs.append({"iteration": 7, "eval_lm_loss": loss + 0.05})
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    out = tmp_path / "sweep"
    assert command.main(["--out", str(out), "--collect", str(slurm_out), "--no-plot", *flags[:-2], *flags[-2:]]) == 0
    printed = capsys.readouterr().out
    assert "collected 3 cells" in printed and "1 unfinished" in printed
    rows = R.read_csv(out / "results.csv")
    assert sorted(r["cell"] for r in rows) == sorted(c.name for i, c in enumerate(cells) if i != 1)
    by = {r["cell"]: r for r in rows}
    assert by[cells[0].name]["final_eval_loss"] == pytest.approx(3.05) and by[cells[0].name]["status"] == "ok"
    assert by[cells[2].name]["status"] == "diverged"
    assert (out / "cells" / cells[0].name / "metrics.jsonl").exists()
    # the collected cells count as finished for a local rerun of the same grid
    assert runner.finished(s, cells[0], out, retry_failed=False) is not None
    assert command.main(["--out", str(out), "--collect", str(tmp_path / "nope"), *flags]) == 2
    assert "--collect" in capsys.readouterr().err


def test_a_cluster_recipe_that_saves_periodically_sweeps_locally(tmp_path, capsys):
    """examples/md_paper saves every 1000 steps, which needs --save: a local cell runs without periodic saves
    (--save-interval 0, Megatron-LM's 'never'), a resumable one with its own checkpoint directory; both are
    checked before any cell runs (the dry run stopped with '--save-interval needs --save DIR')."""
    recipe = str(REPO / "examples" / "md_paper" / "dense-181m_muon_md.yaml")
    argv = ["--config", recipe, "--widths", "256", "--optimizers", "muon_md", "--lrs", "1", "--out", str(tmp_path / "o")]
    assert command.main([*argv, "--dry-run", "--", "--mock-data"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith("--save-interval 0") and "--save " not in line
    spec = command.build_spec(command.parser().parse_args(argv), ["--mock-data"])
    cell = spec.cells()[0]
    resumable = runner.local_flags(tmp_path / "o", cell, resume=True)
    assert resumable[:2] == ["--save", str(runner.cell_dir(tmp_path / "o", cell) / runner.CHECKPOINT)]
    assert runner.resolve_cell(spec, cell, more=tuple(resumable)).checkpoint.save_interval == 1000  # the recipe's


def test_every_optimizer_is_sweepable_by_its_family_s_recipe(tmp_path, capsys):
    """The sweep's recipes come from the optimizer families: every --optimizer choice sweeps (ademamix_md and
    norm_md were missing from the sweep's own table), under its name (adam as adamw)."""
    from megatron_md.mcore.families import FAMILIES

    assert {"adamw" if n == "adam" else n for n in FAMILIES} == set(G.RECIPES)
    assert command.main(["--model", "tiny-dense", "--widths", "32", "--optimizers", "ademamix_md,norm_md", "--lrs",
                         "1", "--out", str(tmp_path / "o"), "--dry-run", "--", "--mock-data"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("--optimizer ")[1].split()[0] for line in lines] == ["ademamix_md", "norm_md"]
    assert all("--matrix-lr" in line and "--weight-decay 0.0" in line for line in lines)


def test_a_finished_cell_made_with_other_flags_is_never_replaced(tmp_path, capsys):
    """Cell names carry the grid point, not the flags after --: a sweep into an --out whose cell holds a result of
    other flags (another expert count, say) refuses before running anything, naming the flags."""
    out = tmp_path / "o"
    own = ["--model", "tiny-dense", "--out", str(out), "--widths", "32", "--lrs", "0.01", "--optimizers", "adamw",
           "--steps", "4"]
    (s,) = command.build_specs(command.parser().parse_args(own), list(TINY))
    (cell,) = s.cells()
    result = runner.cell_dir(out, cell) / runner.RESULT
    result.parent.mkdir(parents=True)
    saved = json.dumps({"cell": cell.name, "status": "ok", "final_eval_loss": 5.0,
                        "args": s.train_args(cell) + ["--num-experts", "16"]})
    result.write_text(saved)
    assert command.main(own + ["--", *TINY]) == 2
    err = capsys.readouterr().err
    assert f"{cell.name} (was --num-experts 16)" in err and "its own --out" in err and "--replace-changed" in err
    assert result.read_text() == saved and not (out / "sweep.json").exists()  # nothing ran, nothing rewritten
    runner.refuse_changed(s, out, [cell], replace=True)  # --replace-changed lets it rerun
    result.write_text(json.dumps({"cell": cell.name, "status": "ok", "args": s.train_args(cell)}))
    runner.refuse_changed(s, out, [cell])  # the same flags: finished, skipped, nothing to refuse


def test_plot_one_curve_per_series_for_an_axis_other_than_width(tmp_path, capsys):
    from megatron_md.sweep import plot

    csvs = []
    for n, best in ((4, 8), (16, 9)):  # the number of experts: one sweep directory each, at one width
        d = tmp_path / "experts" / str(n)
        for k in (7, 8, 9, 10):
            _fake(d, "muon_md", 128, G.lr_of_k(k), 1, 3.0, 3.0 + 0.01 * (k - best) ** 2)
        R.write_all(d)
        csvs.append(str(d / "results.csv"))
    png = tmp_path / "experts.png"
    assert plot.main([*csvs, "--labels", "4 experts,16 experts", "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert plot.main([*csvs, "--labels", "4 experts", "--out", str(png)]) == 2
    assert "--labels gives 1 labels for 2 results.csv files" in capsys.readouterr().err
    assert plot.main([*csvs, "--out", str(png)]) == 2  # several CSVs need their labels
