#!/usr/bin/env python3
"""Plot weight spectra and attention logits from one or more runs' metrics.jsonl.

    python tools/plot_spectra.py runs/A runs/B --out spectra.png [--stat sigma_max]

Panels: the chosen statistic per module type (attention.qkv, attention.proj, mlp.fc1, mlp.fc2,
experts, router; mean over layers, shaded min-max) and the max attention logit per layer.
One colour per run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

KEY = re.compile(r"^diag/L(\d+)\.(expert\d+\.)?([a-z_.0-9]+)/([a-z_]+)$")
LOGIT = re.compile(r"^diag/L(\d+)\.max_logit$")


def load(run: Path) -> tuple[dict, dict]:
    """(stat -> module -> [(iteration, [values over layers])], layer -> [(iteration, logit)])."""
    mats: dict = defaultdict(lambda: defaultdict(list))
    logits: dict = defaultdict(list)
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.exists():
        raise SystemExit(f"plot_spectra: {path} not found (pass a run directory or a metrics.jsonl)")
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        it = rec.get("iteration")
        per: dict = defaultdict(lambda: defaultdict(list))
        for k, v in rec.items():
            m = KEY.match(k)
            if m:
                module = "experts." + m.group(3) if m.group(2) else m.group(3)
                per[m.group(4)][module].append(v)
            m = LOGIT.match(k)
            if m:
                logits[int(m.group(1))].append((it, v))
        for stat, modules in per.items():
            for module, values in modules.items():
                mats[stat][module].append((it, values))
    return mats, logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("spectra.png"))
    ap.add_argument("--stat", default="sigma_max", help="sigma_max, sigma_min, off_gram, fro, gain_row_mean, ...")
    ap.add_argument("--labels", help="Comma-separated legend labels, one per run [default: the run directories' names]")
    ap.add_argument("--log-y", action="store_true", help="Logarithmic y axes.")
    a = ap.parse_args(argv)
    labels = a.labels.split(",") if a.labels else [run.name or str(run) for run in a.runs]
    if len(labels) != len(a.runs):
        print(f"plot_spectra: --labels has {len(labels)} names for {len(a.runs)} runs", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {label: load(run) for label, run in zip(labels, a.runs)}
    modules = sorted({m for mats, _ in data.values() for m in mats.get(a.stat, {})})
    if not modules:
        print(f"plot_spectra: no diag/*/{a.stat} values in {', '.join(map(str, a.runs))} "
              "(train with --diagnostics-interval > 0)", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(1, len(modules) + 1, figsize=(4 * (len(modules) + 1), 3.5), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, (mats, logits)) in enumerate(data.items()):
        c = colours[i % len(colours)]
        for ax, module in zip(axes[0], modules):
            series = mats.get(a.stat, {}).get(module, [])
            if series:
                its = [s[0] for s in series]
                ax.plot(its, [sum(v) / len(v) for _, v in series], color=c, label=name)
                ax.fill_between(its, [min(v) for _, v in series], [max(v) for _, v in series], color=c, alpha=0.15)
            ax.set_title(f"{module}: {a.stat}")
            ax.set_xlabel("iteration")
        ax = axes[0][-1]
        for layer, pts in sorted(logits.items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c, alpha=0.4 + 0.6 * (layer + 1) / len(logits),
                    label=f"{name} L{layer}")
        ax.set_title("max attention logit per layer")
        ax.set_xlabel("iteration")
    if a.log_y:
        for ax in axes[0]:
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
