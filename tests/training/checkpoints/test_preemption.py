"""Preemption safety: SIGTERM/SIGUSR1 save and exit 0, the requeued run resumes exactly, and a kill
during a save leaves the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_md.training.checkpoints.preemption import SAVE_DELAY_ENV, PreemptionWatch
from mdtest import QUIET, REPO, run_cli, train_records

# Constant LR and a long nominal horizon: runs stopped early by a signal or --exit-interval share the
# same schedule and data order, so their losses can be compared bit for bit.
RUN = ["--model", "tiny-dense", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
       "--global-batch-size", "4", "--log-interval", "1", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
       "--train-iters", "400", "--eval-iters", "1", *QUIET]


def _start(args, env_extra=None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        env.pop(k, None)
    # own session: a "node failure" below kills the whole process group (checkpoint writer helpers too)
    return subprocess.Popen([sys.executable, "-m", "megatron_md.cli", "train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for(cond, proc, what, timeout=240):
    t0 = time.time()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"process exited {proc.returncode} before {what}:\n{proc.stdout.read()[-4000:]}")
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _n_records(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    return sum(1 for line in f.read_text().splitlines() if '"lm_loss"' in line) if f.exists() else 0


def _losses(run_dir):
    return [r["lm_loss"] for r in train_records(run_dir)]


def test_watch_records_the_first_signal_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    watch = PreemptionWatch()
    assert watch.poll() == 0
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal while stopping is ignored, not fatal
    assert watch.poll() == signal.SIGUSR1
    watch.restore()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert PreemptionWatch(enabled=False).poll() == 0 and signal.getsignal(signal.SIGTERM) != watch._handler


# The cluster path: megatron-core's layer-wise distributed optimizer (bf16 only) with MuonMD.
DISTOPT = ["--optimizer", "muon_md", "--use-distributed-optimizer", "--bf16"]


@pytest.mark.multirank
@pytest.mark.parametrize("opt", [[], pytest.param(DISTOPT, marks=pytest.mark.e2e)], ids=["adam", "muon_md-distopt-bf16"])
def test_sigterm_saves_exits_0_and_the_relaunch_continues_identically(tmp_path, opt):
    """The signalled run is always the real CLI under torchrun; the requeued and straight runs are too in the e2e
    case (muon_md), and run in the pooled worlds in the other."""
    ck, first = tmp_path / "ck", tmp_path / "run-first"
    proc = _start([*RUN, *opt, "--nproc-per-node", "2", "--save", str(ck), "--run-dir", str(first)])
    _wait_for(lambda: _n_records(first) >= 2, proc, "two logged iterations")
    proc.send_signal(signal.SIGTERM)  # to the launching process, as SLURM or a user would
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    assert "preempted by SIGTERM" in out
    stopped = int((ck / "latest_checkpointed_iteration.txt").read_text())
    before = _losses(first)
    assert len(before) == stopped and 2 <= stopped < 400
    log = (first / "train.log").read_text()
    assert f"received SIGTERM at iteration {stopped}" in log and "eval_lm_loss" not in (first / "metrics.jsonl").read_text()
    # The requeued job: same command, --load pointing at the same directory.
    end = stopped + 3
    resumed = tmp_path / "run-resumed"
    run_cli(["train", *RUN, *opt, "--nproc-per-node", "2", "--save", str(ck), "--load", str(ck),
             "--exit-interval", str(end), "--run-dir", str(resumed)])
    assert int((ck / "latest_checkpointed_iteration.txt").read_text()) == end  # the requeued job saves again
    straight = tmp_path / "run-straight"
    run_cli(["train", *RUN, *opt, "--nproc-per-node", "2", "--exit-interval", str(end), "--run-dir", str(straight)])
    assert before + _losses(resumed) == _losses(straight)


def test_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    ck, run = tmp_path / "ck", tmp_path / "run-killed"
    args = [*RUN, "--save", str(ck), "--save-interval", "2", "--exit-interval", "6"]
    proc = _start([*args, "--run-dir", str(run)], {SAVE_DELAY_ENV: "4:120"})
    partial = ck / "iter_0000004.partial"
    _wait_for(lambda: partial.is_dir() and any(partial.iterdir()) and
              (ck / "latest_checkpointed_iteration.txt").exists(), proc, "the save of iteration 4")
    time.sleep(0.5)  # inside the hook's sleep: the shards of iteration 4 are on disk, not yet published
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (ck / "iter_0000004").exists() and (ck / "iter_0000002").is_dir()
    resumed = tmp_path / "run-resumed"
    out = run_cli(["train", *args, "--load", str(ck), "--run-dir", str(resumed)]).stdout
    assert "iter_0000002" in out
    straight = tmp_path / "run-straight"
    run_cli(["train", *RUN, "--exit-interval", "6", "--run-dir", str(straight)])
    assert _losses(run)[:2] + _losses(resumed) == _losses(straight)
    assert not partial.exists() and (ck / "iter_0000006").is_dir()  # the next save cleared the leftover
