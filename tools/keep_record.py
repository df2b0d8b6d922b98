#!/usr/bin/env python3
"""Copy what a record keeps from an ``lr-sweep`` directory into ``records/``, never overwriting.

    python tools/keep_record.py runs/rec/lr-transfer records/2026-12-01-lr-transfer

Kept: ``results.csv``, ``optima.csv`` and, per cell, ``metrics.jsonl``, ``result.json`` and the resolved
``config.yaml`` (not TensorBoard files, logs or checkpoints). A destination file that exists with other
content stops the copy before anything is written; identical files are left as they are.
"""

import argparse
import filecmp
import shutil
import sys
from pathlib import Path

TOP = ("results.csv", "optima.csv")
PER_CELL = ("metrics.jsonl", "result.json", "config.yaml")


def plan(src: Path, dest: Path) -> list[tuple[Path, Path]]:
    pairs = [(src / name, dest / name) for name in TOP if (src / name).exists()]
    for cell in sorted((src / "cells").glob("*/")):
        if not (cell / "result.json").exists():
            continue  # unfinished: not part of the results
        pairs += [(cell / name, dest / "cells" / cell.name / name) for name in PER_CELL if (cell / name).exists()]
    return pairs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="an lr-sweep --out directory")
    ap.add_argument("dest", type=Path, help="where in records/ it goes")
    a = ap.parse_args(argv)
    if not (a.src / "results.csv").exists():
        print(f"keep_record: error: {a.src}/results.csv not found (is it an lr-sweep --out directory?)", file=sys.stderr)
        return 2
    pairs = plan(a.src, a.dest)
    clash = [d for s, d in pairs if d.exists() and not filecmp.cmp(s, d, shallow=False)]
    if clash:
        print(f"keep_record: error: {len(clash)} file(s) in {a.dest} differ from {a.src}, e.g. {clash[0]}; "
              "nothing copied (choose a new destination, or remove the old record by hand)", file=sys.stderr)
        return 2
    n = 0
    for s, d in pairs:
        if not d.exists():
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)
            n += 1
    print(f"keep_record: {n} file(s) copied to {a.dest} ({len(pairs) - n} already there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
