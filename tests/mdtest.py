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


def run_and_compare(p, opt, ref, steps=4, seed=1, rtol=2e-4, atol=2e-5):
    """``steps`` steps of ``opt`` on ``p`` and of an fp64 reference ``ref`` (``ref.step(G)``, ``ref.W``) on the same
    random gradients: equal at the start (rel 1e-5) and within ``rtol``/``atol`` at the end."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    torch.testing.assert_close(p.detach().double(), ref.W, rtol=1e-5, atol=1e-6)
    for _ in range(steps):
        G = torch.randn(p.shape, generator=gen)
        p.grad = G.clone()
        opt.step()
        ref.step(G)
    torch.testing.assert_close(p.detach().double(), ref.W, rtol=rtol, atol=atol)


class OpCounter:
    """Counts dispatched aten ops by name while active (``with OpCounter() as c: ...; c.ops``);
    ``_local_scalar_dense`` is a tensor value read on the host (a device sync on GPUs)."""

    def __new__(cls):
        import collections

        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = collections.Counter()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        return _Mode()

