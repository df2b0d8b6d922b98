"""Does a sweep's curve bend? The loss one grid step either side of each optimum, in units of seed noise.

A regime can show where an optimum sits only if the loss rises on both sides of it by more than the seeds
scatter. For every (optimizer, width, warmup, weight decay) curve of a sweep's ``results.csv``: the optimum is
the lowest seed mean among the LRs every seed ran (``results.full_seed_points``); each neighbour's rise is
``mean(neighbour) - mean(optimum)`` with two standard errors of that difference:

- ``se``: unpaired, ``sqrt(s_a²/n_a + s_b²/n_b)`` — the seeds treated as independent at each LR;
- ``se_paired``: of the per-seed differences (the same seed at both LRs shares its initialisation, data order
  and evaluation text, so most of its offset cancels).

``bends`` holds when both neighbours exist and each rises by at least ``2 se`` (the stricter, unpaired one).
The neighbours are the LRs a factor 2 (``STEP``) below and above the optimum, whatever else the curve ran: a
finer point added near the optimum can move the optimum but never shrinks the step the rise is measured over.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from megatron_md.sweep.results import full_seed_points, group_key, loss_kind, loss_of

SIGMAS = 2.0
STEP = 2.0  # one grid step: a factor 2 in LR


def _se_unpaired(a: list[float], b: list[float]) -> float:
    if len(a) < 2 or len(b) < 2:
        return math.nan
    return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def _se_paired(a: dict[int, float], b: dict[int, float]) -> float:
    diffs = [b[s] - a[s] for s in a if s in b]
    return statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) >= 2 else math.nan


def side(opt: dict[int, float], nb: dict[int, float] | None) -> dict | None:
    """The rise from the optimum's per-seed losses ``opt`` to a neighbour's ``nb`` (None: no neighbour)."""
    if nb is None:
        return None
    a, b = list(opt.values()), list(nb.values())
    rise = statistics.fmean(b) - statistics.fmean(a)
    se, sep = _se_unpaired(a, b), _se_paired(opt, nb)
    return {"rise": rise, "se": se, "se_paired": sep,
            "sigmas": rise / se if se > 0 else math.nan, "sigmas_paired": rise / sep if sep > 0 else math.nan}


def curvature(rows: list[dict]) -> list[dict]:
    """One entry per curve: optimum, both neighbours' rises and whether the curve bends (see module doc)."""
    groups = defaultdict(list)
    for r in rows:
        if r.get("status", "ok") in ("ok", "diverged"):
            groups[group_key(r)].append(r)
    out = []
    for key, rs in sorted(groups.items()):
        kind = loss_kind(rs)
        by_lr: dict[float, dict[int, float]] = defaultdict(dict)
        for r in rs:
            by_lr[r["lr"]][r["seed"]] = loss_of(r, kind)
        pts = full_seed_points([(lr, statistics.fmean(s.values()), 0, 0, len(s)) for lr, s in sorted(by_lr.items())])
        lrs = [p[0] for p in pts]
        i = min(range(len(pts)), key=lambda j: pts[j][1])

        def at(lr: float):
            return next((by_lr[x] for x in lrs if math.isclose(x, lr, rel_tol=1e-3)), None)
        lower = side(by_lr[lrs[i]], at(lrs[i] / STEP))
        upper = side(by_lr[lrs[i]], at(lrs[i] * STEP))
        bends = all(s is not None and s["rise"] >= SIGMAS * s["se"] for s in (lower, upper))
        optimizer, width, warmup, wd = key
        out.append({"optimizer": optimizer, "width": width, "warmup": warmup, "weight_decay": wd,
                    "best_lr": lrs[i], "loss": pts[i][1], "seeds": pts[i][4], "loss_kind": kind,
                    "lower": lower, "upper": upper, "bends": bends})
    return out


def _fmt(s: dict | None) -> str:
    if s is None:
        return "— (no LR there that every seed ran)"
    return f"{s['rise']:+.4f} ({s['sigmas']:.1f} SE; paired {s['sigmas_paired']:.1f})"


def curvature_markdown(entries: list[dict]) -> str:
    lines = ["| optimizer | width | best LR | loss (seeds) | rise one step below | rise one step above | bends (≥ 2 SE both sides) |",
             "|---|---:|---:|---|---|---|---|"]
    for e in entries:
        lines.append(f"| {e['optimizer']} | {e['width']} | {e['best_lr']:g} | {e['loss']:.4f} ({e['seeds']}) | "
                     f"{_fmt(e['lower'])} | {_fmt(e['upper'])} | {'**yes**' if e['bends'] else 'no'} |")
    return "\n".join(lines)
