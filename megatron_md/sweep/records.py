"""Summaries and claim verdicts of the CPU records kept under ``records/<date>-<name>/``.

Kinds of record, found by the end of their directory name (the newest date wins; a record holding an
``IN_PROGRESS`` file is passed over):

- ``*-lr-transfer``: one ``lr-sweep`` over widths x optimizers x LRs x seeds (``results.csv``); ``*-moe-lr-transfer``
  the same on an MoE model, with its expert-count axis and diagnostics in ``moe_records.py``;
- ``*-md-ablations``: one ``lr-sweep`` per MuonMD variant at one width, ``variants/<name>/results.csv``;
- ``*-manifold-geometry``: one ``lr-sweep`` per geometry preset and LR set,
  ``<set>/<preset>/results.csv`` with the cells' ``metrics.jsonl`` (spectra, max attention logit).

A claim "A < B" (lower loss is better) is judged from the seed means at each side's best LR:
held when B - A > 2 x the standard error of the difference, not held when A - B exceeds it,
inconclusive otherwise or with a single seed. Standard library only (the README renderer uses it).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_md.sweep.grid import k_of_lr
from megatron_md.sweep.results import group_key, loss_kind, loss_of, read_csv

HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"
PRESETS = ("unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv", "hetero-md")
DGRAM_ATTENTION = ("all-dgram", "hetero-inv")  # presets whose attention is DGram-constrained
STIEFEL_ATTENTION = ("all-stiefel", "hetero", "hetero-md")
STIEFEL_TOL = 1e-2  # |sigma_max - 1| a Stiefel-constrained matrix may show (fp32 polar retraction)
SPIKE_NATS = 1.0  # a logged train loss this far above its running minimum counts as a loss spike


RESULTS_GLOB = {"lr-transfer": "results.csv", "md-ablations": "variants/*/results.csv",
                "manifold-geometry": "*/*/results.csv", "regime-probe": "results.csv",
                "qk-clip": "*/*/results.csv",  # qk-clip: tables and claims in qk_clip_records.py
                "moe-lr-transfer": "results.csv"}  # its expert axis and diagnostics: moe_records.py


def kind_of(name: str) -> Optional[str]:
    """The kind a record directory's name ends with; the longest wins (``…-moe-lr-transfer`` is not an
    ``lr-transfer`` record)."""
    return max((k for k in RESULTS_GLOB if name.endswith("-" + k)), key=len, default=None)


# A record still being run (over several sessions) holds this file, saying what is left: its cells are kept as
# they finish, but no README table or claim reads it until the file is removed.
IN_PROGRESS = "IN_PROGRESS"

# The manifold paper's DGram-attention run diverged near step 15k of a 50k-step cosine, the LR still ~80% of its
# peak: a run that got that far at half its peak LR or more without diverging counts against the claim.
PAPER_DIVERGENCE_STEP = 15000
PAPER_LR_FRACTION_MIN = 0.5


def in_progress(rec: Path) -> bool:
    return (Path(rec) / IN_PROGRESS).exists()


def finished(repo: Path, kind: str) -> list[Path]:
    """Every finished ``records/*-<kind>`` directory that holds results, oldest first (by its dated name)."""
    return sorted(p for p in (Path(repo) / "records").glob(f"*-{kind}")
                  if kind_of(p.name) == kind and any(p.glob(RESULTS_GLOB[kind])) and not in_progress(p))


# A manifold record's sets (an LR, a length, a schedule) are experiments of their own, not reruns of an older
# record's, so every finished one is shown and judged; the other kinds only on their newest record.
EVERY_RECORD_JUDGED = ("manifold-geometry",)


def judged(repo: Path, kind: str) -> list[Path]:
    """The finished records of a kind that the README shows and judges, newest first."""
    found = finished(repo, kind)
    return found[::-1] if kind in EVERY_RECORD_JUDGED else found[-1:]


def latest(repo: Path, kind: str) -> Optional[Path]:
    """The newest finished ``records/*-<kind>`` directory that holds results, or None."""
    found = finished(repo, kind)
    return found[-1] if found else None


# ----------------------------------------------------------------------------- LR curves


@dataclass
class Best:
    """One curve's best LR: seed mean and sample std of the loss there."""

    optimizer: str
    width: int
    warmup: int
    weight_decay: float
    lr: Optional[float]
    k: Optional[float]
    mean: float
    std: float
    n: int
    inside: bool  # the best LR is strictly inside the swept range
    n_lrs: int
    kind: str
    lrs: list = field(default_factory=list)
    # k of the minimum of the parabola through the best LR and its two neighbours (seed means); None on an edge.
    # On a grid coarser than the √2 ladder it places the optimum between grid points.
    vertex_k: Optional[float] = None
    spacing: Optional[float] = None  # smallest k step between the LRs every seed ran

    @property
    def se(self) -> float:
        return self.std / math.sqrt(self.n) if self.n > 1 else math.nan


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return math.nan
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def best_per_curve(rows: list[dict]) -> dict[tuple, Best]:
    """(optimizer, width, warmup, wd) -> its Best (a diverged seed makes that LR lose)."""
    groups = defaultdict(list)
    for r in rows:
        groups[group_key(r)].append(r)
    out = {}
    for key, rs in groups.items():
        kind = loss_kind(rs)
        by_lr = defaultdict(list)
        for r in rs:
            by_lr[r["lr"]].append(loss_of(r, kind))
        full = max(len(v) for v in by_lr.values())
        lrs = sorted(lr for lr, v in by_lr.items() if len(v) == full)  # see results.full_seed_points
        means = {lr: (sum(v) / len(v) if all(math.isfinite(x) for x in v) else math.inf) for lr, v in by_lr.items()}
        lr = min(lrs, key=lambda x: means[x])
        found = math.isfinite(means[lr])
        k = round(k_of_lr(lr), 3) if found else None
        inside = found and lrs[0] < lr < lrs[-1]
        ks = [k_of_lr(x) for x in lrs]
        vertex = None
        if inside:
            i = lrs.index(lr)
            vertex = parabola_vertex([(ks[j], means[lrs[j]]) for j in (i - 1, i, i + 1)])
        out[key] = Best(*key, lr=lr if found else None, k=k, mean=means[lr], std=_std(by_lr[lr]) if found else math.nan,
                        n=len(by_lr[lr]), inside=inside, n_lrs=len(lrs), kind=kind, lrs=lrs,
                        vertex_k=None if vertex is None else round(vertex, 3),
                        spacing=round(min(b - a for a, b in zip(ks, ks[1:])), 3) if len(ks) > 1 else None)
    return out


def parabola_vertex(points: list[tuple[float, float]]) -> Optional[float]:
    """x of the extremum of the parabola through three (x, y) points; None when they are collinear or a
    neighbour is not finite."""
    (a, fa), (b, fb), (c, fc) = points
    if not all(math.isfinite(f) for f in (fa, fb, fc)):
        return None
    den = (b - a) * (fb - fc) - (b - c) * (fb - fa)
    if den == 0:
        return None
    return b - 0.5 * ((b - a) ** 2 * (fb - fc) - (b - c) ** 2 * (fb - fa)) / den


def compare(a: Best, b: Best) -> tuple[str, float, float]:
    """Verdict on "a's loss < b's", the gap b - a, and its 2-sigma noise band."""
    if not (math.isfinite(a.mean) and math.isfinite(b.mean)):
        if math.isfinite(a.mean) != math.isfinite(b.mean):
            return (HELD if math.isfinite(a.mean) else NOT_HELD), math.inf, math.nan
        return INCONCLUSIVE, math.nan, math.nan
    gap = b.mean - a.mean
    noise = 2.0 * math.sqrt(a.se ** 2 + b.se ** 2)
    if not math.isfinite(noise):
        return INCONCLUSIVE, gap, noise
    if gap > noise:
        return HELD, gap, noise
    if -gap > noise:
        return NOT_HELD, gap, noise
    return INCONCLUSIVE, gap, noise


def combine(verdicts: list[str]) -> str:
    """Several comparisons behind one claim: all held -> held; any not held -> not held."""
    if verdicts and all(v == HELD for v in verdicts):
        return HELD
    if any(v == NOT_HELD for v in verdicts):
        return NOT_HELD
    return INCONCLUSIVE


# ----------------------------------------------------------------------------- the records


def lr_transfer(record: Path) -> dict[str, dict[int, Best]]:
    """optimizer -> width -> Best, for the sweep's own recipe of each optimizer."""
    out: dict[str, dict[int, Best]] = defaultdict(dict)
    for (opt, width, _, _), b in best_per_curve(read_csv(Path(record) / "results.csv")).items():
        if width in out[opt]:
            raise ValueError(f"{record}/results.csv: several warmup/weight-decay recipes for {opt} at width {width}")
        out[opt][width] = b
    return dict(out)


def ablations(record: Path) -> dict[str, Best]:
    """variant -> Best, from ``variants/<variant>/results.csv`` (one curve each)."""
    out = {}
    for csv_path in sorted((Path(record) / "variants").glob("*/results.csv")):
        curves = best_per_curve(read_csv(csv_path))
        if len(curves) != 1:
            raise ValueError(f"{csv_path}: expected one width x recipe, found {len(curves)}")
        out[csv_path.parent.name] = next(iter(curves.values()))
    return out


def _diag_series(metrics: Path) -> dict[str, list[tuple[int, float]]]:
    """attention / mlp sigma_max (max over layers and matrices), max_logit (max over layers) per iteration."""
    series: dict[str, list] = defaultdict(list)
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        it = rec.get("iteration")
        got: dict[str, float] = {}
        for key, v in rec.items():
            if not key.startswith("diag/") or not isinstance(v, (int, float)):
                continue
            name = key[len("diag/"):]
            if name.endswith("/sigma_max"):
                kind = "attn_sigma_max" if ".attention." in name else "mlp_sigma_max" if ".mlp." in name else None
            elif name.endswith(".max_logit"):
                kind = "max_logit"
            else:
                kind = None
            if kind:
                got[kind] = max(got.get(kind, -math.inf), v)
        for kind, v in got.items():
            series[kind].append((it, v))
        if "lm_loss" in rec and "eval_lm_loss" not in rec:
            series["lm_loss"].append((it, rec["lm_loss"]))
            if isinstance(rec.get("lr"), (int, float)):
                series["lr"].append((it, rec["lr"]))
    return series


def spike(losses: list[tuple[int, float]], steps: int) -> bool:
    """A non-finite loss, or one SPIKE_NATS above the running minimum after the first 10% of steps."""
    best = math.inf
    for it, v in losses:
        if not math.isfinite(v):
            return True
        if it > 0.1 * steps and v > best + SPIKE_NATS:
            return True
        best = min(best, v)
    return False


@dataclass
class ManifoldRun:
    preset: str
    lr: float
    seed: int
    steps: int
    loss: float  # final eval loss (inf when diverged)
    status: str
    spiked: bool
    first: dict  # kind -> first logged value
    last: dict
    peak: dict
    lr_end_frac: Optional[float] = None  # the LR at the last logged step over its peak (None: not logged)


def manifold_runs(record: Path, set_name: str) -> list[ManifoldRun]:
    out = []
    for csv_path in sorted((Path(record) / set_name).glob("*/results.csv")):
        preset = csv_path.parent.name
        for r in read_csv(csv_path):
            series = _diag_series(csv_path.parent / "cells" / r["cell"] / "metrics.jsonl")
            kinds = [k for k in ("attn_sigma_max", "mlp_sigma_max", "max_logit") if series.get(k)]
            out.append(ManifoldRun(
                preset=preset, lr=r["lr"], seed=r["seed"], steps=r["steps"], loss=loss_of(r, "eval"),
                status=r["status"], spiked=spike(series.get("lm_loss", []), r["steps"]),
                first={k: series[k][0][1] for k in kinds}, last={k: series[k][-1][1] for k in kinds},
                peak={k: max(v for _, v in series[k]) for k in kinds},
                lr_end_frac=_end_fraction(series.get("lr", []))))
    return out


def _end_fraction(points: list[tuple[int, float]]) -> Optional[float]:
    """The last value over the largest (None when nothing, or nothing positive, was logged)."""
    top = max((v for _, v in points), default=0.0)
    return points[-1][1] / top if top > 0 else None


def manifold_sets(record: Path) -> list[str]:
    return sorted(p.name for p in Path(record).iterdir() if p.is_dir() and any(p.glob("*/results.csv")))


def manifold_best(runs: list[ManifoldRun]) -> dict[str, Best]:
    """preset -> the seed statistics of its final eval loss (one LR per set), as a Best."""
    by = defaultdict(list)
    for r in runs:
        by[r.preset].append(r)
    out = {}
    for preset, rs in by.items():
        losses = [r.loss for r in rs]
        finite = all(math.isfinite(x) for x in losses)
        mean = sum(losses) / len(losses) if finite else math.inf
        out[preset] = Best(preset, 64, 0, 0.0, rs[0].lr, None, mean, _std(losses) if finite else math.nan,
                           len(rs), False, 1, "eval")
    return out


# ----------------------------------------------------------------------------- claims


@dataclass
class Claim:
    claim: str
    verdict: str
    evidence: str
    record: str  # the record directory (relative), whose reproduce.sh reruns it


def _fmt(b: Best) -> str:
    return f"{b.mean:.4f}" if math.isfinite(b.mean) else "diverged"


def _gap(name: str, verdict: str, gap: float, noise: float) -> str:
    if not math.isfinite(gap):
        return f"{name}: {verdict}"
    band = f" ± {noise:.4f}" if math.isfinite(noise) else " (one seed)"
    return f"{name} {gap:+.4f}{band}"


def lr_transfer_claims(record: Path, rel: str, scope: str = "") -> list[Claim]:
    """The width claims of an LR-transfer record; ``scope`` prefixes their wording (``"MoE: "``)."""
    best = lr_transfer(record)
    claims = []
    need = ("muon_md", "muon", "adamw")
    if all(o in best for o in need):
        widths = sorted(set.intersection(*(set(best[o]) for o in need)))
        verdicts, parts = [], []
        for w in widths:
            v1, g1, n1 = compare(best["muon_md"][w], best["muon"][w])
            v2, g2, n2 = compare(best["muon"][w], best["adamw"][w])
            verdicts += [v1, v2]
            parts.append(f"w{w}: {_gap('Muon−MuonMD', v1, g1, n1)}, {_gap('AdamW−Muon', v2, g2, n2)}")
        claims.append(Claim(f"{scope}MuonMD < Muon < AdamW in loss at each one's best LR (MuonMD with no warmup and "
                            "no weight decay; the others with both)", combine(verdicts), "; ".join(parts), rel))
    drift = drift_claim(f"{scope}MuonMD's best matrix LR stays within one √2 grid step across width", best, "w", rel)
    return claims + ([drift] if drift else [])


def drift_claim(label: str, best: dict[str, dict[int, Best]], axis: str, rel: str) -> Optional[Claim]:
    """"MuonMD's optimum stays within one √2 step" along one axis (``best``: optimizer -> axis value -> Best;
    ``axis`` names a value in the evidence, ``w`` for width), with how far the other optimizers move."""
    if "muon_md" not in best or len(best["muon_md"]) < 2:
        return None
    curves = [best["muon_md"][x] for x in sorted(best["muon_md"])]
    # On a grid coarser than √2 (k steps of 2: factor-2 LRs) the arg-min moves in whole grid steps, so the
    # optimum is placed by the parabola through the arg-min and its neighbours (decided before those records ran)
    coarse = any((c.spacing or 1) > 1 for c in curves)
    ks = [c.vertex_k if coarse else c.k for c in curves]
    if any(k is None for k in ks) or not all(c.inside for c in curves):
        verdict = INCONCLUSIVE  # an optimum on the grid's edge (or none) is not located
    else:
        verdict = HELD if max(abs(k - ks[0]) for k in ks) <= 1 else NOT_HELD
    values = sorted(best["muon_md"])
    shown = ", ".join((f"{axis}{x}: k={c.k:g}" + (f" (parabola {c.vertex_k:.2f})" if coarse and c.vertex_k
                                                  is not None else "")) if c.k is not None else f"{axis}{x}: none"
                      for x, c in zip(values, curves))
    others = []
    for o in ("adamw", "muon"):
        if o in best and len(best[o]) > 1:
            # measured like MuonMD's: by the parabola's vertex on a coarse grid, so they compare
            oks = [(c.vertex_k if coarse else c.k) for c in (best[o][x] for x in sorted(best[o]))]
            oks = [k for k in oks if k is not None]
            if oks:
                spread = max(oks) - min(oks)
                others.append(f"{o} moves {spread:.2f} steps by the parabola" if coarse
                              else f"{o} moves {spread:g} step{'' if spread == 1 else 's'}")
    return Claim(label, verdict, shown + (" (" + "; ".join(others) + ")" if others else ""), rel)


def same_regime(a: Path, b: Path, width: int) -> bool:
    """Whether two sweep directories trained the same model for as long at ``width``: equal parameter counts
    (architecture and vocabulary) and step counts. A claim across records compares losses only within one
    regime (the first CPU regime's width-64 model has 771k parameters, the second's 313k)."""
    def regime(d: Path) -> set:
        return {(r["params"], r["steps"]) for r in read_csv(d / "results.csv") if r["width"] == width}
    ra = regime(a)
    return bool(ra) and ra == regime(b)


def ablation_claims(record: Path, rel: str, transfer: Optional[Path] = None) -> list[Claim]:
    v = ablations(record)
    claims = []

    def pair(a: str, b: str):
        verdict, gap, noise = compare(v[a], v[b])
        return verdict, _gap(f"{b}−{a}", verdict, gap, noise)

    if {"rowcol", "row", "col", "none"} <= set(v):
        # the paper's order: rowcol <= row, col <= flat (one scalar per matrix) <= none; flat when it was run
        below = ["flat"] if "flat" in v else []
        steps = [("rowcol", "row"), ("rowcol", "col")] + [(a, b) for a in ("row", "col") for b in below or ["none"]]
        steps += [("flat", "none")] if below else []
        r = [pair(a, b) for a, b in steps]
        label = "row-only, col-only ≤ one scalar (flat) ≤ none" if below else "row-only, col-only ≤ none"
        claims.append(Claim(f"Gains: row+col ≤ {label} (sphere without gains)",
                            combine([x[0] for x in r]), "; ".join(x[1] for x in r), rel))
    if {"rowcol", "none"} <= set(v):
        verdict, text = pair("rowcol", "none")
        claims.append(Claim("MuonMD < Muon+sphere (no gains)", verdict, text, rel))
    if transfer is not None and "none" in v:
        width = v["none"].width
        muon = lr_transfer(transfer).get("muon", {}).get(width)
        if muon is not None and same_regime(Path(record) / "variants" / "none", Path(transfer), width):
            verdict, gap, noise = compare(v["none"], muon)
            claims.append(Claim("Muon+sphere (no warmup, no weight decay) < Muon (warmup, weight decay 0.1)", verdict,
                                _gap("Muon−(Muon+sphere)", verdict, gap, noise), rel))
    if {"rowcol", "direct"} <= set(v):
        verdict, text = pair("rowcol", "direct")
        claims.append(Claim("Softplus gains < direct gains", verdict, text, rel))
    if {"rowcol", "warmup-10pct"} <= set(v):
        # "no warmup needed": without warmup is as good (within noise) or better than with it
        verdict, gap, noise = compare(v["warmup-10pct"], v["rowcol"])
        verdict = NOT_HELD if verdict == HELD else HELD if math.isfinite(noise) else INCONCLUSIVE
        claims.append(Claim("MuonMD needs no warmup (0 warmup ≤ 10% warmup, within noise)", verdict,
                            _gap("(no warmup)−(warmup)", verdict, gap, noise), rel))
    if {"rowcol", "wd-0.1"} <= set(v):
        # "no weight decay needed": on the sphere decay only shrinks what the projection restores
        verdict, gap, noise = compare(v["wd-0.1"], v["rowcol"])
        verdict = NOT_HELD if verdict == HELD else HELD if math.isfinite(noise) else INCONCLUSIVE
        claims.append(Claim("MuonMD needs no weight decay (0 ≤ 0.1, within noise)", verdict,
                            _gap("(no decay)−(decay 0.1)", verdict, gap, noise), rel))
    return claims


def manifold_claims(record: Path, rel: str) -> list[Claim]:
    claims = []
    for set_name in manifold_sets(record):
        runs = manifold_runs(record, set_name)
        best = manifold_best(runs)
        if {"hetero", "all-stiefel", "unconstrained"} <= set(best) and min(b.n for b in best.values()) > 1:
            v1, g1, n1 = compare(best["hetero"], best["all-stiefel"])
            v2, g2, n2 = compare(best["all-stiefel"], best["unconstrained"])
            claims.append(Claim(f"HETERO < ALL-STIEFEL < UNCONSTRAINED ({set_name})", combine([v1, v2]),
                                f"{_gap('STIEFEL−HETERO', v1, g1, n1)}; {_gap('UNCONSTR−STIEFEL', v2, g2, n2)}", rel))
        # the module-wise choice against each baseline on its own, so a set without ALL-STIEFEL is judged too
        for other, label in (("all-dgram", "ALL-DGRAM"), ("unconstrained", "UNCONSTRAINED")):
            if {"hetero", other} <= set(best) and min(best["hetero"].n, best[other].n) > 1:
                v, g, n = compare(best["hetero"], best[other])
                claims.append(Claim(f"HETERO < {label} ({set_name})", v,
                                    _gap(f"{label}−HETERO", v, g, n), rel))
        dg = [r for r in runs if r.preset in DGRAM_ATTENTION]
        st = [r for r in runs if r.preset in STIEFEL_ATTENTION]
        if dg and st:
            bad = [r for r in dg if r.status != "ok" or r.spiked]
            steps = max(r.steps for r in dg)
            # Runs that reached the paper's divergence point (~15k steps, the LR still ~80% of its peak) and did
            # not diverge are evidence against the claim at this scale; shorter or decayed runs say nothing.
            ends = [r.lr_end_frac for r in dg]
            reached = all(r.steps >= PAPER_DIVERGENCE_STEP for r in dg) and \
                all(f is not None and f >= PAPER_LR_FRACTION_MIN for f in ends)
            verdict = HELD if bad else NOT_HELD if reached else INCONCLUSIVE
            where = (f", ending at {100 * min(ends):.0f}% of the peak LR or more" if reached else "")
            claims.append(Claim(f"DGram on attention diverges ({set_name})", verdict,
                                f"{len(bad)}/{len(dg)} DGram-attention runs diverged or spiked by step {steps}{where}"
                                + ("" if bad else " (the paper's divergence came at ~15k of 50k steps, the LR ~80% "
                                   "of its peak)"), rel))
            if all("attn_sigma_max" in r.last for r in dg + st):
                grow_dg = min(r.last["attn_sigma_max"] / r.first["attn_sigma_max"] for r in dg)
                grow_st = max(r.last["attn_sigma_max"] / r.first["attn_sigma_max"] for r in st)
                logit_dg = min(r.last.get("max_logit", math.nan) for r in dg)
                logit_st = max(r.last.get("max_logit", math.nan) for r in st)
                verdict = HELD if grow_dg > 1.2 * grow_st and logit_dg > logit_st else NOT_HELD
                claims.append(Claim(f"DGram attention's σ_max and max logit grow, Stiefel's do not ({set_name})",
                                    verdict, f"attention σ_max growth: DGram ≥ {grow_dg:.2f}×, Stiefel ≤ {grow_st:.2f}×; "
                                    f"final max logit: DGram ≥ {logit_dg:.1f}, Stiefel ≤ {logit_st:.1f}", rel))
        if st and all("attn_sigma_max" in r.peak for r in st):
            # Stiefel pins every singular value of the attention matrices at 1
            worst = max(abs(r.peak["attn_sigma_max"] - 1.0) for r in st)
            claims.append(Claim(f"Stiefel keeps attention σ_max at 1 ({set_name})", HELD if worst < STIEFEL_TOL
                                else NOT_HELD, f"largest |σ_max − 1| over the runs' logs: {worst:.1e}", rel))
    return claims
