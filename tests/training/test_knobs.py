"""The speed, memory and job-control knobs of issue 16, run the way a cluster user runs them (on gloo).

- overlap of the gradient reduce-scatter and parameter all-gather (small buckets, so there are many)
  gives bit-identical losses to no overlap, with MuonMD on the layer-wise distributed optimizer;
- an async save publishes checkpoints that resume bit-identically, and --keep-last-n-checkpoints keeps
  exactly the newest N;
- selective and full recomputation give the same loss and gradients as none, with fewer saved bytes;
- batch-size ramp-up follows megatron-core's calculator; --profile writes a trace; the log line carries
  TFLOP/s, MFU, optimizer ms and peak memory; --exit-duration-in-mins saves and exits 0;
- the MoE knobs (capacity, token dropping, shared expert, z-loss) train and log their losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mdtest import QUIET, run_cli, train_records

SMALL = ["--mock-data", "--micro-batch-size", "1", "--seq-length", "32", "--log-interval", "1", "--eval-iters", "1",
         *QUIET]
DP2_MD = ["--model", "tiny-dense", "--nproc-per-node", "2", "--use-distributed-optimizer", "--bf16",
          "--optimizer", "muon_md", "--train-iters", "4", "--global-batch-size", "4", *SMALL]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "5000"]


def _losses(run_dir) -> list[float]:
    return [r["lm_loss"] for r in train_records(run_dir)]


@pytest.mark.multirank
def test_overlap_matches_and_async_save_resumes_bit_identically(tmp_path):
    run_cli(["train", *DP2_MD, "--run-dir", str(tmp_path / "plain")])
    ck = tmp_path / "ck"
    run_cli(["train", *DP2_MD, *OVERLAP, "--run-dir", str(tmp_path / "overlap"), "--save", str(ck),
             "--save-interval", "1", "--async-save", "--keep-last-n-checkpoints", "2"])
    plain, overlapped = _losses(tmp_path / "plain"), _losses(tmp_path / "overlap")
    assert len(plain) == 4 and overlapped == plain  # bit for bit
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000003", "iter_0000004",
                                                    "latest_checkpointed_iteration.txt"]
    assert all((ck / d / "checksums.json").is_file() for d in ("iter_0000003", "iter_0000004"))
    log = (tmp_path / "overlap" / "train.log").read_text()
    assert "in the background" in log and "published" in log
    # Resume from the background-written iteration 3 (fully parallel load, still overlapping).
    (ck / "latest_checkpointed_iteration.txt").write_text("3\n")
    run_cli(["train", *DP2_MD, *OVERLAP, "--run-dir", str(tmp_path / "resumed"), "--load", str(ck),
             "--ckpt-fully-parallel-load"])
    assert _losses(tmp_path / "resumed") == overlapped[3:]


def test_prune_keeps_newest_and_latest_and_never_touches_partials(tmp_path):
    from megatron_md.training.checkpoints.checkpointing import prune_checkpoints

    for name in ("iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004", "iter_0000005.partial",
                 "iter_0000002.old-17"):
        (tmp_path / name).mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1\n")  # say the newest were never published
    deleted = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in deleted) == ["iter_0000002"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["iter_0000001", "iter_0000002.old-17", "iter_0000003", "iter_0000004", "iter_0000005.partial",
                    "latest_checkpointed_iteration.txt"]


def _saved_bytes_and_grads(granularity, method=None):
    """Loss, parameter gradients and bytes autograd keeps from the forward pass of tiny-dense."""
    from megatron_md.models.builder import build_model
    from megatron_md.training.config import resolve

    cli = {"seq_length": 64, "recompute_granularity": granularity}
    if method:
        cli.update(recompute_method=method, recompute_num_layers=1)
    cfg = resolve("tiny-dense", None, cli)
    torch.manual_seed(0)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    model = build_model(cfg, 4096, cpu=True)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 4096, (2, 64), generator=gen)
    positions = torch.arange(64).expand(2, 64)
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, positions, None, labels=torch.roll(tokens, -1, 1)).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, sum(storages.values())


def test_recomputation_same_loss_and_grads_fewer_saved_bytes(mcore_world):
    base_loss, base_grads, none = _saved_bytes_and_grads(None)
    sizes = {}
    for granularity, method in (("selective", None), ("full", "uniform"), ("full", "block")):
        loss, grads, sizes[granularity, method] = _saved_bytes_and_grads(granularity, method)
        assert loss == base_loss
        assert all(torch.equal(grads[n], base_grads[n]) for n in base_grads), granularity
    # Selective drops the attention scores/probabilities (the s^2 terms); full keeps only layer inputs.
    assert sizes["full", "uniform"] < sizes["selective", None] < none, (sizes, none)
    assert sizes["full", "block"] < sizes["selective", None]


def test_rampup_profile_and_throughput_report(tmp_path):
    run = tmp_path / "run"
    run_cli(["train", "--model", "tiny-dense", *SMALL, "--train-iters", "5", "--global-batch-size", "6",
             "--rampup-batch-size", "2", "2", "8", "--profile", "--profile-step-start", "2",
             "--profile-step-end", "4", "--eval-interval", "1", "--eval-iters", "8", "--run-dir", str(run)])
    recs = train_records(run)
    # The interval timer counts training steps only: each interval's wall time also holds an evaluation of
    # 8 batches of 6 sequences, which the step time must not.
    walls = [b["time"] - a["time"] for a, b in zip(recs, recs[1:])]
    assert all(r["iter_time_ms"] / 1000 < 0.7 * w for r, w in zip(recs[1:], walls)), (walls, recs)
    sizes = [r["global_batch_size"] for r in recs]
    # megatron-core's ramp: START 2 grows by 2 every 8/2 = 4 samples until the target 6.
    assert sizes == [2, 2, 4, 6, 6], sizes
    assert [r["consumed_samples"] for r in recs] == [sum(sizes[: i + 1]) for i in range(5)]
    for r in recs:
        assert r["tflops_per_device"] > 0 and 0 < r["mfu"] < 1 and r["optimizer_ms"] > 0
        assert r["peak_memory_gib"] > 0.05
    line = (run / "train.log").read_text()
    for field in ("TFLOP/s per device:", "MFU:", "optimizer (ms):", "peak memory (GiB):"):
        assert field in line
    trace = run / "profile" / "trace_rank0_steps2-3.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)


def test_exit_duration_saves_and_exits_cleanly(tmp_path):
    ck, run = tmp_path / "ck", tmp_path / "run"
    run_cli(["train", "--model", "tiny-dense", *SMALL, "--train-iters", "50", "--global-batch-size", "1",
             "--exit-duration-in-mins", "1e-6", "--save", str(ck), "--run-dir", str(run)])
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert "--exit-duration-in-mins 1e-06 reached at iteration 1" in (run / "train.log").read_text()


@pytest.mark.e2e
def test_moe_knobs_train_and_log_their_losses(tmp_path):
    run = tmp_path / "run"
    run_cli(["train", "--model", "tiny-moe", *SMALL, "--optimizer", "muon_md", "--train-iters", "2",
             "--global-batch-size", "2", "--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy",
             "position", "--moe-shared-expert-intermediate-size", "64", "--moe-z-loss-coeff", "1e-3",
             "--run-dir", str(run)])
    recs = train_records(run)
    for r in recs:
        assert r["moe_load_balancing_loss"] > 0 and r["moe_z_loss"] > 0
        assert r["moe_expert_load_max"] >= 1.0 >= r["moe_expert_load_min"] >= 0
    log = (run / "train.log").read_text()
    assert "load balancing loss:" in log and "z loss:" in log
    # The shared expert's weights exist and were counted (2 layers x (64x128 + 64x64)).
    assert "770.94K parameters" in log


def test_bad_knob_values_are_refused_before_work_starts(tmp_path):
    from megatron_md.training.config import resolve
    from megatron_md.training.validate import ConfigError, validate_config

    cases = {
        (("overlap_param_gather", True),): "--overlap-param-gather needs --use-distributed-optimizer",
        (("ddp_bucket_size", 100),): "--ddp-bucket-size only matters with --overlap-grad-reduce",
        (("recompute_num_layers", 3), ("recompute_granularity", "full")): "--recompute-num-layers 3 must be",
        (("rampup_batch_size", "3 2 8"), ("global_batch_size", 6)): "--global-batch-size 6 minus START",
        (("rampup_batch_size", "2 x 8"), ("global_batch_size", 6)): "expected three integers",
        (("profile", True), ("profile_step_start", 5), ("profile_step_end", 5)): "--profile-step-start 5",
        (("profile", True), ("profile_ranks", "3")): "--profile-ranks 3",
        (("keep_last_n_checkpoints", 0), ("save", str(tmp_path / "s"))): "--keep-last-n-checkpoints must be >= 1",
        (("async_save", True),): "--async-save needs --save",
        (("moe_z_loss_coeff", 1e-3),): "--moe-z-loss-coeff needs an MoE model",
        (("exit_duration_in_mins", 0.0),): "--exit-duration-in-mins must be > 0",
    }
    for settings, message in cases.items():
        cfg = resolve("tiny-dense", None, {"mock_data": True, **dict(settings)})
        with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
            validate_config(cfg, 1)
    moe = resolve("tiny-moe", None, {"mock_data": True, "moe_expert_capacity_factor": 1.0,
                                     "moe_router_load_balancing_type": "sinkhorn"})
    with pytest.raises(ConfigError, match="--moe-expert-capacity-factor works with"):
        validate_config(moe, 1)
