"""Resume is exact, non-finite steps never reach the weights, and score reproduces eval."""

from __future__ import annotations

import math
import re

import pytest

from mdtest import QUIET, eval_records, run_cli, train_records

pytestmark = pytest.mark.multirank

BASE = [
    "--model", "tiny-moe", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
    "--log-interval", "1", "--eval-iters", "2", *QUIET,
]


def test_resume_is_bit_identical(tmp_path):
    """4 straight steps == 2 steps + save + resume + 2 steps (EP=2 over 2 ranks)."""
    layout = ["--nproc-per-node", "2", "--expert-model-parallel-size", "2"]
    run_cli(["train", *BASE, *layout, "--train-iters", "4", "--run-dir", str(tmp_path / "straight")])
    ck = tmp_path / "ck"
    run_cli(["train", *BASE, *layout, "--train-iters", "4", "--exit-interval", "2", "--save", str(ck),
             "--run-dir", str(tmp_path / "first")])
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ck / "iter_0000002" / "run_config.yaml").exists()
    run_cli(["train", *BASE, *layout, "--train-iters", "4", "--load", str(ck), "--save", str(ck),
             "--run-dir", str(tmp_path / "second")])
    _check_run_dir(tmp_path / "straight")
    straight = [r["lm_loss"] for r in train_records(tmp_path / "straight")]
    resumed = [r["lm_loss"] for r in train_records(tmp_path / "first")] + [
        r["lm_loss"] for r in train_records(tmp_path / "second")
    ]
    assert len(straight) == 4
    assert resumed == straight  # bit-identical floats
    # The learning rate schedule continued, too.
    lrs = [r["lr"] for r in train_records(tmp_path / "straight")]
    lrs_resumed = [r["lr"] for r in train_records(tmp_path / "first") + train_records(tmp_path / "second")]
    assert lrs == lrs_resumed


def _check_run_dir(run_dir):
    """What a user (and later tooling) finds in every run directory."""
    for name in ("config.yaml", "versions.json", "host.json", "train.log", "metrics.jsonl"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    rec = train_records(run_dir)[-1]
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "tokens_per_s", "skipped", "consumed_samples"):
        assert key in rec, key
    assert rec["tokens_per_s"] > 0
    log = (run_dir / "train.log").read_text()
    assert "runtime: cpu (gloo)" in log and "throughput (tokens/s)" in log


def _score(ck, *extra):
    out = run_cli(["score", "--load", str(ck), *extra]).stdout
    return float(re.search(r"mean token loss: ([0-9.eE+-]+|nan)", out).group(1))


def test_nan_step_is_skipped_and_never_saved(tmp_path):
    common = [*BASE, "--lr-warmup-iters", "0", "--lr-decay-style", "constant"]
    clean, poisoned = tmp_path / "clean", tmp_path / "poisoned"
    run_cli(["train", *common, "--train-iters", "1", "--save", str(clean), "--run-dir", str(tmp_path / "r1")])
    run_cli(["train", *common, "--train-iters", "2", "--inject-nan-at", "2", "--save", str(poisoned),
             "--run-dir", str(tmp_path / "r2")])
    recs = train_records(tmp_path / "r2")
    assert [r["skipped"] for r in recs] == [0, 1]
    assert recs[-1]["skipped_total"] == 1 and recs[-1]["nan"] == 1
    log = (tmp_path / "r2" / "train.log").read_text()
    assert "number of skipped iterations:   1" in log
    # The skipped step changed nothing: same weights as the run that stopped after step 1.
    a, b = _score(clean, "--validation"), _score(poisoned, "--validation")
    assert math.isfinite(b) and a == b


@pytest.mark.e2e
def test_consecutive_non_finite_steps_stop_the_run(tmp_path):
    """Through the real CLI (e2e): the process exits 3 with the reason."""
    proc = run_cli(["train", *BASE, "--train-iters", "6", "--inject-nan-at", "2", "--inject-nan-iters", "5",
                    "--max-consecutive-skips", "3", "--run-dir", str(tmp_path / "r")], check=False)
    assert proc.returncode == 3
    assert "3 consecutive iterations had a non-finite loss" in proc.stderr


def test_score_reproduces_eval_loss(tmp_path):
    ck = tmp_path / "ck"
    run_cli(["train", *BASE, "--nproc-per-node", "2", "--expert-model-parallel-size", "2",
             "--train-iters", "3", "--save", str(ck), "--run-dir", str(tmp_path / "r")])
    final_eval = eval_records(tmp_path / "r")[-1]["eval_lm_loss"]
    assert _score(ck, "--validation") == pytest.approx(final_eval, rel=1e-5)
