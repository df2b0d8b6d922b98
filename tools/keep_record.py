#!/usr/bin/env python3
"""Copy what a record keeps from an ``lr-sweep`` directory into ``records/``, never overwriting.

    python tools/keep_record.py runs/rec/lr-transfer records/2026-12-01-lr-transfer

Kept per finished cell (``--only GLOB`` to choose cells by name): ``metrics.jsonl``, ``result.json`` and
the resolved ``config.yaml`` (not TensorBoard files, logs or checkpoints); then ``results.csv`` and
``optima.csv`` are rebuilt from the kept cells. A cell file that exists in the destination with other
content stops the copy before anything is written; identical files are left as they are.

    python tools/keep_record.py runs/rec/lr-transfer records/X-md-ablations/variants/rowcol --only 'muon_md-w128-*'
"""

import argparse
import filecmp
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

PER_CELL = ("metrics.jsonl", "result.json", "config.yaml")


def plan(src: Path, dest: Path, only: str = "*") -> list[tuple[Path, Path]]:
    pairs = []
    for cell in sorted((src / "cells").glob(f"{only}/")):
        if not (cell / "result.json").exists():
            continue  # unfinished: not part of the results
        pairs += [(cell / name, dest / "cells" / cell.name / name) for name in PER_CELL if (cell / name).exists()]
    return pairs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="an lr-sweep --out directory")
    ap.add_argument("dest", type=Path, help="where in records/ it goes")
    ap.add_argument("--only", default="*", metavar="GLOB", help="keep only the cells whose name matches")
    a = ap.parse_args(argv)
    pairs = plan(a.src, a.dest, a.only)
    if not pairs:
        print(f"keep_record: error: no finished cells matching {a.only!r} in {a.src}/cells (is it an lr-sweep "
              "--out directory?)", file=sys.stderr)
        return 2
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
    from megatron_md.sweep.results import write_all

    _, _, rows = write_all(a.dest)
    print(f"keep_record: {n} file(s) copied to {a.dest} ({len(pairs) - n} already there); results.csv has "
          f"{len(rows)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
