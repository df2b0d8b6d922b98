"""Megatron-LM's process knobs: --manual-gc (--manual-gc-interval, --manual-gc-eval), --empty-unused-memory-level,
--deterministic-mode, --calculate-per-token-loss and --distributed-timeout-minutes."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from mdtest import QUIET, run_cli, shared_run, train_records

DP2 = ["train", "--model", "tiny-dense", "--nproc-per-node", "2", "--mock-data", "--train-iters", "3",
       "--global-batch-size", "4", "--micro-batch-size", "1", "--seq-length", "24", "--log-interval", "1",
       "--eval-iters", "1", "--adam-beta2", "0.95", "--lr-decay-style", "cosine", *QUIET]  # the settings it was written with


def _knobs(**kw):
    base = dict(manual_gc=False, manual_gc_interval=0, manual_gc_eval=True, empty_unused_memory_level=0,
                deterministic_mode=False)
    return SimpleNamespace(**{**base, **kw})


def test_manual_gc_collects_on_its_schedule_and_puts_the_collector_back(monkeypatch):
    from megatron_md.training.housekeeping import Housekeeping

    assert gc.isenabled()
    hk = Housekeeping(_knobs(manual_gc=True, manual_gc_interval=2, deterministic_mode=True), cuda=False)
    try:
        assert not gc.isenabled() and torch.are_deterministic_algorithms_enabled()
        assert hk.collections == 1  # once at the start, as Megatron-LM does
        for it in range(1, 6):
            hk.after_forward_backward()
            hk.after_step(it)
        assert hk.collections == 3  # steps 2 and 4
        hk.around_evaluation()
        hk.around_evaluation()
        assert hk.collections == 5
        assert hk.emptied == 0  # no knob, no CUDA
        assert "collecting every 2 steps and around each evaluation" in hk.describe()
        assert "deterministic algorithms on" in hk.describe()
    finally:
        hk.close()
    assert gc.isenabled() and not torch.are_deterministic_algorithms_enabled()
    quiet = Housekeeping(_knobs(manual_gc=True, manual_gc_eval=False), cuda=False)
    quiet.after_step(4)
    quiet.around_evaluation()
    quiet.close()
    assert quiet.collections == 1 and "never between steps" in quiet.describe()
    assert Housekeeping(_knobs(), cuda=False).describe() is None


def test_empty_unused_memory_levels_follow_megatron_lm(monkeypatch):
    from megatron_md.training.housekeeping import Housekeeping

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    for level, per_step in ((0, 0), (1, 1), (2, 2)):
        emptied.clear()
        hk = Housekeeping(_knobs(empty_unused_memory_level=level), cuda=True)
        hk.after_forward_backward()  # level 1: here
        hk.after_step(1)  # level 2: here too
        assert len(emptied) == hk.emptied == per_step
    cpu = Housekeeping(_knobs(empty_unused_memory_level=2), cuda=False)
    cpu.after_forward_backward()
    cpu.after_step(1)
    assert cpu.emptied == 0 and "nothing to empty" in cpu.describe()


def test_the_timeout_reaches_both_kinds_of_process_group(monkeypatch):
    from megatron.core import parallel_state as ps

    import megatron_md.runtime.distributed as rd
    from megatron_md.training import build
    from megatron_md.training.config import resolve

    seen = {}
    monkeypatch.setattr(rd, "init_distributed", lambda rt, timeout_s: seen.setdefault("default", timeout_s))
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(ps, "initialize_model_parallel", lambda **kw: seen.setdefault("megatron", kw))
    monkeypatch.setattr(build, "seed_everything", lambda seed: None)
    monkeypatch.setattr("megatron_md.runtime.activate", lambda rt: None)  # no CPU bridges in the test process
    build.setup_parallel(resolve("tiny-dense", None, {"mock_data": True, "distributed_timeout_minutes": 2.5,
                                                      "device": "cpu"}))
    assert seen["default"] == 150 and seen["megatron"]["distributed_timeout_minutes"] == 2.5


def _plain():
    out = shared_run([*DP2, "--run-dir", "{out}/run"], name="housekeeping-plain")
    return train_records(out / "run")


@pytest.mark.multirank
@pytest.mark.e2e
def test_gc_deterministic_and_memory_knobs_change_no_number_and_say_what_is_on(tmp_path):
    """On 2 ranks through torchrun: manual gc, deterministic kernels and the (CPU no-op) memory level train
    bit-identically to a plain run, and the log says what is on."""
    run_cli([*DP2, "--manual-gc", "--manual-gc-interval", "1", "--deterministic-mode", "--empty-unused-memory-level",
             "2", "--distributed-timeout-minutes", "1", "--run-dir", str(tmp_path / "run")])
    recs, plain = train_records(tmp_path / "run"), _plain()
    assert [r["lm_loss"] for r in recs] == [r["lm_loss"] for r in plain]
    assert [r["grad_norm"] for r in recs] == [r["grad_norm"] for r in plain]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "--manual-gc: automatic garbage collection off; collecting every 1 steps" in log
    assert "--deterministic-mode: torch's deterministic algorithms on" in log


@pytest.mark.multirank
def test_per_token_loss_on_equal_micro_batches_matches_the_mean_of_means(tmp_path):
    """Per-token loss at DP2 on micro-batches of equal token counts: the same losses and gradient norms to fp32
    rounding (a wrong 1/DP or 1/tokens scaling would change the norm by a whole factor), but not bit for bit: the
    sum over 96 tokens is divided once instead of each micro-batch's 24 (not powers of two, so the roundings
    differ), which shows the other path ran."""
    run_cli([*DP2, "--calculate-per-token-loss", "--run-dir", str(tmp_path / "run")])
    recs, plain = train_records(tmp_path / "run"), _plain()
    assert len(recs) == len(plain) == 3
    for a, b in zip(recs, plain):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert any(a["grad_norm"] != b["grad_norm"] for a, b in zip(recs, plain))
