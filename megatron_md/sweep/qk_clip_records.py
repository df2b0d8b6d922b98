"""Tables and claim verdicts of a ``records/<date>-qk-clip`` record (QK-clip, ``--qk-clip``).

Two parts, told apart by their directory names:

- A, ``<set>/<preset>-qk-clip/results.csv``: a manifold-geometry preset rerun with QK-clip; its unclipped
  baselines (``all-dgram``, ``hetero``) are the same set's cells in the newest judged ``*-manifold-geometry``
  record. Logits are compared on the diagnostics' ``diag/L*.max_logit``, which both records log.
- B, ``<set>/tau<τ>/results.csv``: one ``lr-sweep`` curve at one LR per threshold τ. Their train records carry
  ``max_logit`` (over layers, before that step's clip) and ``qk_clip_layers`` (layer-steps clipped since the
  previous record). The largest τ is meant never to fire: its losses should equal, bit for bit, those of the
  control ``<set>/off/results.csv`` (the same cells with neither the clip nor the probe, run on the same code);
  a set without a control is compared with the newest ``*-lr-transfer`` record holding the cells, whose code
  may differ in rounding.

Standard library only (the README renderer uses it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_md.sweep import records as R
from megatron_md.sweep.grid import k_of_lr
from megatron_md.sweep.results import read_csv

CLIP_SUFFIX = "-qk-clip"
BASELINES = ("all-dgram", "hetero")
DEFAULT_TAU = 100.0  # --qk-clip-threshold's default (Megatron-LM's and Kimi K2's)
BOUND_FACTOR = 2.0  # a clipped run's diag max logit counts as bounded while it stays within 2·τ
OPT_NAMES = {"muon_md": "MuonMD", "muon": "Muon", "adamw": "AdamW"}


def clip_threshold(cell: Path) -> Optional[float]:
    """τ the cell ran with, from its config.yaml, else from result.json's args; None when it ran without
    QK-clip (or neither file says)."""
    cfg, res = Path(cell) / "config.yaml", Path(cell) / "result.json"
    text = cfg.read_text() if cfg.is_file() else ""
    on = re.search(r"^\s*qk_clip:\s*(\S+)", text, re.MULTILINE)
    if on:
        tau = re.search(r"^\s*qk_clip_threshold:\s*([-+.\deE]+)\s*$", text, re.MULTILINE)
        return None if on[1].lower() != "true" else float(tau[1]) if tau else DEFAULT_TAU
    args = (json.loads(res.read_text()).get("args") or []) if res.is_file() else []
    if "--qk-clip" not in args:
        return None
    i = args.index("--qk-clip-threshold") if "--qk-clip-threshold" in args else -1
    return float(args[i + 1]) if 0 <= i < len(args) - 1 else DEFAULT_TAU


def clip_sets(rec: Path, pattern: str = f"*{CLIP_SUFFIX}") -> list[str]:
    """Part A's sets (those holding a ``*-qk-clip`` preset), or with ``pattern="tau*"`` part B's."""
    return [s for s in R.manifold_sets(rec) if any((Path(rec) / s).glob(f"{pattern}/results.csv"))]


def baseline_record(repo: Path, set_name: str) -> Optional[Path]:
    """The newest judged manifold-geometry record that ran ``set_name``."""
    return next((b for b in R.judged(repo, "manifold-geometry") if any((b / set_name).glob("*/results.csv"))), None)


def part_a(repo: Path, rec: Path, set_name: str) -> tuple[list, dict, Optional[Path]]:
    """(runs: the baselines' and the clipped presets', {(preset, seed): τ} of the clipped runs, baseline record)."""
    runs = [r for r in R.manifold_runs(rec, set_name) if r.preset.endswith(CLIP_SUFFIX)]
    taus = {}
    for preset in {r.preset for r in runs}:
        d = Path(rec) / set_name / preset
        for row in read_csv(d / "results.csv"):
            tau = clip_threshold(d / "cells" / row["cell"])
            taus[(preset, row["seed"])] = DEFAULT_TAU if tau is None else tau
    base = baseline_record(repo, set_name)
    if base is not None:
        runs = [r for r in R.manifold_runs(base, set_name) if r.preset in BASELINES] + runs
    return runs, taus, base


@dataclass
class TauRun:
    tau: float
    row: dict  # its results.csv row
    logit: Optional[tuple]  # max_logit: (first, last, peak) over the logged steps; None when never logged
    clipped: int  # layer-steps clipped over the run (sum of qk_clip_layers)


def tau_runs(rec: Path, set_name: str) -> dict[float, list[TauRun]]:
    """τ -> its runs, largest τ first."""
    out = {}
    for csv_path in sorted((Path(rec) / set_name).glob("tau*/results.csv")):
        try:
            tau = float(csv_path.parent.name[3:])
        except ValueError:
            continue
        runs = []
        for row in read_csv(csv_path):
            logits, clipped, path = [], 0, csv_path.parent / "cells" / row["cell"] / "metrics.jsonl"
            for line in path.read_text().splitlines() if path.is_file() else []:
                try:
                    x = json.loads(line)
                except json.JSONDecodeError:
                    continue
                v = x.get("max_logit")  # null on a step that measured none
                if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
                    logits.append(float(v))
                clipped += x["qk_clip_layers"] if isinstance(x.get("qk_clip_layers"), int) else 0
            runs.append(TauRun(tau, row, (logits[0], logits[-1], max(logits)) if logits else None, clipped))
        if runs:
            out[tau] = runs
    return dict(sorted(out.items(), reverse=True))


def _best(rows: list[dict]) -> R.Best:
    (best,) = R.best_per_curve(rows).values()  # one optimizer, width and LR per arm
    return best


def _curve(runs: list[TauRun]) -> R.Best:
    return _best([r.row for r in runs])


def _key(r: dict) -> tuple:
    return (r["optimizer"], r["width"], r["params"], round(k_of_lr(r["lr"]), 3), r["seed"], r["warmup"],
            r["weight_decay"], r["steps"])


CONTROL = "off"  # part B's arm without the clip and without the probe


def control_rows(rec: Path, set_name: str) -> list[dict]:
    path = Path(rec) / set_name / CONTROL / "results.csv"
    return read_csv(path) if path.is_file() else []


def _compare(rows: list[dict], reference: list[dict]) -> tuple[int, int, list]:
    theirs = {_key(r): r for r in reference}
    pairs = [(r, theirs[_key(r)]) for r in rows if _key(r) in theirs]
    differ = [(a, b) for a, b in pairs if a["final_eval_loss"] is None or a["final_eval_loss"] != b["final_eval_loss"]]
    return len(pairs) - len(differ), len(rows) - len(pairs), differ


def transfer_sameness(repo: Path, rows: list[dict]) -> tuple[Optional[Path], int, int, list]:
    """``rows``' final eval losses against the newest finished lr-transfer record holding any of their cells
    (same model, LR, seed, recipe and length): (that record or None, how many equal to the last bit, how many
    it lacks, [(row, its row there)] that differ)."""
    for ref in reversed(R.finished(repo, "lr-transfer")):
        reference = read_csv(ref / "results.csv")
        equal, missing, differ = _compare(rows, reference)
        if missing < len(rows):
            return ref, equal, missing, differ
    return None, 0, len(rows), []


def sameness(repo: Path, set_name: str, control: list[dict], rows: list[dict]) -> tuple[Optional[str], int, int, list]:
    """Like ``transfer_sameness``, against the set's control arm's rows when it has any: (what was compared
    with, as text, or None; equal; missing; differ)."""
    if control:
        return (f"`{set_name}/{CONTROL}`", *_compare(rows, control))
    ref, equal, missing, differ = transfer_sameness(repo, rows)
    return (None if ref is None else f"`{_rel(ref, repo)}`"), equal, missing, differ


def _rel_diff(differ: list) -> str:
    d = [abs(a["final_eval_loss"] - b["final_eval_loss"]) / abs(b["final_eval_loss"]) for a, b in differ
         if a["final_eval_loss"] is not None and b["final_eval_loss"]]
    return f"largest relative difference {max(d):.1e}" if d else "a loss missing"


# ----------------------------------------------------------------------------- tables


def _loss(b: R.Best) -> str:
    if not math.isfinite(b.mean):
        return "diverged"
    return f"{b.mean:.4f} ± {b.std:.4f}" if math.isfinite(b.std) else f"{b.mean:.4f}"


def _trio(vals: list) -> str:
    """Mean first → last (peak) over the runs' (first, last, peak)."""
    if not vals or any(v is None for v in vals):
        return "–"
    m = [sum(v[i] for v in vals) / len(vals) for i in range(3)]
    return f"{m[0]:.2f} → {m[1]:.2f} ({m[2]:.2f})"


def _series(runs, kind: str) -> list:
    return [(r.first[kind], r.last[kind], r.peak[kind]) if kind in r.peak else None for r in runs]


def _taus_text(taus) -> str:
    return "τ " + ", ".join(f"{t:g}" for t in sorted(set(taus)))


def _rel(p: Path, repo: Path) -> str:
    return Path(p).resolve().relative_to(Path(repo).resolve()).as_posix()


def render_part_a(repo: Path, rec: Path, set_name: str) -> str:
    runs, taus, base = part_a(repo, rec, set_name)
    best = R.manifold_best(runs)
    clipped = [r for r in runs if r.preset.endswith(CLIP_SUFFIX)]
    if not clipped:
        return ""
    against = (f"against the unclipped runs of `{_rel(base, repo)}/{set_name}/`" if base is not None
               else "(no manifold-geometry record of this set to compare with)")
    lines = [f"**{set_name}**: QK-clip (`{_rel(rec, repo)}/{set_name}/`) {against}; matrix LR {clipped[0].lr:.4g}, "
             f"{max(r.steps for r in clipped)} steps, {len({r.seed for r in clipped})} seed(s). σ_max and max "
             "logit (`diag/L*.max_logit`, in both records): first logged → last (peak), the largest over layers, "
             "averaged over seeds.", "",
             "| preset | attention | QK-clip | final eval loss | attention σ_max | max attention logit "
             "| diverged or spiked |", "|---|---|---|---|---|---|---|"]
    for preset in [p for p in ("all-dgram", *sorted({r.preset for r in clipped}), "hetero") if p in best]:
        rs = [r for r in runs if r.preset == preset]
        plain = preset.removesuffix(CLIP_SUFFIX)
        att = "DGram" if plain in R.DGRAM_ATTENTION else "Stiefel" if plain in R.STIEFEL_ATTENTION else "–"
        clip = _taus_text(taus[(preset, r.seed)] for r in rs) if preset.endswith(CLIP_SUFFIX) else "–"
        bad = sum(1 for r in rs if r.status != "ok" or r.spiked)
        lines.append(f"| {preset} | {att} | {clip} | {_loss(best[preset])} | {_trio(_series(rs, 'attn_sigma_max'))}"
                     f" | {_trio(_series(rs, 'max_logit'))} | {bad}/{len(rs)} |")
    return "\n".join(lines)


def render_part_b(repo: Path, rec: Path, set_name: str) -> str:
    by_tau = tau_runs(rec, set_name)
    if not by_tau:
        return ""
    control = control_rows(rec, set_name)
    first = next(iter(by_tau.values()))[0].row
    seeds = sorted({r.row["seed"] for rs in by_tau.values() for r in rs})
    lines = [f"**{set_name}**: `{first['optimizer']}` width {first['width']}, LR {first['lr']:.4g} "
             f"(k={k_of_lr(first['lr']):.3g}), {first['steps']} steps, seeds {', '.join(map(str, seeds))} "
             f"(`{_rel(rec, repo)}/{set_name}/`). Max logit: `max_logit`, the largest over layers before that "
             "step's clip, first logged → last (peak); clipped layer-steps: `qk_clip_layers` summed over the run; "
             "both averaged over seeds. Last column: whether the final eval losses equal, bit for bit, those of "
             + (f"the control `{CONTROL}` (the same cells without QK-clip and without the probe, on the same code)."
                if control else "the lr-transfer record's cells of the same LR and seeds."), "",
             "| QK-clip | final eval loss | max logit | clipped layer-steps | same final losses |",
             "|---|---|---|---|---|"]
    for tau, runs in by_tau.items():
        ref, equal, missing, _ = sameness(repo, set_name, control, [r.row for r in runs])
        same = "nothing to compare with" if ref is None else (
            f"{'same as' if equal == len(runs) else 'not the same as'} {ref} ({equal}/{len(runs)} "
            f"equal" + (f", {missing} not there)" if missing else ")"))
        lines.append(f"| τ {tau:g} | {_loss(_curve(runs))} | {_trio([r.logit for r in runs])} | "
                     f"{sum(r.clipped for r in runs) / len(runs):g} | {same} |")
    if control:
        lines.append(f"| off, no probe | {_loss(_best(control))} | – | – | "
                     "(the control) |")
    return "\n".join(lines)


def render(repo: Path, rec: Path) -> str:
    """The record's tables: part A's sets, then part B's."""
    parts = [render_part_a(repo, rec, s) for s in clip_sets(rec)] + [render_part_b(repo, rec, s)
                                                                      for s in clip_sets(rec, "tau*")]
    parts = [p for p in parts if p]
    return "\n\n".join(parts) if parts else f"_No results in `{_rel(rec, repo)}` yet._"


# ----------------------------------------------------------------------------- claims


def _claims_a(repo: Path, rec: Path, rel: str, set_name: str) -> list[R.Claim]:
    runs, taus, _ = part_a(repo, rec, set_name)
    best = R.manifold_best(runs)
    out = []
    for preset in sorted({r.preset for r in runs if r.preset.endswith(CLIP_SUFFIX)}):
        plain = preset.removesuffix(CLIP_SUFFIX)
        if plain not in best or plain not in R.DGRAM_ATTENTION:
            continue  # no unclipped DGram-attention baseline: nothing these claims judge
        v, g, n = R.compare(best[preset], best[plain])
        text = R._gap(f"{plain.upper()}−CLIPPED", v, g, n)
        if "hetero" in best:
            vh, gh, nh = R.compare(best["hetero"], best[preset])
            text += "; " + R._gap("CLIPPED−HETERO", vh, gh, nh)
        out.append(R.Claim(f"QK-clip recovers DGram attention's loss gap ({set_name})", v, text, rel))

        clip = [r for r in runs if r.preset == preset]
        free = [r for r in runs if r.preset == plain]
        if not all("max_logit" in r.peak for r in clip + free):
            verdict, text = R.INCONCLUSIVE, "no diag max logit logged"
        else:
            bounds = [BOUND_FACTOR * taus[(preset, r.seed)] for r in clip]
            within = all(r.peak["max_logit"] <= b for r, b in zip(clip, bounds))  # the peak includes the last
            above = all(r.peak["max_logit"] > max(bounds) for r in free)
            # nothing to bound when the unclipped runs stay below it too
            verdict = R.NOT_HELD if not within else R.HELD if above else R.INCONCLUSIVE

            def growth(rs):
                g = [r.last["attn_sigma_max"] / r.first["attn_sigma_max"] for r in rs if "attn_sigma_max" in r.peak]
                return f"{sum(g) / len(g):.1f}×" if g else "–"
            text = (f"bound 2·τ = {max(bounds):g} ({_taus_text(taus[(preset, r.seed)] for r in clip)}); "
                    f"peak diag max logit: clipped ≤ {max(r.peak['max_logit'] for r in clip):.1f} (last ≤ "
                    f"{max(r.last['max_logit'] for r in clip):.1f}), unclipped {plain} ≥ "
                    f"{min(r.peak['max_logit'] for r in free):.1f}; attention σ_max growth (last/first, mean): "
                    f"clipped {growth(clip)}, unclipped {growth(free)}")
        out.append(R.Claim(f"QK-clip bounds DGram attention's max logit ({set_name})", verdict, text, rel))
    return out


def _claims_b(repo: Path, rec: Path, rel: str, set_name: str) -> list[R.Claim]:
    by_tau = tau_runs(rec, set_name)
    if not by_tau:
        return []
    label = set_name.replace("-", " ")
    idle_tau, idle = next(iter(by_tau.items()))  # the largest τ
    opt = idle[0].row["optimizer"]
    out = []
    if len(by_tau) > 1:
        low_tau, low = list(by_tau.items())[-1]
        v, g, n = R.compare(_curve(low), _curve(idle))
        way = {R.HELD: f"τ {low_tau:g} ends lower", R.NOT_HELD: f"τ {low_tau:g} ends higher"}.get(
            v, "no difference beyond the noise")
        out.append(R.Claim(f"QK-clip at τ {low_tau:g} changes {OPT_NAMES.get(opt, opt)}'s final loss ({label})",
                           R.HELD if v in (R.HELD, R.NOT_HELD) else R.INCONCLUSIVE,
                           f"{R._gap(f'(τ {idle_tau:g})−(τ {low_tau:g})', v, g, n)}: {way}", rel))
    rows, control = [r.row for r in idle], control_rows(rec, set_name)
    ref, equal, missing, differ = sameness(repo, set_name, control, rows)
    quiet = sum(r.clipped == 0 for r in idle)
    verdict = R.NOT_HELD if quiet < len(idle) or differ else R.INCONCLUSIVE if missing else R.HELD
    text = f"{quiet}/{len(idle)} τ {idle_tau:g} runs clipped no layer-step; "
    if ref is None:
        text += "no control arm and no lr-transfer record holds these cells"
    else:
        text += (f"final eval loss equal to {ref}'s in {equal}/{len(idle)}"
                 + (f", {missing} missing there" if missing else "")
                 + "".join(f"; seed {a['seed']}: {a['final_eval_loss']!r} ≠ {b['final_eval_loss']!r}"
                           for a, b in differ))
    if control:  # the older record, made on other code, for context only
        old, o_equal, _, o_differ = transfer_sameness(repo, rows)
        if old is not None:
            text += (f"; `{_rel(old, repo)}`'s cells (older code): {o_equal}/{len(rows)} equal"
                     + (f", {_rel_diff(o_differ)}" if o_differ else ""))
    out.append(R.Claim(f"An idle QK-clip and max-logit logging leave training bit-identical ({label}, "
                       f"τ {idle_tau:g})", verdict, text, rel))
    return out


def claims(rec: Path, rel: str, repo: Optional[Path] = None) -> list[R.Claim]:
    """The record's claims; ``repo`` (default: the one holding ``records/<rec>``) is where baselines are found."""
    repo = Path(rec).resolve().parent.parent if repo is None else Path(repo)
    return ([c for s in clip_sets(rec) for c in _claims_a(repo, rec, rel, s)]
            + [c for s in clip_sets(rec, "tau*") for c in _claims_b(repo, rec, rel, s)])
