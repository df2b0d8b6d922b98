"""The LR-transfer figure: one panel per optimizer, final loss vs LR (log2 axis), one curve per width
(mean over seeds, min-max band), each width's optimum starred (chosen among the LRs every seed ran; the
others are hollow). Flat optima across widths = transfer.

    python tools/plot_lr_transfer.py OUT/results.csv --out OUT/lr_transfer.png
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from collections import defaultdict
from pathlib import Path


def _plot_rows(results_csv: Path, series: dict[str, Path] | None) -> list[dict]:
    """The rows to draw; each series' rows get its index as their "width", so each draws as one curve."""
    from megatron_md.sweep.results import read_csv

    rows = [{**r, "width": i} for i, label in enumerate(series) for r in read_csv(series[label])] if series \
        else read_csv(results_csv)
    if not rows:
        raise ValueError(f"{results_csv}: no finished cells to plot")
    return rows


def plot_lr_transfer(results_csv: Path, out_png: Path, series: dict[str, Path] | None = None) -> Path:
    """Final loss vs LR, a panel per optimizer, a curve per width, or per label of ``series`` ({label: results.csv
    of one width}: another axis, the number of experts say; ``results_csv`` is then only copied beside the plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_md.sweep.results import curves, full_seed_points

    names = list(series or {})
    by_opt = defaultdict(dict)
    for key, value in curves(_plot_rows(results_csv, series)).items():
        by_opt[key[0]][key[1:]] = value
    opts = sorted(by_opt)
    widths = sorted({k[0] for d in by_opt.values() for k in d})
    cmap = plt.get_cmap("viridis")
    colour = {w: cmap(i / max(1, len(widths) - 1) * 0.9) for i, w in enumerate(widths)}
    fig, axes = plt.subplots(1, len(opts), figsize=(5.2 * len(opts), 4.2), squeeze=False)
    for ax, opt in zip(axes[0], opts):
        groups = by_opt[opt]
        variants, styles = sorted({k[1:] for k in groups}), ["-", "--", ":", "-."]  # (warmup, wd): a style each
        finite_y = []
        kinds = set()
        for (width, wu, wd), (kind, pts) in sorted(groups.items()):
            kinds.add(kind)
            good = [p for p in pts if math.isfinite(p[1])]
            label = (names[width] if series else f"w{width}") + (f" wu{wu} wd{wd:g}" if len(variants) > 1 else "")
            style = styles[variants.index((wu, wd)) % len(styles)]
            if good:
                x = [p[0] for p in good]
                y = [p[1] for p in good]
                finite_y += y
                ax.plot(x, y, style, marker="o", ms=3.5, color=colour[width], label=label)
                if any(p[4] > 1 for p in good):
                    ax.fill_between(x, [p[2] for p in good], [p[3] for p in good], color=colour[width], alpha=0.18)
                full = [p for p in full_seed_points(pts) if math.isfinite(p[1])]
                few = [p for p in good if p not in full]
                if few:  # LRs that not every seed ran: hollow, and never the optimum
                    ax.plot([p[0] for p in few], [p[1] for p in few], "o", ms=6, mfc="white", color=colour[width],
                            linestyle="none")
                best = min(full or good, key=lambda p: p[1])
                ax.plot([best[0]], [best[1]], marker="*", ms=14, color=colour[width], mec="black", mew=0.7,
                        linestyle="none")
            bad = [p[0] for p in pts if not math.isfinite(p[1])]
            if bad:  # diverged LRs: crosses along the top
                ax.plot(bad, [1.0] * len(bad), "x", color=colour[width], transform=ax.get_xaxis_transform(),
                        clip_on=False, label=None if good else label + " (diverged)")
        ax.set_xscale("log", base=2)
        ticks = sorted({p[0] for _, pts in groups.values() for p in pts})
        if len(ticks) <= 12:  # label the grid's own LRs (and their k) rather than powers of 2
            from megatron_md.sweep.grid import k_label

            ax.set_xticks(ticks, [f"{x:.2g}" + (f"\nk{k_label(x)}" if k_label(x) is not None else "") for x in ticks],
                          fontsize=8)
            ax.minorticks_off()
        ax.set_xlabel("swept learning rate (log2 axis)")
        ax.set_ylabel("final " + ("eval" if kinds == {"eval"} else "train" if kinds == {"train"} else "eval/train")
                      + " loss")
        ax.set_title(opt)
        ax.grid(True, which="both", alpha=0.3)
        if finite_y:  # keep the basin readable when the high-LR end blows up
            lo, hi = min(finite_y), max(finite_y)
            s = sorted(finite_y)
            q = s[int(0.75 * (len(s) - 1))]
            top = min(hi, q + 2.0 * max(q - lo, 1e-3))
            ax.set_ylim(lo - 0.05 * max(top - lo, 1e-3), top + 0.05 * max(top - lo, 1e-3))
        ax.legend(fontsize=8)
    fig.suptitle(f"LR transfer across {'the series' if series else 'width'} (* = optimum per curve, among the LRs "
                 "every seed ran (hollow: not all); x = diverged)")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    beside = out_png.with_suffix(".csv")
    if Path(results_csv).resolve() != beside.resolve():
        shutil.copyfile(results_csv, beside)
    return out_png


OFF_SCALE_NATS = 0.2  # an ablation variant this far above the best is named in the legend, not drawn


def off_scale(curves_pts: list[list[tuple]]) -> tuple[set[int], tuple[float, float]]:
    """Which curves to leave off the axes, and the y-range for the rest.

    A variant far behind the others (e.g. other fixed LRs) would flatten every other curve, so one whose
    best loss is OFF_SCALE_NATS above the overall best is only named in the legend.
    """
    bests = [min(p[1] for p in pts) for pts in curves_pts]
    floor = min(bests, default=0.0)
    off = {j for j, b in enumerate(bests) if b - floor >= OFF_SCALE_NATS}
    spread = max((max(p[1] for p in pts) - bests[j] for j, pts in enumerate(curves_pts) if j not in off), default=0.0)
    span = max(0.05, 3 * spread)
    return off, (floor - 0.1 * span, floor + span)


def plot_ablations(record: Path, out_png: Path) -> Path:
    """One panel: final loss vs matrix LR, one curve per MuonMD variant (``variants/<name>/results.csv``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_md.sweep.results import curves, read_csv

    fig, ax = plt.subplots(figsize=(9, 4.5))
    paths = sorted(Path(record).glob("variants/*/results.csv"))
    if not paths:
        raise ValueError(f"{record}: no variants/*/results.csv")
    found = []
    for i, path in enumerate(paths):
        for _, (kind, pts) in curves(read_csv(path)).items():
            good = [p for p in pts if math.isfinite(p[1])]
            if good:
                found.append((i, path.parent.name, good))
    off, (lo, hi) = off_scale([g for _, _, g in found])
    for j, (i, name, good) in enumerate(found):
        # a dozen variants: tab20's 20 colours, and every other curve dashed so that neighbours differ twice
        colour, style = plt.get_cmap("tab20")(i % 20), ("-", "--")[i % 2]
        best = min(good, key=lambda p: p[1])
        if j in off:
            ax.plot([], [], marker="o", color=colour, linestyle=style, label=f"{name} (off scale: best {best[1]:.3f})")
            continue
        ax.plot([p[0] for p in good], [p[1] for p in good], marker="o", ms=3.5, color=colour, linestyle=style,
                lw=2.5 if name == "rowcol" else 1.2, label=name)
        ax.plot([best[0]], [best[1]], marker="*", ms=13, color=colour, mec="black", mew=0.7, linestyle="none")
    if found:
        ax.set_ylim(lo, hi)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("matrix LR (log2 axis)")
    ax.set_ylabel(f"final {kind} loss (mean over seeds)")
    ax.set_title("MuonMD ablations (* = optimum per variant)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


def plot_loss_curves(run_dirs: dict[str, list[Path]], out_png: Path, title: str) -> Path:
    """Train loss vs iteration, one colour per label (mean over its runs, min-max band)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    lows = []
    for i, (label, dirs) in enumerate(run_dirs.items()):
        series = []
        for d in dirs:
            pts = {}
            for line in (Path(d) / "metrics.jsonl").read_text().splitlines():
                rec = json.loads(line)
                if "lm_loss" in rec and "eval_lm_loss" not in rec:
                    pts[rec["iteration"]] = rec["lm_loss"]
            series.append(pts)
        its = sorted(set.intersection(*(set(s) for s in series))) if series else []
        if not its:
            continue
        ys = [[s[it] for s in series] for it in its]
        mean = [sum(y) / len(y) for y in ys]
        colour = plt.get_cmap("tab10")(i % 10)
        ax.plot(its, mean, color=colour, lw=1.2, label=f"{label} (n={len(series)})")
        if len(series) > 1:
            ax.fill_between(its, [min(y) for y in ys], [max(y) for y in ys], color=colour, alpha=0.15)
        lows.append(min(m for m in mean if math.isfinite(m)))
    ax.set_xlabel("iteration")
    ax.set_ylabel("train loss")
    if lows:
        ax.set_ylim(min(lows) - 0.1, min(lows) + 2.5)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plot_lr_transfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, nargs="+", help="results.csv of `megatron-md lr-sweep`; several with "
                    "--labels: one curve each (an axis other than width)")
    ap.add_argument("--labels", help="Comma-separated, one per results.csv: plot them as curves of one figure "
                    "(e.g. '4 experts,8 experts,16 experts')")
    ap.add_argument("--out", type=Path, default=None, help="PNG (default: lr_transfer.png beside the first CSV)")
    a = ap.parse_args(argv)
    labels = [x.strip() for x in a.labels.split(",")] if a.labels else None
    missing = [str(p) for p in a.results if not p.is_file()]
    if missing or (len(a.results) > 1 or labels) and len(labels or []) != len(a.results):
        why = f"{', '.join(missing)} not found" if missing else f"--labels gives {len(labels or [])} labels for " \
            f"{len(a.results)} results.csv files: one each"
        print(f"plot_lr_transfer: error: {why}", file=sys.stderr)
        return 2
    out = a.out or a.results[0].with_name("lr_transfer.png")
    try:
        plot_lr_transfer(a.results[0], out, dict(zip(labels, a.results)) if labels else None)
    except ValueError as e:
        print(f"plot_lr_transfer: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} and {out.with_suffix('.csv')}")
    return 0
