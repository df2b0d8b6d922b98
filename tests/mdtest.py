"""Helpers for tests that run the real CLI in subprocesses (torch elastic for >1 rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# How run_cli runs a command: "pool" runs the in-process commands in a persistent gloo world of the run
# (tests/harness/pool.py), "cli" runs every command as a user does, `python -m megatron_md.cli` and, for several
# ranks, torchrun. tests/conftest.py sets "cli" for tests marked e2e and for a whole run with --launch=cli.
LAUNCH = "pool"
POOLED = ("train", "score", "generate", "plan", "params", "recipes")


def run_cli(args: list[str], *, timeout: int = 600, check: bool = True, via: str | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """``megatron-md ARGS``, through the pool or the real CLI (``via``, default LAUNCH); a failed command raises with
    its output unless ``check=False``. ``env``: variables to set for the command (None removes one)."""
    via = via or LAUNCH
    nproc = _nproc(args) if via == "pool" and args and args[0] in POOLED else None
    nproc = nproc if nproc in (1, 2, 4) else None  # the pooled world sizes
    t0 = time.perf_counter()
    if nproc is not None:
        from harness.pool import POOL

        proc = POOL.run(args, nproc, env=env, cwd=REPO, timeout=timeout)
    else:
        full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
            full.pop(k, None)
        for k, v in (env or {}).items():
            full.pop(k, None) if v is None else full.__setitem__(k, v)
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_md.cli", *args],
            cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout,
        )
    _log_launch(args, "pool" if nproc is not None else "cli", time.perf_counter() - t0)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"megatron-md {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def run_tool(script: str, args: list[str], *, nproc: int = 1, timeout: int = 600, check: bool = True,
             via: str | None = None) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` (SCRIPT relative to the repo: a tools/ script, or a test's multi-rank probe, which starts
    no workers of its own) on ``nproc`` ranks: in the pooled world of that size, or a fresh interpreter, under
    torchrun for several ranks (``via``, default LAUNCH)."""
    via = via or LAUNCH
    t0 = time.perf_counter()
    if via == "pool":
        from harness.pool import POOL

        proc = POOL.run(args, nproc, cwd=REPO, timeout=timeout, script=str(REPO / script))
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
            env.pop(k, None)
        launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        proc = subprocess.run([sys.executable, *launcher, script, *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
    _log_launch([script, *args], via, time.perf_counter() - t0)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited {proc.returncode}\n--- stdout\n"
                             f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def _log_launch(args: list[str], via: str, seconds: float) -> None:
    """With MDTEST_LAUNCH_LOG set, one JSON line per command (tools/test_profile.py counts them per test)."""
    path = os.environ.get("MDTEST_LAUNCH_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "cmd": args[0] if args else "", "via": via,
                                "seconds": round(seconds, 3)}) + "\n")


def _nproc(args: list[str]) -> int | None:
    """Ranks the command runs on (None: it cannot be pooled, let the CLI say why)."""
    for i, a in enumerate(args):
        if a == "--nproc-per-node" and i + 1 < len(args):
            return int(args[i + 1]) if args[i + 1].isdigit() else None
        if a.startswith("--nproc-per-node="):
            value = a.split("=", 1)[1]
            return int(value) if value.isdigit() else None
    if args[0] == "train" and "--config" in args:
        from megatron_md.training.config import resolve

        try:
            return resolve(None, args[args.index("--config") + 1], {}).training.nproc_per_node
        except Exception:  # noqa: BLE001 — a bad config is the CLI's to report
            return None
    return 1


def shared_run(args: list[str], *, name: str = "", after=None) -> Path:
    """``run_cli(ARGS)`` once per pytest run, its outputs kept read-only for every case that asks for the same
    arguments (tests/harness/shared.py). ``{out}`` in ARGS stands for the shared directory (``--run-dir
    {out}/run --save {out}/ck``); ``after(out)`` runs before the directory is frozen (to pick the step a resume
    starts from, say). Returns the directory."""
    from harness.shared import shared_dir

    def make(out: Path) -> None:
        run_cli([a.replace("{out}", str(out)) for a in args])
        if after is not None:
            after(out)

    return shared_dir(["run_cli", args, getattr(after, "__qualname__", None)], make, name=name)


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, open(Path(run_dir) / "metrics.jsonl")) if "lm_loss" in r]


def eval_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, open(Path(run_dir) / "metrics.jsonl")) if "eval_lm_loss" in r]


def flat_tensors(tree, prefix: str = "") -> dict:
    """{dotted key: tensor or value} of a nested dict/list (a loaded checkpoint)."""
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        if isinstance(v, (dict, list, tuple)):
            out.update(flat_tensors(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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



# muon_md flags of the layout comparisons (tests/mcore/test_md_layouts.py, tests/test_plugins.py)
MD_LAYOUT_FLAGS = [
    "--optimizer", "muon_md", "--matrix-lr", "0.05", "--lr", "0.01", "--embedding-lr", "0.01",
    "--gains-lr", "0.01", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "1", *QUIET,
]


def md_seed(model: str, *extra: str) -> Path:
    """The layout comparisons' seed checkpoint: muon_md's initial weights (on their spheres) written at world 1,
    so every layout starts from the same weights; made once per pytest run, read-only."""
    out = shared_run(["train", "--model", model, *MD_LAYOUT_FLAGS, *extra, "--train-iters", "0", "--save",
                      "{out}/seed", "--run-dir", "{out}/run"], name=f"md-seed-{model}")
    return out / "seed"
