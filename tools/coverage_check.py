"""Line coverage of megatron_md/ under `make test-all`, held against the figure measured before the suite was made
faster (benchmarks/results/coverage.json, "before"): `make coverage` fails when today's is lower.

    python tools/coverage_check.py runs/coverage/coverage.json            # check (exit 1 when lower)
    python tools/coverage_check.py runs/coverage/coverage.json --record after

The input is `coverage json` of the combined data (every pytest process, pooled worker, torchrun rank and
subprocess: `[tool.coverage.run]` in pyproject.toml). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "benchmarks" / "results" / "coverage.json"


def totals(report: Path) -> dict:
    t = json.loads(report.read_text())["totals"]
    return {"percent": round(t["percent_covered"], 2), "covered_lines": t["covered_lines"],
            "statements": t["num_statements"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="coverage json output")
    p.add_argument("--record", metavar="LABEL", help="store these totals under LABEL (before, after) instead")
    p.add_argument("--commit", help="the commit measured (default: HEAD)")
    a = p.parse_args(argv)
    now = totals(a.report)
    stored = json.loads(RESULT.read_text()) if RESULT.exists() else {}
    if a.record:
        commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                            text=True).stdout.strip()
        stored[a.record] = {**now, "commit": commit, "date": time.strftime("%Y-%m-%d")}
        RESULT.write_text(json.dumps(stored, indent=1) + "\n")
        print(f"{RESULT.relative_to(REPO)}: {a.record} = {now['percent']}% ({now['covered_lines']} of "
              f"{now['statements']} lines)")
        return 0
    floor = stored.get("before")
    if floor is None:
        print(f"coverage: {now['percent']}% of megatron_md/ ({now['covered_lines']} of {now['statements']} lines); "
              f"no floor recorded in {RESULT.relative_to(REPO)}")
        return 0
    ok = now["percent"] >= floor["percent"]
    print(f"coverage: {now['percent']}% of megatron_md/ ({now['covered_lines']} of {now['statements']} lines), "
          f"{'at or above' if ok else 'BELOW'} the {floor['percent']}% measured before the suite was made faster "
          f"({floor['covered_lines']} of {floor['statements']} lines, main at {floor['commit']})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
