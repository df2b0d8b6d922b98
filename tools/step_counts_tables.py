"""The step_counts block from benchmarks/results/step_counts_cpu*.json (for render_readme_tables.py)."""

from __future__ import annotations

import json
from pathlib import Path

STEP_COUNTS_RESULT = "benchmarks/results/step_counts_cpu.json"
STEP_COUNTS_BASELINE = "benchmarks/results/step_counts_cpu_baseline.json"  # the counts before issue 30's work
TOP_OPS_SHOWN = 5


def _target(t: dict | None) -> tuple[str, str]:
    if t is None:
        return "—", "—"
    ops = f"≤ {t['max_ops']:,.0f}" + (f" ({t['ops_bound']})" if t.get("ops_bound") else "")
    return f"{ops}, ≤ {t['max_syncs']} syncs", "yes" if t["met"] else "**no**"


def step_counts_markdown(result: dict, source: str | None = None, baseline: dict | None = None,
                         baseline_source: str | None = None) -> str:
    """Settings line, the table preset x optimizer -> ops, syncs, target, met (and the baseline's counts when
    given), the most frequent ops of the dense model, and the width check."""
    m, s, res = result["machine"], result["settings"], result["results"]
    commit = (m.get("repo_commit") or {}).get("commit", "?")
    when = result["created"][:10]
    lines = [
        f"Ops dispatched and device→host syncs in one steady-state optimizer step (step {s['warmup'] + 1}: "
        f"`optimizer.step()` and the LR scheduler's step), counted on the CPU runtime (torch {m['torch']}, "
        f"megatron-core {m['megatron_core'].split('+')[0]}, commit {commit}): {s['precision']}, world size 1, "
        f"the presets' structures at hidden {s['hidden_size']}, vocab {s['vocab_size']}"
        + (f" (`{source}`, {when})" if source else f" ({when})") + ". "
        + (" Where the code picks its path by device, the path CUDA takes (Manifold Muon's masked branches and "
           "GEMM-only DGram retraction)." if s.get("device_path") == "cuda" else "")
        + " Views (and `_unsafe_view`, which only relabels a shape) are not counted; a `torch._foreach_*` op counts "
        "once; syncs include data-dependent shapes.",
        "",
    ]
    base_res = (baseline or {}).get("results", {})
    head = "| model | optimizer | matrices | ops | syncs | target | met |"
    rule = "|---|---|---:|---:|---:|---|---|"
    if baseline is not None:
        head += " baseline ops | baseline syncs |"
        rule += "---:|---:|"
    lines += [head, rule]
    targets = result.get("targets") or {}
    for model, per in res.items():
        for name, r in per.items():
            syncs = r["syncs"] + r["dynamic_shape"]
            sync_cell = f"{syncs:,}" + (f" ({r['dynamic_shape']} dyn. shape)" if r["dynamic_shape"] else "")
            target, met = _target(targets.get(f"{model}/{name}"))
            row = f"| `{model}` | `{name}` | {r['matrices']} | {r['ops']:,} | {sync_cell} | {target} | {met} |"
            if baseline is not None:
                b = base_res.get(model, {}).get(name)
                row += (f" {b['ops']:,} | {b['syncs'] + b['dynamic_shape']:,} |" if b else " – | – |")
            lines.append(row)
    dense = next(iter(res.items()), None)
    if dense is not None:
        model, per = dense
        lines += ["", f"Most frequent ops on `{model}`:", ""]
        for name, r in per.items():
            tops = ", ".join(f"`{op.removeprefix('aten.').removesuffix('.default')}` {n:,}"
                             for op, n in r["top_ops"][:TOP_OPS_SHOWN])
            lines.append(f"- `{name}`: {tops}")
    w = result.get("width_check")
    if w:
        verdict = ("the same counts" if w["same"] else
                   f"**different counts** ({', '.join(sorted(w['differences']))})")
        lines += ["", f"Width check: `{w['model']}` at hidden {w['hidden_sizes'][1]} and vocab {w['vocab_sizes'][1]} "
                  f"gave {verdict} as at hidden {w['hidden_sizes'][0]} and vocab {w['vocab_sizes'][0]}."]
    for model, spec in s.get("models", {}).items():
        if spec.get("approximation"):
            lines += ["", f"`{model}`: {spec['approximation']}."]
    if baseline is not None:
        bc = (baseline["machine"].get("repo_commit") or {}).get("commit", "?")
        lines += ["", f"Baseline: `{baseline_source or 'baseline'}` (commit {bc}, {baseline['created'][:10]})."]
    return "\n".join(lines)


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not valid JSON ({e})")


def render_step_counts(repo: Path) -> str:
    path, base = Path(repo) / STEP_COUNTS_RESULT, Path(repo) / STEP_COUNTS_BASELINE
    if not path.exists():
        return f"_No results yet: run `make bench-counts` (writes {STEP_COUNTS_RESULT})._"
    baseline = _load(base) if base.exists() else None
    return step_counts_markdown(_load(path), source=STEP_COUNTS_RESULT, baseline=baseline,
                                baseline_source=STEP_COUNTS_BASELINE if baseline else None)
