"""Turn a pytest ``--durations=0`` log into a test-profile results file, and render profiles as the families table
of docs/tests.md.

    python tools/test_profile.py record LOG --label after --ids ALL --quick-ids QUICK [--launches JSONL] -o OUT.json
    python tools/test_profile.py table BEFORE.json AFTER.json

``record`` reads every ``N.NNs setup|call|teardown NODEID`` line of the log (pytest prints each phase over 5 ms),
sums the phases per test (a test under 5 ms in every phase counts 0), and keeps the session's wall time and pass/fail
counts from its last line. ``ALL`` and ``QUICK`` are ``pytest --collect-only -q`` of the same checkout with
``-m "not slow"`` (the profiled run's tests) and ``-m "not slow and not full"`` (the quick tier's). ``JSONL``:
the launch log tests/mdtest.py writes when MDTEST_LAUNCH_LOG is set (one line per megatron-md command: the test,
pool or cli, ranks, seconds). A family is a test file, and within it a parametrised function; ``table`` shows both,
the slowest first. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)\s*$")
SESSION = re.compile(r"=+ (.*) in ([0-9.]+)s")


def _ids(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if "::" in ln]


def record(log: Path, label: str, ids: Path, quick_ids: Path, launches: Path | None, date: str | None = None) -> dict:
    seconds: dict[str, float] = {t: 0.0 for t in _ids(ids)}
    wall, outcome = None, ""
    for line in log.read_text(errors="replace").splitlines():
        m = PHASE.match(line)
        if m:
            seconds[m.group(3)] = seconds.get(m.group(3), 0.0) + float(m.group(1))
        m = SESSION.search(line)
        if m and (" passed" in m.group(1) or " failed" in m.group(1)):
            outcome, wall = m.group(1).strip(), float(m.group(2))
    quick = set(_ids(quick_ids))
    out = {
        "label": label, "date": date or time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip(),
        "outcome": outcome, "wall_s": wall,
        # test id -> [seconds, 1 when the quick tier runs it]
        "tests": {k: [round(v, 2), int(k in quick)] for k, v in sorted(seconds.items())},
    }
    if launches is not None and launches.exists():
        per: dict[str, dict] = defaultdict(lambda: {"cli": 0, "pool": 0, "cli_s": 0.0, "pool_s": 0.0})
        for ln in launches.read_text().splitlines():
            r = json.loads(ln)
            d = per[r["test"]]
            d[r["via"]] += 1
            d[f"{r['via']}_s"] += r["seconds"]
        out["launches"] = {k: {kk: round(vv, 2) if isinstance(vv, float) else vv for kk, vv in v.items()}
                           for k, v in sorted(per.items())}
    return out


def _family(nodeid: str) -> tuple[str, str]:
    file, _, rest = nodeid.partition("::")
    return file, rest.split("[")[0]


def families(profile: dict, quick_only: bool = False) -> dict[tuple[str, str], tuple[int, float]]:
    out: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    for nodeid, (s, quick) in profile["tests"].items():
        if quick_only and not quick:
            continue
        f = out[_family(nodeid)]
        f[0] += 1
        f[1] += s
    return {k: (n, s) for k, (n, s) in out.items()}


def _by_file(fams: dict) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (file, _), (_, s) in fams.items():
        out[file] += s
    return out


def _launches(profile: dict, file: str) -> str:
    per = profile.get("launches")
    if not per:
        return ""
    cli = sum(v["cli"] for k, v in per.items() if k.startswith(file + "::"))
    pool = sum(v["pool"] for k, v in per.items() if k.startswith(file + "::"))
    return f"{cli} / {pool}" if cli or pool else ""


def table(before: dict, after: dict, top: int = 25) -> str:
    """Files (the families) by time before, with their slowest parametrised functions, and the totals."""
    fb, fa = families(before), families(after)
    qb, qa = _by_file(families(before, True)), _by_file(families(after, True))
    byb, bya = _by_file(fb), _by_file(fa)
    files = sorted(set(byb) | set(bya), key=lambda f: -max(byb.get(f, 0), bya.get(f, 0)))
    lines = [
        f"| test file (family) | before: all / quick (s) | after: all / quick (s) | commands after: CLI / pool |",
        "| --- | ---: | ---: | ---: |",
    ]
    rest_b = rest_a = rest_qb = rest_qa = 0.0
    for i, f in enumerate(files):
        if i >= top:
            rest_b, rest_a = rest_b + byb.get(f, 0), rest_a + bya.get(f, 0)
            rest_qb, rest_qa = rest_qb + qb.get(f, 0), rest_qa + qa.get(f, 0)
            continue
        lines.append(f"| `{f}` | {byb.get(f, 0):.0f} / {qb.get(f, 0):.0f} | "
                     f"{bya.get(f, 0):.0f} / {qa.get(f, 0):.0f} | {_launches(after, f)} |")
    lines.append(f"| {len(files) - top} other files | {rest_b:.0f} / {rest_qb:.0f} | {rest_a:.0f} / {rest_qa:.0f} | |")
    lines.append(f"| **all {len(before['tests'])} / {len(after['tests'])} tests (sum of test times)** | "
                 f"**{sum(byb.values()):.0f} / {sum(qb.values()):.0f}** | **{sum(bya.values()):.0f} / "
                 f"{sum(qa.values()):.0f}** | |")
    return "\n".join(lines)


def functions_table(before: dict, after: dict, top: int = 15) -> str:
    """The slowest parametrised functions before, and what they take after."""
    fb, fa = families(before), families(after)
    rows = sorted(fb.items(), key=lambda kv: -kv[1][1])[:top]
    lines = ["| function (cases) | before (s) | after (s) |", "| --- | ---: | ---: |"]
    for (file, func), (n, s) in rows:
        na, sa = fa.get((file, func), (0, 0.0))
        lines.append(f"| `{file}::{func}` ({n} / {na}) | {s:.0f} | {sa:.0f} |")
    return "\n".join(lines)


def launch_cost_markdown(res: dict) -> str:
    """One command's wall time through the CLI and pooled, by rank count (benchmarks/launch_cost.py's medians)."""
    rows = ["| ranks | command | through the CLI | pooled | CLI / pooled |", "| ---: | --- | ---: | ---: | ---: |"]
    names = {"one": "1 step", "steps": "5 steps", "save": "5 steps and a save", "resume": "resume at 4, 2 steps"}
    for nproc in (1, 2):
        for v in LAUNCH_VARIANTS:
            m = res["cases"][f"{nproc}/{v}"]
            rows.append(f"| {nproc} | {names[v]} | {m['cli_s']:.1f} s | {m['pool_s']:.1f} s | "
                        f"{m['cli_s'] / m['pool_s']:.1f}x |")
    return "\n".join(rows)


BEFORE = "benchmarks/results/test_profile_before.json"
AFTER = "benchmarks/results/test_profile_after.json"
LAUNCH_COST = "benchmarks/results/launch_cost_cpu.json"
LAUNCH_VARIANTS = ("one", "steps", "save", "resume")


def _summary(p: dict) -> str:
    n = len(p["tests"])
    quick = sum(1 for _, q in p["tests"].values() if q)
    return (f"{p['label']}: main at {p['commit']}, {p['date']}: {n} tests ({quick} in the quick tier), session "
            f"{p['wall_s'] / 60:.1f} min ({p['outcome']})")


def render_test_profile(repo: Path) -> str:
    if not (repo / BEFORE).exists():
        return f"_No profile recorded: `{BEFORE}` is missing._"
    before = json.loads((repo / BEFORE).read_text())
    if not (repo / AFTER).exists():
        return f"_Only the profile before the change is recorded: {_summary(before)}._"
    after = json.loads((repo / AFTER).read_text())
    return "\n".join([f"From `{BEFORE}` and `{AFTER}` (`tools/test_profile.py`).", "",
                      f"- {_summary(before)}", f"- {_summary(after)}", "", table(before, after), "",
                      "The slowest functions before:", "", functions_table(before, after)])


def render_launch_cost(repo: Path) -> str:
    path = repo / LAUNCH_COST
    if not path.exists():
        return "_No results yet: run `python benchmarks/launch_cost.py`._"
    res = json.loads(path.read_text())
    return (f"From `{LAUNCH_COST}` (`benchmarks/launch_cost.py`, {res['machine']}, {res['date']}, median of "
            f"{res['repeats']}).\n\n" + launch_cost_markdown(res))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("log", type=Path)
    r.add_argument("--label", required=True)
    r.add_argument("--ids", type=Path, required=True)
    r.add_argument("--quick-ids", type=Path, required=True)
    r.add_argument("--launches", type=Path)
    r.add_argument("--date", help="the day the profiled run started (default: today)")
    r.add_argument("-o", "--output", type=Path, required=True)
    t = sub.add_parser("table")
    t.add_argument("before", type=Path)
    t.add_argument("after", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "record":
        prof = record(a.log, a.label, a.ids, a.quick_ids, a.launches, a.date)
        tests = prof.pop("tests")
        body = json.dumps(prof, indent=1)[:-2] + ',\n "tests": {\n' + ",\n".join(
            f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in tests.items()) + "\n }\n}\n"
        a.output.write_text(body)
        json.loads(body)
        print(f"{a.output}: {len(tests)} tests, {sum(v[0] for v in tests.values()):.0f} s of test time, "
              f"session {prof['wall_s']} s ({prof['outcome']})")
        return 0
    before, after = (json.loads(x.read_text()) for x in (a.before, a.after))
    print(table(before, after))
    print()
    print(functions_table(before, after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
