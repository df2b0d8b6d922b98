"""Helpers for tests that run the real CLI in subprocesses (torch elastic for >1 rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_cli(args: list[str], *, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_md.cli", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"megatron-md {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, open(Path(run_dir) / "metrics.jsonl")) if "lm_loss" in r]


def eval_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, open(Path(run_dir) / "metrics.jsonl")) if "eval_lm_loss" in r]


QUIET = ["--wandb-mode", "disabled", "--no-progress-bar"]
