"""Loss parity across parallel layouts (gloo, CPU) from one seed checkpoint.

A seed checkpoint (``--train-iters 0 --save``) is written once at DP1; every layout loads it
with ``--pretrained-checkpoint`` (torch_dist reshards it) and trains on the same global batch.
Step-1 loss must agree to rel 1e-5 across DP1, DP2, TP2, PP2 and EP2. The seeds and the DP1 references are made
once per pytest run and shared by the tests that compare with them (mdtest.shared_run).
"""

from __future__ import annotations

import pytest

from mdtest import QUIET, shared_run, train_records

pytestmark = pytest.mark.multirank

COMMON = [
    "--mock-data", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-2", "--lr-decay-style", "constant", "--log-interval", "1", "--eval-iters", "1", *QUIET,
]


def _seed(tmp_path, model):
    """The seed checkpoint of ``model``: made once per pytest run, read-only."""
    out = shared_run(["train", "--model", model, "--train-iters", "0", "--save", "{out}/seed",
                      "--run-dir", "{out}/run", *COMMON], name=f"layouts-seed-{model}")
    return out / "seed"


def _losses(tmp_path, model, seed, name, nproc, layout):
    """Losses of 2 steps from the seed at ``layout``; a run asked for twice (the DP1 references) runs once."""
    out = shared_run(["train", "--model", model, "--pretrained-checkpoint", str(seed), "--train-iters", "2",
                      "--nproc-per-node", str(nproc), "--run-dir", "{out}/run", *layout, *COMMON],
                     name=f"layouts-{model}-{name}")
    return [r["lm_loss"] for r in train_records(out / "run")]


@pytest.mark.e2e
def test_dense_layouts_agree(tmp_path):
    seed = _seed(tmp_path, "tiny-dense")
    layouts = {
        "dp1": (1, []),
        "dp2": (2, []),
        "tp2": (2, ["--tensor-model-parallel-size", "2"]),
        "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    }
    got = {k: _losses(tmp_path, "tiny-dense", seed, k, n, lay) for k, (n, lay) in layouts.items()}
    ref = got["dp1"]
    for name, losses in got.items():
        assert losses[0] == pytest.approx(ref[0], rel=1e-5), (name, losses, ref)
        # After one Adam step the layouts still agree (reduction order differs a little).
        assert losses[1] == pytest.approx(ref[1], rel=1e-4), (name, losses, ref)


def test_moe_expert_parallel_agrees(tmp_path):
    seed = _seed(tmp_path, "tiny-moe")
    ref = _losses(tmp_path, "tiny-moe", seed, "dp1", 1, [])
    for disp in ("alltoall", "allgather"):
        ep2 = _losses(tmp_path, "tiny-moe", seed, f"ep2-{disp}", 2,
                      ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", disp])
        assert ep2[0] == pytest.approx(ref[0], rel=1e-5), (disp, ep2, ref)
        assert ep2[1] == pytest.approx(ref[1], rel=1e-4), (disp, ep2, ref)


def test_four_rank_combinations(tmp_path):
    """TP2xPP2 (dense) and EP2xTP2 with sequence parallelism (MoE) on 4 gloo ranks."""
    seed = _seed(tmp_path, "tiny-dense")
    ref = _losses(tmp_path, "tiny-dense", seed, "dp1", 1, [])
    got = _losses(tmp_path, "tiny-dense", seed, "tp2pp2", 4,
                  ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                   "--global-batch-size", "4"])
    assert got[0] == pytest.approx(ref[0], rel=1e-5) and got[1] == pytest.approx(ref[1], rel=1e-4)
    seed = _seed(tmp_path, "tiny-moe")
    ref = _losses(tmp_path, "tiny-moe", seed, "dp1", 1, [])
    got = _losses(tmp_path, "tiny-moe", seed, "ep2tp2", 4,
                  ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"])
    assert got[0] == pytest.approx(ref[0], rel=1e-5) and got[1] == pytest.approx(ref[1], rel=1e-4)


def test_optimizer_variants_are_layout_independent(tmp_path):
    """megatron-core Muon (duplicated TP mode) at TP2, and Adam with the distributed optimizer."""
    seed = _seed(tmp_path, "tiny-dense")
    muon = ["--optimizer", "muon", "--muon-tp-mode", "duplicated", "--muon-fp32-matmul-prec", "highest"]
    ref = _losses(tmp_path, "tiny-dense", seed, "muon-dp1", 1, muon)
    tp2 = _losses(tmp_path, "tiny-dense", seed, "muon-tp2", 2, [*muon, "--tensor-model-parallel-size", "2"])
    assert tp2[1] == pytest.approx(ref[1], rel=1e-4)
    assert tp2[1] < tp2[0]
    ref = _losses(tmp_path, "tiny-dense", seed, "adam-dp1", 1, [])
    dist = _losses(tmp_path, "tiny-dense", seed, "adam-distopt", 2, ["--use-distributed-optimizer"])
    assert dist[1] == pytest.approx(ref[1], rel=1e-4)
