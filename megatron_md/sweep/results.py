"""``results.csv`` (one row per finished cell, rebuilt from the cells' result.json) and ``optima.csv``
(per optimizer x width, and warmup x weight decay when those are swept: the best LR)."""

from __future__ import annotations

import csv
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

from megatron_md.sweep.grid import k_of_lr
from megatron_md.sweep.runner import RESULT, load_result

RESULT_COLUMNS = ["optimizer", "width", "params", "lr", "k", "seed", "warmup", "weight_decay", "steps",
                  "final_train_loss", "final_eval_loss", "diverged", "wall_s", "cell", "status"]
OPTIMA_COLUMNS = ["optimizer", "width", "warmup", "weight_decay", "best_lr", "best_k", "loss", "loss_kind",
                  "seeds", "n_lrs", "lr_min", "lr_max", "inside_grid"]


def collect(out: Path) -> list[dict]:
    """Every cell's result.json under OUT/cells, sorted."""
    rows = []
    for path in sorted((Path(out) / "cells").glob(f"*/{RESULT}")):
        res = load_result(path)
        if res is not None:
            rows.append({c: res.get(c) for c in RESULT_COLUMNS})
    rows.sort(key=lambda r: (r["optimizer"], r["warmup"], r["weight_decay"], r["width"], r["lr"], r["seed"]))
    return rows


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> Path:
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two sweeps may share one --out
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_cell(r.get(c)) for c in columns])
    tmp.replace(path)
    return path


def read_csv(path: Path) -> list[dict]:
    """results.csv back into typed rows."""
    ints = {"width", "params", "seed", "warmup", "steps"}
    floats = {"lr", "k", "weight_decay", "final_train_loss", "final_eval_loss", "wall_s"}
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            r = {}
            for k, v in raw.items():
                if v == "" or v is None:
                    r[k] = None
                elif k in ints:
                    r[k] = int(float(v))
                elif k in floats:
                    r[k] = float(v)
                elif k == "diverged":
                    r[k] = v.lower() == "true"
                else:
                    r[k] = v
            rows.append(r)
    return rows


def loss_of(row: dict, kind: str) -> float:
    """The row's final loss of this kind; +inf for a diverged cell (it never wins)."""
    v = row.get("final_eval_loss" if kind == "eval" else "final_train_loss")
    if row.get("diverged") or v is None or not math.isfinite(v):
        return math.inf
    return v


def group_key(row: dict) -> tuple:
    return row["optimizer"], row["width"], row["warmup"], row["weight_decay"]


def loss_kind(rows: list[dict]) -> str:
    """eval when every run that finished has an eval loss, else train."""
    ok = [r for r in rows if not r.get("diverged")]
    return "eval" if ok and all(r.get("final_eval_loss") is not None for r in ok) else "train"


def curves(rows: list[dict]) -> dict:
    """(optimizer, width, warmup, wd) -> (kind, [(lr, mean, min, max, n_seeds)] sorted by lr)."""
    groups = defaultdict(list)
    for r in rows:
        groups[group_key(r)].append(r)
    out = {}
    for key, rs in groups.items():
        kind = loss_kind(rs)
        by_lr = defaultdict(list)
        for r in rs:
            by_lr[r["lr"]].append(loss_of(r, kind))
        pts = []
        for lr in sorted(by_lr):
            ls = by_lr[lr]
            mean = sum(ls) / len(ls) if all(math.isfinite(x) for x in ls) else math.inf
            finite = [x for x in ls if math.isfinite(x)]
            pts.append((lr, mean, min(finite, default=math.inf), max(finite, default=math.inf), len(ls)))
        out[key] = (kind, pts)
    return out


def full_seed_points(pts: list[tuple]) -> list[tuple]:
    """The points of a curve that every one of its seeds ran; optima are chosen among these only.

    A seed's offset is shared across LRs (at width 512 seed 2 lost 0.01-0.03 to seed 1 at every LR), so a
    mean over fewer seeds is not comparable with one over all of them: an LR that only the better seed
    ran would win on the seed, not the LR.
    """
    n = max((p[4] for p in pts), default=0)
    return [p for p in pts if p[4] == n]


def sweep_curves(spec, rows: list[dict]) -> dict:
    """The curves of ``spec``'s own cells among ``rows``, each cut to the points every seed ran (what
    ``SweepSpec.extend_edges`` reads)."""
    mine = {c.name for c in spec.cells()}
    return {key: full_seed_points(pts) for key, (_, pts) in curves([r for r in rows if r.get("cell") in mine]).items()}


def optima(rows: list[dict]) -> list[dict]:
    out = []
    for key, (kind, pts) in sorted(curves(rows).items()):
        opt, width, warmup, wd = key
        pts = full_seed_points(pts)
        lrs = [p[0] for p in pts]
        best = min(pts, key=lambda p: p[1])
        found = math.isfinite(best[1])
        out.append({
            "optimizer": opt, "width": width, "warmup": warmup, "weight_decay": wd,
            "best_lr": best[0] if found else None,
            "best_k": _k(best[0]) if found else None,
            "loss": best[1] if found else None, "loss_kind": kind,
            "seeds": max(p[4] for p in pts), "n_lrs": len(lrs), "lr_min": min(lrs), "lr_max": max(lrs),
            "inside_grid": found and min(lrs) < best[0] < max(lrs),
        })
    return out


def _k(lr: float):
    k = round(k_of_lr(lr), 3)
    return int(k) if k == int(k) else k


def transfer_summary(best: list[dict]) -> list[str]:
    """One line per optimizer: its best k per width and how far it moves."""
    by = defaultdict(list)
    for r in best:
        by[(r["optimizer"], r["warmup"], r["weight_decay"])].append(r)
    lines = []
    for (opt, wu, wd), rs in sorted(by.items()):
        ks = [(r["width"], r["best_k"], r["inside_grid"]) for r in sorted(rs, key=lambda r: r["width"])]
        shown = ", ".join(f"w{w}: k={k:g}{'' if inside else ' (grid edge)'}" if k is not None else f"w{w}: all diverged"
                          for w, k, inside in ks)
        finite = [k for _, k, _ in ks if k is not None]
        shift = f"; shift {max(finite) - min(finite):g} grid steps" if len(finite) > 1 else ""
        lines.append(f"{opt} (warmup {wu}, wd {wd:g}): {shown}{shift}")
    return lines


def write_all(out: Path, log: Optional[Callable[[str], None]] = None) -> tuple[Path, Path, list[dict]]:
    """Rewrite OUT/results.csv and OUT/optima.csv from the cells' result.json files."""
    out = Path(out)
    rows = collect(out)
    res = write_csv(out / "results.csv", rows, RESULT_COLUMNS)
    best = optima(rows)
    opt = write_csv(out / "optima.csv", best, OPTIMA_COLUMNS)
    if log is not None:
        for line in transfer_summary(best):
            log(f"[lr-sweep] optimum {line}")
    return res, opt, rows
