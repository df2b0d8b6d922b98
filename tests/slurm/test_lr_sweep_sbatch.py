"""slurm/lr_sweep.sbatch (one grid row per array task) and slurm/width_ladder.sh, under a fake SLURM job."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_md.sweep import grid as G
from megatron_md.training.arguments import train_parser

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _sbatch.py, beside this file
from _sbatch import (  # noqa: E402
    BASH, EXAMPLE_GRID, REPO, SLURM, SWEEP, lines, run, runs, split_torchrun, value,
)


# ----------------------------------------------------------------------------- sweep

GRID = "name\twidth\tlr\toptimizer\tseed\textra_args\n" \
    "# comment\n" \
    "a-w256\t256\t1e-3\tadam\t1\t\n" \
    "\n" \
    "b-w512\t512\t3e-3\tmuon_md\t7\t--matrix-lr 0.02 --train-iters 10\n"


@pytest.fixture
def sweep(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("preset: tiny-dense\n")
    grid = tmp_path / "mygrid.tsv"
    grid.write_text(GRID)
    env = {"CONFIG": str(config), "GRID": str(grid), "SLURM_JOB_ID": "99", "SLURM_ARRAY_JOB_ID": "98",
           "SLURM_JOB_NAME": "lr-sweep", "PYTHON": "/opt/venv/bin/python"}
    return env, tmp_path


def test_sweep_task_runs_its_grid_row(sweep):
    env, tmp = sweep
    smoke, cmd = lines(run(SWEEP, ["--dry-run", "--log-interval", "5"], dict(env, SLURM_ARRAY_TASK_ID="1"), cwd=tmp))
    tr, train = split_torchrun(cmd)
    assert "--standalone" in tr and value(tr, "--nnodes") == "1" and value(tr, "--nproc-per-node") == "1"
    out = "runs/sweeps/mygrid-98/b-w512"  # one directory per array job, a row per subdirectory
    assert train == [
        "--config", env["CONFIG"], "--hidden-size", "512", "--lr", "3e-3", "--optimizer", "muon_md",
        "--seed", "7", "--save", out, "--load", out, "--run-dir", out + "/run", "--wandb-exp-name", "b-w512",
        "--log-interval", "5", "--matrix-lr", "0.02", "--train-iters", "10",
    ]
    assert smoke == ["timeout", "--kill-after=30", "600", "/opt/venv/bin/python", "-m", "torch.distributed.run",
                     "--standalone", "--nnodes", "1", "--nproc-per-node", "1", str(SLURM / "smoke.py")]
    (cmd,) = lines(run(SWEEP, [], dict(env, SLURM_ARRAY_TASK_ID="0", DRY_RUN="1", OUT="/o", SKIP_SMOKE="1"), cwd=tmp))
    _, train = split_torchrun(cmd)
    assert value(train, "--hidden-size") == "256" and value(train, "--save") == "/o/a-w256"
    assert train[-2:] == ["--wandb-exp-name", "a-w256"]


def test_sweep_output_is_per_array_job_and_kept_by_a_requeue(sweep):
    env, tmp = sweep

    def save(**kw):
        (cmd,) = runs(lines(run(SWEEP, ["--dry-run"], dict(env, SLURM_ARRAY_TASK_ID="0", **kw), cwd=tmp)))
        return value(split_torchrun(cmd)[1], "--save")

    assert save() == save(SLURM_RESTART_COUNT="2", SLURM_JOB_ID="100") == "runs/sweeps/mygrid-98/a-w256"
    assert save(SLURM_ARRAY_JOB_ID="500") == "runs/sweeps/mygrid-500/a-w256"  # a new submission of the grid
    assert save(OUT="runs/sweeps/mygrid-98") == "runs/sweeps/mygrid-98/a-w256"  # resuming it on purpose


def test_sweep_cell_uses_gpus_per_cell_gpus(sweep):
    env, tmp = sweep

    def nproc(**kw):
        p = run(SWEEP, ["--dry-run"], dict(env, SLURM_ARRAY_TASK_ID="1", **kw), cwd=tmp)
        smoke, cmd = lines(p)
        assert value(smoke, "--nproc-per-node") == value(split_torchrun(cmd)[0], "--nproc-per-node")
        return int(value(split_torchrun(cmd)[0], "--nproc-per-node"))

    assert nproc() == 1
    assert nproc(SLURM_GPUS_ON_NODE="8") == 8  # what the task was given
    assert nproc(GPUS_PER_CELL="4", SLURM_GPUS_ON_NODE="8") == 4
    assert nproc(GPUS_PER_NODE="2") == 2  # the older name still works
    p = run(SWEEP, ["--dry-run"], dict(env, SLURM_ARRAY_TASK_ID="1", GPUS_PER_CELL="8", SLURM_GPUS_ON_NODE="4"), cwd=tmp)
    assert p.returncode != 0 and "GPUS_PER_CELL=8 but the task has 4 GPU(s)" in p.stderr and "--gpus-per-node=8" in p.stderr
    p = run(SWEEP, ["--dry-run"], dict(env, SLURM_ARRAY_TASK_ID="1", GPUS_PER_CELL="two"), cwd=tmp)
    assert p.returncode != 0 and "GPUS_PER_CELL=two" in p.stderr


def test_sweep_config_column_picks_each_rows_yaml(sweep):
    env, tmp = sweep
    other = tmp / "other.yaml"
    other.write_text("preset: tiny-dense\n")
    grid = Path(env["GRID"])
    grid.write_text("name\twidth\tlr\toptimizer\tseed\tconfig\textra_args\n"
                    f"a\t256\t1e-3\tadam\t1\t{other}\t\n"
                    "b\t256\t1e-3\tadam\t2\t\t--bf16\n")
    cmds = runs(lines(run(SWEEP, ["--dry-run"], env, cwd=tmp)))
    assert [value(split_torchrun(c)[1], "--config") for c in cmds] == [str(other), env["CONFIG"]]
    no_config = {k: v for k, v in env.items() if k != "CONFIG"}
    p = run(SWEEP, ["--dry-run"], dict(no_config, SLURM_ARRAY_TASK_ID="0"), cwd=tmp)  # row 0 needs no CONFIG
    assert p.returncode == 0, p.stderr
    p = run(SWEEP, ["--dry-run"], dict(no_config, SLURM_ARRAY_TASK_ID="1"), cwd=tmp)
    assert p.returncode != 0 and "CONFIG is not set" in p.stderr
    grid.write_text("name\twidth\tlr\toptimizer\tseed\tconfig\nx\t256\t1e-3\tadam\t1\tgone.yaml\n")
    p = run(SWEEP, ["--dry-run"], env, cwd=tmp)
    assert p.returncode != 0 and "config 'gone.yaml': file not found" in p.stderr


def test_sweep_dry_run_without_task_prints_every_row_and_array_range(sweep):
    env, tmp = sweep
    cmds = lines(run(SWEEP, ["--dry-run"], env, cwd=tmp))
    assert cmds[0][-1] == str(SLURM / "smoke.py")  # the smoke step once, then every row
    assert [value(split_torchrun(c)[1], "--wandb-exp-name") for c in cmds[1:]] == ["a-w256", "b-w512"]
    p = run(SWEEP, ["--array-range", env["GRID"]], cwd=tmp)
    assert p.returncode == 0 and p.stdout == "0-1\n"
    p = run(SWEEP, ["--array-range", str(EXAMPLE_GRID)])
    assert p.stdout == "0-5\n"


def test_sweep_errors(sweep):
    env, tmp = sweep
    bad = run(SWEEP, ["--dry-run"], dict(env, SLURM_ARRAY_TASK_ID="2"), cwd=tmp)
    assert bad.returncode != 0 and "SLURM_ARRAY_TASK_ID=2 is out of range" in bad.stderr and "0-1" in bad.stderr
    p = run(SWEEP, [], env, cwd=tmp)  # a real run needs the array index
    assert p.returncode != 0 and "SLURM_ARRAY_TASK_ID is not set" in p.stderr
    p = run(SWEEP, ["--dry-run"], {k: v for k, v in env.items() if k != "GRID"}, cwd=tmp)
    assert p.returncode != 0 and "GRID is not set" in p.stderr
    p = run(SWEEP, ["--dry-run"], dict(env, GRID="nope.tsv"), cwd=tmp)
    assert p.returncode != 0 and "GRID=nope.tsv: file not found" in p.stderr
    p = run(SWEEP, ["--dry-run"], {k: v for k, v in env.items() if k != "CONFIG"}, cwd=tmp)
    assert p.returncode != 0 and "CONFIG is not set" in p.stderr
    grid = Path(env["GRID"])
    for text, message in [
        ("name\twidth\tlr\toptimizer\n", "lacks the column 'seed'"),
        ("name\twidht\tlr\toptimizer\tseed\n", "unknown column 'widht'"),
        ("name\twidth\tlr\toptimizer\tseed\nx\t\t1e-3\tadam\t1\n", "width '' is not a positive integer"),
        ("name\twidth\tlr\toptimizer\tseed\nx\t64\t1e-3\tadam\t1\nx\t64\t1e-2\tadam\t1\n", "used by two rows"),
        ("name\twidth\tlr\toptimizer\tseed\nx/y\t64\t1e-3\tadam\t1\n", "name 'x/y'"),
        ("name\twidth\tlr\toptimizer\tseed\n \t64\t1e-3\tadam\t1\n", "name ''"),
        ("name\twidth\tlr\toptimizer\tseed\nx\t64\t1e-3\tadam\t1\t--extra\n", "6 cells but 5 columns"),
        ("# only a comment\n", "no header line"),
    ]:
        grid.write_text(text)
        p = run(SWEEP, ["--dry-run"], dict(env, SLURM_ARRAY_TASK_ID="0"), cwd=tmp)
        assert p.returncode != 0 and message in p.stderr, (text, p.stderr)


@pytest.mark.slow
def test_sweep_task_trains_on_cpu_requeues_on_usr1_and_resumes(sweep):
    """The real chain on CPU: batch shell -> torchrun -> worker; USR1 -> requeue; rerun -> resume."""
    env, tmp = sweep
    grid = Path(env["GRID"])
    grid.write_text("name\twidth\tlr\toptimizer\tseed\nt1\t128\t1e-3\tadam\t3\n")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!{BASH}\necho "scontrol $*" >> {tmp / "scontrol.log"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = dict(
        env, HOME=str(tmp), PATH=f"{bin_dir}:/usr/bin:/bin", PYTHON=sys.executable, SLURM_ARRAY_TASK_ID="0",
        CONFIG=str(REPO / "examples" / "tiny_dense_cpu.yaml"), WANDB_MODE="disabled", SMOKE_CPU="1",
        EXTRA_ARGS="--mock-data --device cpu --seq-length 64 --micro-batch-size 2 --log-interval 1 "
        "--eval-iters 1 --lr-warmup-iters 1 --train-iters 2000 --save-interval 5",
    )
    log = tmp / "first.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([BASH, str(SWEEP)], env=env, cwd=tmp, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while "saved checkpoint" not in log.read_text():
            assert time.time() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=150) != 0
    finally:
        proc.kill()
    assert (tmp / "scontrol.log").read_text().split() == ["scontrol", "requeue", "99"]
    assert "[smoke] ok: 1 rank(s) on 1 node(s)" in log.read_text()
    ckpt = tmp / "runs" / "sweeps" / "mygrid-98" / "t1"  # the requeued task (same array job id) finds it
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 5
    env["EXTRA_ARGS"] = env["EXTRA_ARGS"].replace("--train-iters 2000", f"--train-iters {saved + 2}")
    again = subprocess.run([BASH, str(SWEEP)], env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at iteration {saved}" in again.stdout + again.stderr


# ----------------------------------------------------------------------------- width ladder

LADDER = SLURM / "width_ladder.sh"
PAPER = ["dense-181m", "dense-307m", "dense-457m", "dense-827m", "dense-1.29b"]


def test_width_ladder_dry_run_writes_the_grid_and_prints_the_array_job(tmp_path):
    """slurm/width_ladder.sh --dry-run: the md_paper recipes at their own widths, five matrix LRs around the
    recipes' 1.13e-2 (k=7) each, 8 GPUs a cell; every cell's command resolves to its recipe's model."""
    from megatron_md.training import config as C

    grid = tmp_path / "ladder.tsv"
    env = {"PYTHON": sys.executable, "GRID": str(grid), "MAX_PARALLEL": "4", "SBATCH_ARGS": "--time=12:00:00"}
    p = run(LADDER, ["--dry-run", "--", "--mock-data"], env, bin_dir="/usr/bin:/bin", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    sbatch, smoke, *cells = lines(p)
    i = sbatch.index("sbatch")
    assert sbatch[:i] == [f"GRID={grid}", "GPUS_PER_CELL=8"]
    assert sbatch[i:] == ["sbatch", "--parsable", "--job-name=width-ladder", "--array=0-24%4", "--gpus-per-node=8",
                          "--cpus-per-task=64", "--time=12:00:00", str(SWEEP)]
    assert smoke[-1] == str(SLURM / "smoke.py") and value(smoke, "--nproc-per-node") == "8"
    assert len(cells) == 25
    seen = {}
    for cmd in cells:
        tr, train = split_torchrun(cmd)
        assert value(tr, "--nproc-per-node") == "8"
        args = vars(train_parser().parse_args(train))
        config = args.pop("config")
        cfg, recipe = C.resolve(None, config, args), C.resolve(None, config, {})
        assert (cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.model.ffn_hidden_size,
                cfg.model.init_method_std) == (recipe.model.hidden_size, recipe.model.num_attention_heads,
                                               recipe.model.ffn_hidden_size, recipe.model.init_method_std)
        assert (cfg.optimizer.optimizer, cfg.optimizer.lr, cfg.optimizer.md.embedding_lr) == ("muon_md", 1e-3, 3e-3)
        assert cfg.checkpoint.save.startswith("runs/sweeps/ladder-JOBID/")
        seen.setdefault(Path(config).name, []).append(G.k_label(cfg.optimizer.md.matrix_lr))
    assert sorted(seen) == sorted(f"{m}_muon_md.yaml" for m in PAPER)
    assert all(ks == [5, 6, 7, 8, 9] for ks in seen.values())  # centred on the recipes' own k=7, not the CPU k=12
    assert "--collect runs/sweeps/ladder-JOBID" in p.stderr


def test_width_ladder_submits_and_names_its_output(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!{BASH}\necho "$GRID $GPUS_PER_CELL ${{OUT:-}} $*" > {tmp_path}/sbatch.log\n'
                                    "echo 4242\n")
    (bin_dir / "sbatch").chmod(0o755)
    configs = ",".join(str(REPO / "examples" / "md_paper" / f"{m}_muon_md.yaml") for m in PAPER[:2])
    env = {"PYTHON": sys.executable, "CONFIGS": configs, "K_RANGE": "6:8", "SEEDS": "1,2", "STEPS": "500",
           "GPUS_PER_CELL": "4", "GRID": "runs/grids/wl.tsv"}
    p = run(LADDER, ["--", "--mock-data"], env, bin_dir=f"{bin_dir}:/usr/bin:/bin", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    logged = (tmp_path / "sbatch.log").read_text().split()
    assert logged[:2] == ["runs/grids/wl.tsv", "4"] and "--array=0-11" in logged and "--gpus-per-node=4" in logged
    assert "submitted array job 4242 (12 cells)" in p.stderr and "--collect runs/sweeps/wl-4242" in p.stderr
    assert (tmp_path / "logs").is_dir()
    rows = (tmp_path / "runs" / "grids" / "wl.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["name", "width", "lr", "optimizer", "seed", "config", "extra_args"]
    assert {r.split("\t")[0] for r in rows[1:]} == {
        f"muon_md-w{w}-k{k}-s{s}-wu0-wd0" for w in (512, 768) for k in (6, 7, 8) for s in (1, 2)}
