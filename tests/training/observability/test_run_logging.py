"""W&B settings of the run directory's logger: each flag when given, else W&B's own environment (WANDB_MODE,
WANDB_PROJECT, WANDB_NAME, WANDB_DIR, ...), else ours; an offline run writes its files without a network and a
resumed run continues the same W&B run."""

from __future__ import annotations

import pytest

from megatron_md.training import config as C
from megatron_md.training.observability.run_logging import WANDB_ID_FILE, RunLogger, wandb_settings


def cfg(**logging):
    c = C.resolve("tiny-dense", None, {})
    for k, v in logging.items():
        setattr(c.logging, k, v)
    return c


def test_flags_win_over_the_environment_which_wins_over_the_defaults(tmp_path):
    run = tmp_path / "my-run"
    assert wandb_settings(cfg().logging, run, {}) == {
        "mode": "offline", "project": "megatron_md", "name": "my-run", "dir": str(run)}
    assert wandb_settings(cfg(wandb_project="p").logging, run, {})["mode"] == "online"  # a project: online
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "envp", "WANDB_NAME": "envn", "WANDB_DIR": "/w"}
    # the reported bug: WANDB_MODE=offline with --wandb-project went online (and failed without an API key)
    assert wandb_settings(cfg(wandb_project="p").logging, run, env) == {
        "mode": "offline", "project": "p", "name": "envn", "dir": "/w"}
    assert wandb_settings(cfg().logging, run, {"WANDB_PROJECT": "envp"})["mode"] == "online"
    flags = cfg(wandb_project="p", wandb_mode="disabled", wandb_exp_name="n", wandb_save_dir="/d").logging
    assert wandb_settings(flags, run, dict(env, WANDB_MODE="online")) == {
        "mode": "disabled", "project": "p", "name": "n", "dir": "/d"}
    assert wandb_settings(cfg().logging, run, {"WANDB_DISABLED": "true"})["mode"] == "disabled"
    assert wandb_settings(cfg(wandb_mode="offline").logging, run, {"WANDB_DISABLED": "true"})["mode"] == "offline"
    assert wandb_settings(cfg().logging, run, {"WANDB_MODE": "dryrun"})["mode"] == "offline"


def test_wandb_mode_offline_with_a_project_logs_offline_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for k in ("WANDB_API_KEY", "WANDB_RUN_ID", "WANDB_NAME", "WANDB_DISABLED"):
        monkeypatch.delenv(k, raising=False)
    wdir = tmp_path / "wandb-files"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wdir))
    monkeypatch.setenv("WANDB_RUN_GROUP", "ladder")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key, no settings file
    run = tmp_path / "run"
    c = cfg(wandb_project="proj", progress_bar=False)
    kw = dict(active=True, runtime_desc="cpu", world_size=1)
    log = RunLogger(run, c, resumed=False, **kw)
    try:
        assert log.wandb is not None, (run / "train.log").read_text()
        assert log.wandb.settings.mode == "offline" and log.wandb.project == "proj"
        assert log.wandb.group == "ladder"  # W&B read WANDB_RUN_GROUP itself
        first = log.wandb.id
        log.log_train({"iteration": 1, "consumed_samples": 8, "iter_time_ms": 1.0, "tokens_per_s": 1.0, "lr": 1e-3,
                       "global_batch_size": 8, "lm_loss": 5.0, "grad_norm": 1.0, "skipped": 0, "nan": 0})
    finally:
        log.close()
    offline = list((wdir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and any(offline[0].glob("*.wandb")), list(wdir.rglob("*"))
    assert (run / WANDB_ID_FILE).read_text().strip() == first
    assert "W&B offline run" in (run / "train.log").read_text()
    again = RunLogger(run, c, resumed=True, **kw)  # a requeued job resumes: the same W&B run
    try:
        assert again.wandb is not None and again.wandb.id == first
    finally:
        again.close()
