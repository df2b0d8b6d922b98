"""Rewrite the generated tables in README.md from the stored results.

Each generated block sits between two markers in the README::

    <!-- BEGIN optimizer_step -->
    ...generated, do not edit by hand...
    <!-- END optimizer_step -->

``optimizer_step``: every ``benchmarks/results/*.json`` written by ``benchmarks/optimizer_step.py``
(sorted by file name), one table each. Further blocks (e.g. ``records/*/*.csv``) register in
``BLOCKS``. Standard library only: no torch import.

    python tools/render_readme_tables.py            # rewrite README.md in place
    python tools/render_readme_tables.py --check    # exit 1 if README.md is out of date
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
BEGIN = "<!-- BEGIN {name} -->"
END = "<!-- END {name} -->"


# ----------------------------------------------------------------------------- optimizer_step

def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f}"


def optimizer_step_markdown(result: dict, source: str | None = None) -> str:
    """The Markdown for one optimizer_step result: settings line, main table, ratios, phases."""
    s, m, res = result["settings"], result["machine"], result["results"]
    p = s["parameters"]
    lines = [
        f"Optimizer step on {m['device'].upper()} ({m['cpu']}, {m['threads']} threads; torch {m['torch']}, "
        f"megatron-core {m['megatron_core'].split('+')[0]}): `{s['preset']}` at hidden {s['hidden_size']}, "
        f"{s['num_layers']} layers, vocab {s['vocab_size']} = {p['total'] / 1e6:.1f}M parameters "
        f"({p['embedding'] / 1e6:.1f}M embedding + LM head); {s['precision']}; "
        f"median of {s['steps']} steps after {s['warmup']} warmup"
        + (f" (`{source}`, {result['created'][:10]})" if source else f" ({result['created'][:10]})")
        + ".",
        "",
    ]
    base = res.get("muon")
    adam = res.get("adam")
    lines += [
        "| optimizer | step median (ms) | IQR (ms) | / muon | / adam | optimizer state (MiB) | state bytes / param |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in res.items():
        vs_muon = f"{r['median_s'] / base['median_s']:.3f}" if base else "–"
        vs_adam = f"{r['median_s'] / adam['median_s']:.3f}" if adam else "–"
        lines.append(
            f"| `{name}` | {_ms(r['median_s'])} | {_ms(r['iqr_s'])} | {vs_muon} | {vs_adam} | "
            f"{_mib(r['state_bytes'])} | {r['state_bytes_per_param']:.2f} |"
        )
    if result.get("ratios"):
        paired = result.get("paired_ratios", {})
        cpu = result.get("cpu_time_ratios", {})
        parts = []
        for k, v in result["ratios"].items():
            extra = [f"paired per round {paired[k]:.3f}"] if k in paired else []
            extra += [f"CPU time {cpu[k]:.3f}"] if k in cpu else []
            parts.append(f"{k} = **{v:.3f}**" + (f" ({', '.join(extra)})" if extra else ""))
        lines += ["", "Ratios of the medians: " + "; ".join(parts) + "."]
    for w in result.get("warnings") or []:
        lines += ["", f"Warning: {w}."]
    for k, t in (result.get("target") or {}).items():
        if t.get("value") is not None:
            verdict = "met" if t["met"] else "NOT met"
            lines += ["", f"Target {k} ≤ {t['max']:.2f}: {verdict} ({t['value']:.3f})."]
    phases = result.get("phases") or {}
    if phases:
        lines += ["", "Where the time goes (mean ms per step over the extra timed steps; derived rows in italics):", ""]
        names = list(phases)
        lines.append("| phase | " + " | ".join(f"`{n}`" for n in names) + " |")
        lines.append("|---|" + "---:|" * len(names))
        order: list[str] = []
        for n in names:
            for row in phases[n]["phases"]:
                if row["name"] not in order:
                    order.append(row["name"])
        derived = {row["name"] for n in names for row in phases[n]["phases"] if row.get("derived")}
        lines.append("| whole `optimizer.step()` | " + " | ".join(_ms(phases[n]["step_s"]) for n in names) + " |")
        for name in order:
            cells = []
            for n in names:
                row = next((r for r in phases[n]["phases"] if r["name"] == name), None)
                cells.append("" if row is None else f"{_ms(row['seconds'])} ({row['share'] * 100:.0f}%)")
            label = f"*{name}*" if name in derived else name
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_optimizer_step(repo: Path) -> str:
    results_dir = repo / "benchmarks" / "results"
    blocks = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}: not valid JSON ({e})")
        if result.get("benchmark") != "optimizer_step":
            continue
        blocks.append(optimizer_step_markdown(result, source=f"benchmarks/results/{path.name}"))
    if not blocks:
        return f"_No results yet: run `make bench` (writes {results_dir.relative_to(repo)}/*.json)._"
    return "\n\n".join(blocks)


BLOCKS: dict[str, Callable[[Path], str]] = {
    "optimizer_step": render_optimizer_step,
}


# ----------------------------------------------------------------------------- README splicing

class MarkersMissing(ValueError):
    pass


def splice(text: str, name: str, body: str) -> str:
    """``text`` with the lines between the ``name`` markers replaced by ``body``."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if len(pattern.findall(text)) != 1:
        raise MarkersMissing(
            f"expected exactly one pair of markers '{begin}' ... '{end}' in the README "
            f"(found {len(pattern.findall(text))}); add them where the {name} table belongs"
        )
    return pattern.sub(lambda _: f"{begin}\n{body.strip()}\n{end}", text, count=1)


def render(readme_text: str, repo: Path, names=None) -> str:
    for name in names or BLOCKS:
        readme_text = splice(readme_text, name, BLOCKS[name](repo))
    return readme_text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Rewrite the generated tables in README.md.")
    ap.add_argument("--readme", default=str(REPO / "README.md"))
    ap.add_argument("--repo", default=str(REPO), help="where benchmarks/results/ and records/ are read")
    ap.add_argument("--check", action="store_true", help="exit 1 if the README is out of date; write nothing")
    ap.add_argument("--block", action="append", choices=sorted(BLOCKS), help="only this block (repeatable)")
    args = ap.parse_args(argv)
    readme = Path(args.readme)
    old = readme.read_text()
    try:
        new = render(old, Path(args.repo), args.block)
    except MarkersMissing as e:
        print(f"error: {readme}: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != old:
            diff = difflib.unified_diff(old.splitlines(), new.splitlines(), str(readme), "generated", lineterm="")
            print("\n".join(diff))
            print(f"{readme} is out of date: run python tools/render_readme_tables.py", file=sys.stderr)
            return 1
        print(f"{readme} is up to date")
        return 0
    if new != old:
        readme.write_text(new)
        print(f"rewrote {readme}")
    else:
        print(f"{readme} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
