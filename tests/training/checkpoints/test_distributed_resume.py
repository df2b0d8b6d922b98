"""Save, resume and reshard with --use-distributed-optimizer --bf16 (the cluster path), on gloo.

Each source run trains 4 steps straight and saves at step 2 on the way (``--save-interval 2``), so
one run gives both the straight losses and the checkpoint; a resumed run loads it and trains steps
3-4 with the same ``--train-iters`` (same LR schedule).

- same layout: every optimizer resumes bit-identically (Adam in megatron's default
  ``dp_reshardable`` format; the others with the layer-wise optimizer), the MD bases Lion and SOAP with
  the authors' options too, and MuonMD with ``--attention-backend sdpa`` and attention dropout;
- another layout: DP2->DP1, DP1->DP2 and DP2->PP2 continue within rel 1e-5 of the straight run.
  DP2->TP2 and EP2->EP1 change the bf16 arithmetic itself (TP: row-parallel partial sums are rounded
  before they are added, two straight runs from identical weights differ by ~9e-5; EP: experts see
  their tokens in another order), so there the test proves the state instead: a checkpoint loaded at
  the new layout and saved again holds every tensor (weights, fp32 masters, momentum, Adam moments,
  MD gains and their moments, manifold duals) bit for bit as saved;
- a ``dp_reshardable`` distributed-Adam checkpoint loaded at another TP size is refused, naming both
  layouts and the way out.

The full optimizer x layout matrix is marked ``slow`` (``make test-reshard``); the default suite runs
one representative per mechanism.
"""

from __future__ import annotations

import pytest
import torch

from mdtest import QUIET, flat_tensors, run_cli, shared_run, train_records

pytestmark = pytest.mark.multirank

BASE = ["--use-distributed-optimizer", "--bf16", "--mock-data", "--train-iters", "4", "--global-batch-size", "4",
        "--micro-batch-size", "1", "--seq-length", "32", "--log-interval", "1", "--eval-iters", "1", *QUIET]
OPTIMIZERS = {
    "adam": ["--optimizer", "adam"],
    "muon": ["--optimizer", "muon"],
    "muon_md": ["--optimizer", "muon_md"],
    "adam_md": ["--optimizer", "adam_md"],
    # the other MD bases, each with a set of the authors' options (their state: Lion's EMA, a flat gain; SOAP's
    # Kronecker factors and eigenbases, out-projection column gains)
    "lion_md": ["--optimizer", "lion_md", "--md-gains", "flat", "--md-gain-param", "offset", "--md-tangent-grad",
                "--md-normalize-update"],
    "soap_md": ["--optimizer", "soap_md", "--md-sphere", "embed", "--md-gains", "embed", "--md-preserve-init"],
    "manifold_muon": ["--optimizer", "manifold_muon", "--geometry", "hetero"],
    # the authors' remaining options, three runs between them (AdEMAMix's slow EMA and warmups; low-rank gain
    # factors and their moments; split Q/K/V column gains; spheres of each kind; the embedding and head routing)
    "ademamix_md": ["--optimizer", "ademamix_md", "--ademamix-beta3-warmup", "3", "--ademamix-alpha-warmup", "3",
                    "--md-sphere", "rowcol", "--md-gains", "lowrank", "--md-gains-rank", "2",
                    "--no-md-gains-bias-correction", "--md-embedding-sphere", "col", "--md-embedding-gains", "row",
                    "--output-lr", "0.002", "--min-lr-mode", "absolute", "--min-lr", "1e-5"],
    "norm_md": ["--optimizer", "norm_md", "--md-sphere-kind", "spectral", "--md-ball", "--md-split-heads",
                "--md-split-qkv-gains", "--md-gains-no-clamp", "--md-gains-min", "0.01", "--md-gains-beta1", "0.8",
                "--md-gains-beta2", "0.9", "--md-gains-eps", "1e-10", "--md-gains-weight-decay", "0.01",
                "--md-embeddings-base", "muon", "--md-sphere-iters", "5"],
    "muon_md_heads": ["--optimizer", "muon_md", "--md-split-heads-update", "--md-sphere", "equi",
                      "--md-embedding-sphere", "flat", "--md-embedding-gains", "rowcol", "--md-gain-param", "direct",
                      "--md-router-base", "adam"],
    # auto is sdpa on the CPU, so every case above runs torch's SDPA; this one names it and turns attention
    # dropout on, whose masks come from the model-parallel RNG stream the checkpoint carries (same layout only:
    # at another DP size each rank draws other masks)
    "muon_md_sdpa": ["--optimizer", "muon_md", "--attention-backend", "sdpa", "--attention-dropout", "0.1"],
}
SAME_LAYOUT_ONLY = ("muon_md_sdpa",)
LAYOUTS = {
    "dp1": ["--nproc-per-node", "1"],
    "dp2": ["--nproc-per-node", "2"],
    "tp2": ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
    "pp2": ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"],
    "ep2": ["--nproc-per-node", "2", "--expert-model-parallel-size", "2"],
}
FULLY = ["--dist-ckpt-optim-fully-reshardable"]


def _losses(run_dir):
    return [r["lm_loss"] for r in train_records(run_dir)]


def _resume_from_step_2(out):
    assert (out / "ck" / "iter_0000002").is_dir()
    (out / "ck" / "latest_checkpointed_iteration.txt").write_text("2\n")  # resume from step 2, not the final save


def _source(tmp_path, opt, layout, model="tiny-dense", extra=()):
    """Straight 4-step run at ``layout`` that saves at step 2: (losses, checkpoint dir). Computed once per pytest
    run for these arguments (mdtest.shared_run); the checkpoint is read-only."""
    out = shared_run(["train", "--model", model, *BASE, *OPTIMIZERS[opt], *LAYOUTS[layout], *extra,
                      "--save", "{out}/ck", "--save-interval", "2", "--run-dir", "{out}/run"],
                     name=f"distributed-resume-{opt}-{layout}", after=_resume_from_step_2)
    losses = _losses(out / "run")
    assert len(losses) == 4
    return losses, out / "ck"


def _resume(tmp_path, ck, opt, layout, model="tiny-dense", extra=()):
    run = tmp_path / f"resume-{ck.name}-{layout}"
    run_cli(["train", "--model", model, *BASE, *OPTIMIZERS[opt], *LAYOUTS[layout], *extra,
             "--load", str(ck), "--run-dir", str(run)])
    return _losses(run)


def _close(resumed, straight, rel=1e-5):
    assert len(resumed) == len(straight) == 2, (resumed, straight)
    for a, b in zip(resumed, straight):
        assert abs(a - b) <= rel * abs(b), (resumed, straight)


def _roundtrip_through(tmp_path, ck, opt, layout, model="tiny-dense"):
    """Load ``ck`` at ``layout`` and save again without a step: every saved tensor must be unchanged."""
    from megatron.core import dist_checkpointing

    again = tmp_path / f"again-{ck.name}-{layout}"
    # --train-iters 2 ends the run at the loaded iteration: no step, one final save (same LR decay span).
    run_cli(["train", "--model", model, *BASE, *OPTIMIZERS[opt], *LAYOUTS[layout], *FULLY,
             "--train-iters", "2", "--lr-decay-iters", "4", "--load", str(ck), "--save", str(again),
             "--run-dir", str(tmp_path / f"run-again-{ck.name}-{layout}")])
    before = flat_tensors(dist_checkpointing.load_plain_tensors(str(ck / "iter_0000002")))
    after = flat_tensors(dist_checkpointing.load_plain_tensors(str(again / "iter_0000002")))
    assert set(before) == set(after), sorted(set(before) ^ set(after))[:10]
    kinds = {k.split("/")[0].split(".")[0] for k in before}
    assert {"optimizer", "decoder", "embedding"} <= kinds, kinds
    tensors = [k for k in before if isinstance(before[k], torch.Tensor)]
    assert len(tensors) > 20, tensors
    changed = [k for k in tensors if not (before[k].shape == after[k].shape and before[k].equal(after[k]))]
    changed += [k for k in before if k not in tensors and not k.startswith("layout.") and before[k] != after[k]]
    assert not changed, changed


# ----------------------------------------------------------------------------- same layout

@pytest.mark.parametrize("opt", [pytest.param(o, marks=pytest.mark.e2e) if o == "adam" else o for o in OPTIMIZERS])
def test_same_layout_resume_is_bit_identical(tmp_path, opt):
    """The issue's table: save at DP2, resume at DP2, later losses bit-identical (default formats). The adam case
    runs through the real CLI and torchrun (e2e), the others in the pooled worlds."""
    straight, ck = _source(tmp_path, opt, "dp2")
    assert _resume(tmp_path, ck, opt, "dp2") == straight[2:]


# ----------------------------------------------------------------------------- other layouts

RESHARD_DEFAULT = [("muon_md", "dp2", "dp1"), ("adam", "dp2", "pp2"), ("manifold_muon", "dp1", "dp2")]
RESHARD_ALL = [(o, s, d) for o in OPTIMIZERS if o not in SAME_LAYOUT_ONLY
               for s, d in (("dp2", "dp1"), ("dp1", "dp2"), ("dp2", "pp2"))]


@pytest.mark.parametrize(
    "opt,src,dst",
    RESHARD_DEFAULT + [pytest.param(*c, marks=pytest.mark.slow) for c in RESHARD_ALL if c not in RESHARD_DEFAULT],
)
def test_resume_at_another_layout(tmp_path, opt, src, dst):
    straight, ck = _source(tmp_path, opt, src, extra=FULLY)
    _close(_resume(tmp_path, ck, opt, dst, extra=FULLY), straight[2:])


@pytest.mark.parametrize(
    "opt", ["manifold_muon", pytest.param("adam", marks=pytest.mark.slow), pytest.param("muon_md", marks=pytest.mark.slow),
            pytest.param("muon", marks=pytest.mark.slow), pytest.param("adam_md", marks=pytest.mark.slow)]
)
def test_state_survives_a_tp2_reshard_bit_for_bit(tmp_path, opt, mcore_world):
    _, ck = _source(tmp_path, opt, "dp2", extra=FULLY)
    _roundtrip_through(tmp_path, ck, opt, "tp2")


@pytest.mark.parametrize(
    "opt", ["muon_md", pytest.param("adam_md", marks=pytest.mark.slow), pytest.param("muon", marks=pytest.mark.slow)]
)
def test_moe_state_survives_ep2_to_ep1_bit_for_bit(tmp_path, opt, mcore_world):
    """EP2 -> EP1 regroups megatron's expert param groups; every tensor must still come through."""
    _, ck = _source(tmp_path, opt, "ep2", model="tiny-moe", extra=FULLY)
    _roundtrip_through(tmp_path, ck, opt, "dp2", model="tiny-moe")


def test_dp_reshardable_adam_at_another_tp_is_refused(tmp_path):
    _, ck = _source(tmp_path, "adam", "dp1")
    before = sorted((p.relative_to(ck), p.stat().st_size) for p in ck.rglob("*") if p.is_file())
    proc = run_cli(["train", "--model", "tiny-dense", *BASE, *OPTIMIZERS["adam"], *LAYOUTS["tp2"], "--load", str(ck),
                    "--run-dir", str(tmp_path / "refused")], check=False)
    assert proc.returncode != 0
    err = proc.stderr
    assert "saved at TP1 x PP1" in err and "this run is TP2" in err, err[-3000:]
    assert "--dist-ckpt-optim-fully-reshardable" in err and "--no-load-optim" in err
    assert "megatron-md train: error: --load" in err  # a message, not a crash inside the load
    after = sorted((p.relative_to(ck), p.stat().st_size) for p in ck.rglob("*") if p.is_file())
    assert before == after  # a refused load touches nothing


@pytest.mark.slow
def test_distributed_adam_moe_at_another_ep_is_refused(tmp_path):
    """megatron keeps expert params in an Adam of their own only at EP > 1: no mapping, a clear refusal."""
    _, ck = _source(tmp_path, "adam", "ep2", model="tiny-moe", extra=FULLY)
    proc = run_cli(["train", "--model", "tiny-moe", *BASE, *OPTIMIZERS["adam"], *LAYOUTS["dp2"], *FULLY,
                    "--load", str(ck), "--run-dir", str(tmp_path / "refused")], check=False)
    assert proc.returncode != 0
    assert "megatron-md train: error: --load" in proc.stderr and "EP2" in proc.stderr, proc.stderr[-3000:]
    assert "--no-load-optim" in proc.stderr
