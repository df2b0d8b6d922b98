"""QK-clip on the paths users take (gloo, 2 ranks): tensor parallelism gives the clipped run of one rank, and the
distributed optimizer in bf16 resumes a clipped run bit for bit (so the sharded fp32 masters carry the clip)."""

from __future__ import annotations

import pytest

from mdtest import QUIET, run_cli, train_records

pytestmark = pytest.mark.multirank

# τ below the first step's logits (~0.1-5 at these shapes): every layer clips at step 1. Later steps clip where the
# step took a logit back over τ (with QK-norm the clip leaves each layer's largest logit at τ exactly, so not every
# step); each test asserts clips after the first step too.
CLIP = ["--qk-clip", "--qk-clip-threshold", "0.05", "--qk-clip-alpha", "0.4"]
BASE = ["--mock-data", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--log-interval", "1", "--eval-iters", "1", *QUIET]
CASES = {  # (model, optimizer flags): no QK-norm clips QKV rows; tiny-dense's QK-norm clips the norm weights
    "adam-rows": ("tiny-gpt2", ["--optimizer", "adam"]),
    "adam-norms": ("tiny-dense", ["--optimizer", "adam"]),
    "muon-rows": ("tiny-gpt2", ["--optimizer", "muon"]),
    "muon_md-rows": ("tiny-gpt2", ["--optimizer", "muon_md"]),
    "manifold-dgram-rows": ("tiny-gpt2", ["--optimizer", "manifold_muon", "--geometry", "all-dgram"]),
}


def _run(tmp_path, name, model, flags, *extra):
    run_dir = tmp_path / f"run-{name}"
    run_cli(["train", "--model", model, *BASE, *flags, *CLIP, "--run-dir", str(run_dir), *extra])
    return train_records(run_dir)


def _losses(records):
    return [r["lm_loss"] for r in records]


@pytest.mark.parametrize("case", ["muon_md-rows", "adam-rows", pytest.param("adam-norms", marks=pytest.mark.e2e)])
def test_tensor_parallel_clips_like_one_rank(tmp_path, case):
    """TP2 holds half the heads per rank and clips them there: the run equals TP1's (rel 1e-5, fp32). The adam-norms
    case runs through the real CLI and torchrun (e2e)."""
    model, flags = CASES[case]
    steps = ["--train-iters", "4"]
    one = _run(tmp_path, "tp1", model, flags, *steps)
    two = _run(tmp_path, "tp2", model, flags, *steps, "--nproc-per-node", "2", "--tensor-model-parallel-size", "2")
    clipped = [r["qk_clip_layers"] for r in one]
    assert clipped == [r["qk_clip_layers"] for r in two] and clipped[0] == 2 and sum(clipped[1:]) >= 1
    for a, b in zip(_losses(two), _losses(one), strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    for a, b in zip(two, one):  # the logged maxima (before each step's clip) agree too
        assert a["max_logit"] == pytest.approx(b["max_logit"], rel=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_distributed_optimizer_bf16_resume_is_bit_identical(tmp_path, case):
    """DP2, bf16, --use-distributed-optimizer, clipping from the first step: 4 steps straight (saving at 2) against 2 +
    resume + 2; bit-identical losses and logged maxima. A clip that reached only the bf16 weight would be undone by
    the next step's copy from the fp32 master, and the straight run would differ from an unclipped one only
    transiently: for the byte-sharded Adam (megatron's own QK-clip loses the clip there, NVIDIA/Megatron-LM#7382)
    an unclipped run checks that the clip changes the run."""
    model, flags = CASES[case]
    dist = ["--use-distributed-optimizer", "--bf16", "--nproc-per-node", "2", "--train-iters", "4"]
    ck = tmp_path / "ck"
    straight = _run(tmp_path, "straight", model, flags, *dist, "--save", str(ck), "--save-interval", "2")
    (ck / "latest_checkpointed_iteration.txt").write_text("2\n")
    resumed = _run(tmp_path, "resumed", model, flags, *dist, "--load", str(ck))
    assert _losses(resumed) == _losses(straight)[2:]
    assert [r["max_logit"] for r in resumed] == [r["max_logit"] for r in straight][2:]
    # clips before the save (the masters must carry them) and after it (the resumed run must repeat them)
    assert straight[0]["qk_clip_layers"] == 2 and sum(r["qk_clip_layers"] for r in straight[2:]) >= 1
    if case != "adam-rows":
        return
    unclipped_dir = tmp_path / "run-unclipped"
    run_cli(["train", "--model", model, *BASE, *flags, *dist, "--run-dir", str(unclipped_dir)])
    unclipped = train_records(unclipped_dir)
    # the clip shrank the logits the next forward sees (the first step's are measured before any clip)
    assert straight[0]["max_logit"] == unclipped[0]["max_logit"]
    assert all(c["max_logit"] < u["max_logit"] for c, u in zip(straight[1:], unclipped[1:]))
