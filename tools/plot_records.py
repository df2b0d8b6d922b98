#!/usr/bin/env python3
"""Draw the figures of one or more CPU records (the kind follows from the directory name).

    python tools/plot_records.py records/2026-12-01-lr-transfer records/2026-12-01-md-ablations \
        records/2026-12-01-manifold-geometry

*-lr-transfer: lr_transfer.png (+ .csv); *-md-ablations: ablations.png; *-manifold-geometry: per LR set,
loss_<set>.png (train loss per preset, mean over seeds) and spectra_<set>.png (tools/plot_spectra.py
over each preset's first seed).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from megatron_md.sweep.plot import plot_ablations, plot_loss_curves, plot_lr_transfer  # noqa: E402
from megatron_md.sweep.records import PRESETS, manifold_sets  # noqa: E402


def plot_record(rec: Path) -> list[Path]:
    name = rec.name
    if name.endswith("-lr-transfer"):
        return [plot_lr_transfer(rec / "results.csv", rec / "lr_transfer.png")]
    if name.endswith("-md-ablations"):
        return [plot_ablations(rec, rec / "ablations.png")]
    if name.endswith("-manifold-geometry"):
        import plot_spectra

        out = []
        for set_name in manifold_sets(rec):
            presets = [p for p in PRESETS if (rec / set_name / p / "results.csv").exists()]
            runs = {p: sorted((rec / set_name / p / "cells").glob("*/metrics.jsonl")) for p in presets}
            out.append(plot_loss_curves({p: [m.parent for m in ms] for p, ms in runs.items()},
                                        rec / f"loss_{set_name}.png", f"tiny-gpt2, geometry presets ({set_name})"))
            firsts = [ms[0].parent for ms in runs.values()]  # seed 1 of each preset, labelled by preset
            spectra = rec / f"spectra_{set_name}.png"
            plot_spectra.main([*map(str, firsts), "--out", str(spectra), "--labels", ",".join(presets), "--log-y"])
            out.append(spectra)
        return out
    raise SystemExit(f"plot_records: {rec}: name must end with -lr-transfer, -md-ablations or -manifold-geometry")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="+", type=Path)
    a = ap.parse_args(argv)
    for rec in a.records:
        if not rec.is_dir():
            print(f"plot_records: error: {rec} is not a directory", file=sys.stderr)
            return 2
        for path in plot_record(rec):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
