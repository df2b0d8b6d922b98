"""slurm/pretrain.sbatch under a fake 2-node job: dry runs, errors, USR1 and requeue, the smoke step for real."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _sbatch.py, beside this file
from _sbatch import (  # noqa: E402
    BASH, EXAMPLE_GRID, PRETRAIN, REPO, SLURM, SWEEP, exported, lines, run, runs, split_torchrun, value,
)


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
