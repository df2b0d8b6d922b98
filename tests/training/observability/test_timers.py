"""megatron-core's timers and ours at --timing-log-level 0-2, in the log and metrics.jsonl, on a TP2 run (the
MD phases and the Newton-Schulz engine's waits) and a PP2 run (the pipeline's send/recv, Manifold Muon's
solve). Timers read clocks and synchronise the device; they change no number."""

from __future__ import annotations

import pytest
from mdtest import QUIET, run_cli, shared_run, train_records

from megatron_md.mcore.timing import NAMES

RUN = ["train", "--model", "tiny-dense", "--mock-data", "--train-iters", "4", "--global-batch-size", "4",
       "--micro-batch-size", "1", "--seq-length", "32", "--log-interval", "2", "--eval-iters", "1",
       "--nproc-per-node", "2", "--num-workers", "0", *QUIET]
LAYOUTS = {"tp2-muon_md": ["--tensor-model-parallel-size", "2", "--optimizer", "muon_md"],
           "pp2-manifold_muon": ["--pipeline-model-parallel-size", "2", "--optimizer", "manifold_muon"]}


def _timed(layout: str, level: int, option: str = "minmax"):
    args = [*RUN, *LAYOUTS[layout]]
    if level:
        args += ["--timing-log-level", str(level), "--timing-log-option", option]
    out = shared_run([*args, "--run-dir", "{out}/run"], name=f"timers-{layout}-{level}")
    return train_records(out / "run"), (out / "run" / "train.log").read_text()


def _times(rec) -> set[str]:
    return {k[len("time/"):] for k in rec if k.startswith("time/")}


@pytest.mark.multirank
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_levels_add_timers_to_the_log_and_metrics_and_change_no_number(layout):
    plain, plain_log = _timed(layout, 0)
    one, log1 = _timed(layout, 1)
    two, log2 = _timed(layout, 2)
    for recs in (one, two):  # the same run, bit for bit
        assert [(r["lm_loss"], r["grad_norm"]) for r in recs] == [(r["lm_loss"], r["grad_norm"]) for r in plain]
    assert not any(_times(r) for r in plain) and "time across ranks" not in plain_log
    level = dict(NAMES)
    assert all(level[n] <= 1 for r in one for n in _times(r))
    assert {"forward-backward", "optimizer", "optimizer-inner-step", "all-grads-sync"} <= _times(one[-1])
    assert "(min, max) time across ranks (ms):" in log1 and "optimizer-inner-step" in log1
    want = {"forward-compute", "backward-compute", "batch-generator", "md-prepare", "md-orthogonalize", "md-finish"}
    want |= ({"ns-engine-comm-wait"} if layout.startswith("tp2") else {"forward-send", "backward-recv",
                                                                       "manifold-solve"})
    assert want <= _times(two[-1]), want - _times(two[-1])
    assert all(v > 0 for r in two for k, v in r.items() if k.startswith("time/"))


@pytest.mark.multirank
@pytest.mark.e2e
def test_every_rank_through_the_cli(tmp_path):
    """--timing-log-option all: one column per rank in the log, through torchrun."""
    run_cli([*RUN, *LAYOUTS["tp2-muon_md"], "--timing-log-level", "1", "--timing-log-option", "all",
             "--train-iters", "2", "--run-dir", str(tmp_path / "run")])
    log = (tmp_path / "run" / "train.log").read_text()
    assert "times across ranks (ms):" in log and "forward-backward" in log


def test_the_table_s_levels_are_megatron_core_s():
    """A timer's level must match the level megatron-core starts it at (Timers asserts it at run time): the
    table is checked against megatron-core's sources, so an upgrade that moves one fails here, not mid-run."""
    import re

    import megatron.core

    src = "\n".join(p.read_text() for p in __import__("pathlib").Path(megatron.core.__file__).parent.rglob("*.py"))
    theirs = dict(re.findall(r"timers\(\s*'([a-z-]+)',\s*log_level=(\d)", src))
    ours = dict(NAMES)
    # ours, and Megatron-LM's (not megatron-core's) optimizer and batch-generator, which the trainer starts
    mine = {"optimizer", "batch-generator", "md-prepare", "md-orthogonalize", "md-finish", "ns-engine-comm-wait", "manifold-solve",
            "qk-clip"}
    for name, lv in ours.items():
        if name not in mine:
            assert int(theirs[name]) == lv, name
    assert not mine & set(theirs)
