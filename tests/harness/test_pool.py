"""The pooled gloo worlds the suite runs its commands in (tests/harness/pool.py) leave nothing behind between jobs.

The proof: one case (MoE at EP2, MuonMD, the distributed optimizer in bf16, QK-clip, evaluation, a checkpoint) run
as the first job of a new world, again in the same world after jobs that touch other layouts, optimizers, attention
kernels and a refused load, and once more through the real CLI and torchrun, gives the same losses, gradient norms,
learning rates, logits and saved tensors, bit for bit; and the audit of megatron's and megatron_md's globals finds
nothing changed after any of the jobs.
"""

from __future__ import annotations

import pytest
import torch

from harness.pool import Pool
from mdtest import QUIET, flat_tensors, run_cli, train_records

pytestmark = pytest.mark.multirank

TINY = ["--mock-data", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--log-interval", "1", "--eval-iters", "1", *QUIET]
CASE = ["train", "--model", "tiny-moe", *TINY, "--train-iters", "3", "--nproc-per-node", "2",
        "--expert-model-parallel-size", "2", "--optimizer", "muon_md", "--use-distributed-optimizer", "--bf16",
        "--qk-clip", "--qk-clip-threshold", "0.05",
        # per-parameter optimizer state: megatron's default format saves whole buckets, padding included, and the
        # padding is uninitialised memory (it differs between any two processes)
        "--dist-ckpt-optim-fully-reshardable"]
# Jobs between the two runs of CASE, each leaving its kind of state behind if the reset missed it.
OTHERS = [
    ["--model", "tiny-dense", "--tensor-model-parallel-size", "2", "--optimizer", "manifold_muon", "--geometry",
     "hetero", "--attention-backend", "sdpa", "--attention-dropout", "0.1", "--diagnostics-interval", "1"],
    ["--model", "tiny-dense", "--pipeline-model-parallel-size", "2", "--optimizer", "adam",
     "--use-distributed-optimizer", "--bf16", "--save", "{tmp}/ck-pp2"],
    ["--model", "tiny-gpt2", "--optimizer", "muon", "--qk-clip", "--attention-backend", "local"],
    ["--model", "tiny-moe", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
     "--optimizer", "adam_md", "--md-per-matrix-step"],
]
REFUSED = ["--model", "tiny-dense", "--tensor-model-parallel-size", "2", "--optimizer", "adam",
           "--use-distributed-optimizer", "--bf16", "--load", "{tmp}/ck-pp2"]
COMPARED = ("lm_loss", "grad_norm", "lr", "matrix_lr", "max_logit", "qk_clip_layers", "eval_lm_loss")


def _records(run_dir):
    import json

    recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    out = [{k: v for k, v in r.items() if k in COMPARED or k.startswith(("max_logit/", "moe_"))
            and not k.startswith("moe_expert_load")} for r in recs]
    assert len(train_records(run_dir)) == 3 and all(out)
    return out


def _tensors(ckpt_dir):
    from megatron.core import dist_checkpointing

    return flat_tensors(dist_checkpointing.load_plain_tensors(str(ckpt_dir / "iter_0000003")))


def _same_tensors(a: dict, b: dict) -> None:
    assert set(a) == set(b) and len(a) > 20
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.e2e
def test_a_reused_world_runs_a_case_bit_identically_to_a_fresh_one(tmp_path, mcore_world):
    pool = Pool(tmp_path / "pool")
    runs = {}
    try:
        def case(name):
            out = tmp_path / name
            proc = pool.run([*CASE, "--run-dir", str(out / "run"), "--save", str(out / "ck")], 2)
            assert proc.returncode == 0, proc.stderr[-4000:]
            runs[name] = out

        case("fresh")  # the world's first job
        for i, extra in enumerate(OTHERS):
            args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
            proc = pool.run(["train", *TINY, "--train-iters", "2", "--nproc-per-node", "2", *args,
                             "--run-dir", str(tmp_path / f"other{i}")], 2)
            assert proc.returncode == 0, proc.stderr[-4000:]
        refused = pool.run(["train", *TINY, "--train-iters", "3", "--nproc-per-node", "2",
                            *[a.replace("{tmp}", str(tmp_path)) for a in REFUSED],
                            "--run-dir", str(tmp_path / "refused")], 2)
        assert refused.returncode != 0 and "this run is TP2" in refused.stderr, refused.stderr[-3000:]
        case("reused")  # the same world, after all of the above
        assert pool.restarts == 0 and pool.worlds[2].jobs == len(OTHERS) + 3
        audit = pool.audit()
    finally:
        pool.close()
    cli = tmp_path / "cli"
    run_cli([*CASE, "--run-dir", str(cli / "run"), "--save", str(cli / "ck")], via="cli")
    assert audit == [], sorted({d for _, found in audit for d in found})
    fresh = _records(runs["fresh"] / "run")
    assert sum(r.get("qk_clip_layers", 0) for r in fresh) > 0
    assert _records(runs["reused"] / "run") == fresh
    assert _records(cli / "run") == fresh
    saved = _tensors(runs["fresh"] / "ck")
    _same_tensors(_tensors(runs["reused"] / "ck"), saved)
    _same_tensors(_tensors(cli / "ck"), saved)


def test_a_rank_that_raises_ends_its_world_and_the_next_job_gets_a_new_one(tmp_path):
    """One rank raises before training while the other waits for it in a collective: the job fails (exit 1, the
    traceback in stderr) within the grace period, as torchrun would fail it, and the next job runs in a new world."""
    pool = Pool(tmp_path / "pool", grace_s=2.0)
    args = ["train", "--model", "tiny-dense", *TINY, "--train-iters", "1", "--nproc-per-node", "2",
            "--run-dir", str(tmp_path / "r")]
    try:
        failed = pool.run(args, 2, env={"MDPOOL_RAISE_ON_RANK": "1"})
        assert failed.returncode == 1
        assert "MDPOOL_RAISE_ON_RANK" in failed.stderr and "the world was killed" in failed.stderr
        ok = pool.run(args, 2)
        assert ok.returncode == 0, ok.stderr[-3000:]
        assert pool.restarts == 1
    finally:
        pool.close()
