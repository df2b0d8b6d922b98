#!/usr/bin/env python3
"""Print how far each curve's loss rises one grid step either side of its optimum, in seed standard errors.

    python tools/probe_curvature.py OUT/results.csv [--json]

The markdown table goes into a record's README (megatron_md/sweep/curvature.py says what is measured).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from megatron_md.sweep.curvature import curvature, curvature_markdown  # noqa: E402
from megatron_md.sweep.results import read_csv  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a sweep's results.csv")
    p.add_argument("--json", action="store_true", help="print the entries as JSON instead of a table")
    a = p.parse_args(argv)
    path = Path(a.results)
    if not path.is_file():
        print(f"error: {path} does not exist (a sweep writes OUT/results.csv)", file=sys.stderr)
        return 2
    entries = curvature(read_csv(path))
    print(json.dumps(entries, indent=1) if a.json else curvature_markdown(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
