"""What the lr-sweep tests share: the tiny cells' flags, a small SweepSpec, and reading a results CSV."""

from __future__ import annotations

import csv
from pathlib import Path

from megatron_md.sweep import grid as G

# Tiny cells: ~4 s each on 2 cores, nearly all of it process start-up.
TINY = ["--mock-data", "--device", "cpu", "--seq-length", "16", "--micro-batch-size", "2", "--vocab-size", "512",
        "--eval-iters", "1", "--diagnostics-interval", "0"]


def spec(optimizers=("adamw", "muon", "muon_md"), steps=20, **kw) -> G.SweepSpec:
    kw.setdefault("base", ["--model", "tiny-dense"])
    return G.SweepSpec(widths=kw.pop("widths", [32]), optimizers=list(optimizers), lrs=kw.pop("lrs", 1),
                       seeds=kw.pop("seeds", [1]), steps=steps, extra=kw.pop("extra", list(TINY)), **kw)


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
