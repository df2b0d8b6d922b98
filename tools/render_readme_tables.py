"""Rewrite the generated blocks of README.md and docs/*.md from the stored results.

Each generated block sits between two marker lines, in whichever of README.md and docs/*.md holds it
(each block in exactly one of them; the tool finds it there and rewrites that page)::

    <!-- BEGIN optimizer_step -->
    ...generated, do not edit by hand...
    <!-- END optimizer_step -->

``optimizer_step`` and ``optimizer_state``: every ``benchmarks/results/*.json`` written by
``benchmarks/optimizer_step.py`` / ``benchmarks/optimizer_state.py`` (sorted by file name), one table each.
``ns_engine``: ``benchmarks/results/ns_engine_cpu.json`` from ``benchmarks/ns_engine.py`` (tables in
``tools/ns_engine_tables.py``). ``gpu_bench``: ``benchmarks/results/gpu_bench_h200.json`` from
``benchmarks/gpu_bench.py`` (``tools/gpu_bench.sh``), or a line saying it has not been run. ``plan``:
``benchmarks/results/plan_8xh100.json`` from ``tools/plan_tables.py --generate`` (``megatron-md plan --json``).
``records_*``: the judged ``records/<date>-<kind>/`` of each kind, summarised and judged by
``megatron_md.sweep.records`` from their CSVs and cells' metrics.jsonl. Links in a block are written from the
repository root and made relative to the page it lands in (``../records/...`` in docs/).
Standard library only: no torch import.

Each ``records/<date>-<kind>/README.md`` with a ``record_summary`` block gets that record's table, and
its ``record_claims`` block the claims it is judged on (the judged records only).

    python tools/render_readme_tables.py            # rewrite the pages (and the records' READMEs) in place
    python tools/render_readme_tables.py --check    # exit 1 if any of them is out of date, 2 if a block is
                                                    # missing, duplicated or unknown
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ns_engine_tables import ns_engine_markdown, render_ns_engine  # noqa: E402,F401  (re-exported)
from plan_tables import render_plan  # noqa: E402

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


def optimizer_state_markdown(result: dict) -> str:
    """Per-rank optimizer-state bytes, DP1 vs DPn (benchmarks/optimizer_state.py)."""
    s = result["settings"]
    mib = 1 / 2**20
    bound = next((r["bound"] for r in result["results"].values() if "bound" in r), 0.55)
    lines = [
        f"Per-rank optimizer state, layer-wise distributed optimizer, bf16: `{s['model']}` "
        f"({s['parameters']:,} parameters), DP1 vs DP{s['dp']} (largest rank), after one step; "
        f"CPU runtime, `{result['source']}`.",
        "",
        f"| optimizer | MD state DP1 (MiB) | MD state DP{s['dp']} max (MiB) | ratio (bound {bound}) "
        f"| all state + fp32 masters DP1 (MiB) | DP{s['dp']} max (MiB) | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result["results"].items():
        md1, mdn = r["dp1"]["md_state"], max(x["md_state"] for x in r["dpn"])
        ratio = f"{r['md_state_ratio']:.3f} ({'met' if r['met'] else 'NOT met'})" if "md_state_ratio" in r else "–"
        a1, an = r["dp1"]["all_state"], max(x["all_state"] for x in r["dpn"])
        lines.append(f"| {name} | {md1 * mib:.1f} | {mdn * mib:.1f} | {ratio} | {a1 * mib:.1f} | {an * mib:.1f} "
                     f"| {r['all_state_ratio']:.3f} |")
    return "\n".join(lines)


def render_optimizer_state(repo: Path) -> str:
    blocks = []
    for path in sorted((repo / "benchmarks" / "results").glob("optimizer_state*.json")):
        result = json.loads(path.read_text())
        if result.get("benchmark") == "optimizer_state":
            blocks.append(optimizer_state_markdown(result))
    return "\n\n".join(blocks) or "_No results yet: run `python benchmarks/optimizer_state.py`._"


# ----------------------------------------------------------------------------- gpu_bench

GPU_BENCH_RESULT = "benchmarks/results/gpu_bench_h200.json"


def _num(v, fmt: str, scale: float = 1.0) -> str:
    return "–" if v is None else format(v * scale, fmt)


def _failure(sec: dict) -> str:
    error = (sec.get("error") or "").strip().splitlines()
    text = error[0] if error else "no error text"
    return f"**{sec['status']}**: {text[:160].replace('|', '/')}"


def gpu_bench_markdown(result: dict, source: str | None = None) -> str:
    """The Markdown for one benchmarks/gpu_bench.py result: settings line, throughput table, GEMM, resume."""
    m, s, peak, secs = result["machine"], result["settings"], result["peak"], result["sections"]
    runs = [(n, x) for n, x in secs.items() if x.get("kind") in ("train", "moe")]
    shapes = []
    for _, x in runs:
        mod = x.get("model")
        if x.get("status") == "ok" and mod and mod["preset"] not in [p for p, _ in shapes]:
            shape = f"{mod['num_layers']} layers, hidden {mod['hidden_size']}, vocab {mod['vocab_size']}"
            if mod.get("num_experts"):
                shape += (f", {mod['num_experts']} experts top-{mod['moe_router_topk']} ({x.get('experts_module')}, "
                          f"grouped GEMM {'on' if x.get('moe_grouped_gemm') else 'off'})")
            shapes.append((mod["preset"], f"`{mod['preset']}` ({shape}, {mod['parameters_active'] / 1e6:.0f}M active "
                                          f"parameters) at sequence {x['seq_length']}, micro-batch {x['micro_batch_size']}"))
    spec = next((x.get("layer_spec") for _, x in runs if x.get("layer_spec")), None)
    te = m.get("transformer_engine")
    head = []
    if result.get("sample"):
        head.append("**Sample data for the tests, not a measurement.**")
    when = result["created"][:10]
    head.append(
        f"GPU benchmark on {m['device']} (torch {m['torch']}, CUDA {m.get('cuda')}, megatron-core "
        f"{(m.get('megatron_core') or '?').split('+')[0]}, layer spec {spec or 'unknown'}"
        f"{f', Transformer Engine {te}' if te else ', no Transformer Engine'})"
        + (f" (`{source}`, {when})" if source else f" ({when})") + ": "
        + "; ".join([d for _, d in shapes] + [s["precision"]])
        + f"; medians over the iterations after {s['warmup']} warmup (of {s['steps']}; MoE fewer)."
    )
    gemm = secs.get("gemm")
    spec_tf = peak.get("spec_tflops")
    peaks = [f"{spec_tf:g} TFLOP/s bf16 dense spec" if spec_tf else "no spec peak for this device"]
    if peak.get("measured_gemm_tflops"):
        peaks.append(f"{peak['measured_gemm_tflops']:.0f} TFLOP/s measured ({peak.get('measured_gemm', 'GEMM')})")
    elif gemm is not None:
        peaks.append(f"GEMM {_failure(gemm)}")
    formula = result["flops"]["formula"]
    head.append(f"MFU against {' and '.join(peaks)}. {formula[:1].upper() + formula[1:]}.")
    lines = [" ".join(head), ""]
    if result.get("status") != "ok":
        bad = [n for n, x in secs.items() if x.get("status") != "ok"]
        lines += [f"Partial run: {len(secs) - len(bad)} of {len(secs)} sections finished ({', '.join(bad)} did not).", ""]
    lines += ["| model | optimizer | tokens/s | model TFLOP/s | MFU (spec) | MFU (GEMM) | iteration (ms) "
              "| optimizer step (ms) | step share | peak memory (GiB) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for _, x in runs:
        label = f"`{x.get('preset', '?')}`"
        opt = f"`{x.get('optimizer', '?')}`" + (" (fallback)" if x.get("note") else "") + (
            f" ({x['variant']})" if x.get("variant") else "")
        if x.get("status") != "ok":
            lines.append(f"| {label} | {opt} | {_failure(x)} |  |  |  |  |  |  |  |")
            continue
        lines.append(
            f"| {label} | {opt} | {_num(x['tokens_per_s'], ',.0f')} | {_num(x['model_tflops'], '.1f')} "
            f"| {_num(x.get('mfu_spec'), '.1%')} | {_num(x.get('mfu_gemm'), '.1%')} | {_num(x['iter_ms'], ',.1f')} "
            f"| {_num(x['optimizer_step_ms'], ',.1f')} | {_num(x['optimizer_step_share'], '.1%')} "
            f"| {_num(x.get('peak_memory_gib'), '.1f')} |")
    notes = [f"`{x['optimizer']}` on `{x['preset']}`: {x['note']}" for _, x in runs if x.get("note")]
    notes += [f"`{n}` stopped early at its time limit ({x['iterations']} iterations)."
              for n, x in runs if x.get("stopped_early")]
    notes += [f"`{n}`: {x['skipped_steps']} steps skipped (non-finite)." for n, x in runs if x.get("skipped_steps")]
    if any(x.get("moe_grouped_gemm") is False for _, x in runs):
        notes.append("MoE grouped GEMM was asked for (`--moe-grouped-gemm`) but is off: megatron-core 0.19 builds "
                     "grouped experts (TEGroupedMLP) only with Transformer Engine, so SequentialMLP ran.")
    sr = secs.get("save_resume")
    if sr is not None:
        what = (f"Save and resume (`{sr.get('optimizer')}`, `{sr.get('preset')}` at sequence {sr.get('seq_length')}, "
                f"{sr.get('iters_before_save')} iterations, save, resume, {sr.get('iters_after_resume')} more): ")
        if sr.get("status") == "ok":
            what += ("resumed losses equal the straight run's bit for bit" if sr["bit_identical"] else
                     f"resumed losses match the straight run's within rel {sr['tolerance_rel']:g} "
                     f"(max rel difference {sr['max_rel_diff']:.1e})")
            if sr.get("checkpoint_bytes"):
                what += f"; checkpoint {sr['checkpoint_bytes'] / 2**30:.2f} GiB"
        elif sr.get("status") == "mismatch":
            what += (f"the resume ran, but its losses differ from the straight run's (max rel "
                     f"{sr['max_rel_diff']:.1e} > {sr['tolerance_rel']:g})")
        else:
            what += _failure(sr)
        notes.append(what + ".")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def render_gpu_bench(repo: Path) -> str:
    path = repo / GPU_BENCH_RESULT
    if not path.exists():
        return ("_The GPU benchmark has not been run on a device yet: run `bash tools/gpu_bench.sh` on a GPU "
                f"machine and copy its `gpu_bench.json` to `{GPU_BENCH_RESULT}`._")
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not valid JSON ({e})")
    return gpu_bench_markdown(result, source=GPU_BENCH_RESULT)


# ----------------------------------------------------------------------------- records (CPU experiments)

GEOMETRY = {  # preset -> (attention, MLP), the presets' table in docs/optimizers.md
    "unconstrained": ("Muon + WD", "Muon + WD"), "all-stiefel": ("Stiefel", "Stiefel"),
    "all-dgram": ("DGram", "DGram"), "hetero": ("Stiefel", "DGram"), "hetero-inv": ("DGram", "Stiefel"),
    "hetero-md": ("Stiefel", "MD sphere + gains"),
}
ABLATION_FLAGS = {"rowcol": "(defaults: --md-gains rowcol --md-gain-param softplus, no warmup)",
                  "row": "--md-gains row", "col": "--md-gains col", "none": "--md-gains none (Muon + sphere)",
                  "direct": "--md-gain-param direct", "warmup-10pct": "--warmups 10%",
                  "paper-lrs": "--lr 1e-3 --embedding-lr 3e-3 (the paper's fixed LRs)",
                  "flat": "--md-gains flat (one scalar per matrix)", "offset": "--md-gain-param offset",
                  "wd-0.1": "--weight-decays 0.1", "lion": "--optimizer lion_md (Lion base update)",
                  "adam": "--optimizer adam_md (Adam base update)",
                  "adam-hs-u": "--optimizer adam_md --md-normalize-update (the authors' --hs-u)"}


def _records():
    sys.path.insert(0, str(REPO))
    from megatron_md.sweep import records

    return records


def _loss(b) -> str:
    import math

    if not math.isfinite(b.mean):
        return "diverged"
    return f"{b.mean:.4f} ± {b.std:.4f}" if math.isfinite(b.std) else f"{b.mean:.4f}"


def _no_record(kind: str) -> str:
    return f"_No `records/*-{kind}` yet._"


def render_lr_transfer(repo: Path, rec: Path | None = None) -> str:
    R = _records()
    rec = rec or R.latest(repo, "lr-transfer")
    if rec is None:
        return _no_record("lr-transfer")
    best = R.lr_transfer(rec)
    widths = sorted({w for per in best.values() for w in per})
    rel = rec.relative_to(repo)
    any_b = next(iter(next(iter(best.values())).values()))
    lines = [f"Best LR per width (swept LR `1e-3·2^(k/2)`; final {any_b.kind} loss, mean ± std over seeds at that LR; "
             f"† = optimum on the grid's edge). From `{rel}/results.csv`; plot `{rel}/lr_transfer.png`.", "",
             "| optimizer | warmup, wd | " + " | ".join(f"width {w}" for w in widths) + " |",
             "|---|---|" + "---|" * len(widths)]
    for opt in ("adamw", "muon", "muon_md", *sorted(set(best) - {"adamw", "muon", "muon_md"})):
        if opt not in best:
            continue
        per = best[opt]
        first = next(iter(per.values()))
        cells = []
        for w in widths:
            b = per.get(w)
            if b is None:
                cells.append("–")
            elif b.lr is None:
                cells.append("all diverged")
            else:
                cells.append(f"k={b.k:g} ({b.lr:.3g}){'' if b.inside else ' †'}: {_loss(b)} (n={b.n})")
        lines.append(f"| `{opt}` | {first.warmup}, {first.weight_decay:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_md_ablations(repo: Path, rec: Path | None = None) -> str:
    R = _records()
    rec = rec or R.latest(repo, "md-ablations")
    if rec is None:
        return _no_record("md-ablations")
    v = R.ablations(rec)
    rel = rec.relative_to(repo)
    base = v.get("rowcol")
    width = next(iter(v.values())).width
    lines = [f"MuonMD variants at width {width} (best matrix LR of each; mean ± std over seeds). From "
             f"`{rel}/variants/*/results.csv`; plot `{rel}/ablations.png`.", "",
             "| variant | flags | best matrix LR | final loss | minus row+col |", "|---|---|---|---|---:|"]
    for name in sorted(v, key=lambda n: (n != "rowcol", n)):
        b = v[name]
        delta = f"{b.mean - base.mean:+.4f}" if base is not None and name != "rowcol" else ""
        lr = "all diverged" if b.lr is None else f"{b.lr:.3g} (k={b.k:g}){'' if b.inside else ' †'}"
        lines.append(f"| {name} | `{ABLATION_FLAGS.get(name, '')}` | {lr} | {_loss(b)} | {delta} |")
    return "\n".join(lines)


def render_manifold(repo: Path, rec: Path | None = None) -> str:
    import math

    R = _records()
    rec = rec or R.latest(repo, "manifold-geometry")
    if rec is None:
        return _no_record("manifold-geometry")
    rel = rec.relative_to(repo)
    out = []
    for set_name in R.manifold_sets(rec):
        runs = R.manifold_runs(rec, set_name)
        best = R.manifold_best(runs)
        steps = max(r.steps for r in runs)
        lr = runs[0].lr
        out += [f"**{set_name}**: matrix LR {lr:g}, {steps} steps, {len(set(r.seed for r in runs))} seed(s) "
                f"(`{rel}/{set_name}/`). σ_max and max logit: first logged → last (peak), the largest over layers "
                "(and over the two matrices of a block), averaged over seeds.", "",
                "| preset | attention | MLP | final eval loss | attention σ_max | MLP σ_max | max attention logit "
                "| diverged or spiked |", "|---|---|---|---|---|---|---|---|"]

        def trio(rs, kind):
            vals = [(r.first.get(kind), r.last.get(kind), r.peak.get(kind)) for r in rs]
            if any(x is None for t in vals for x in t):
                return "–"
            m = [sum(t[i] for t in vals) / len(vals) for i in range(3)]
            return f"{m[0]:.2f} → {m[1]:.2f} ({m[2]:.2f})"

        for preset in R.PRESETS:
            rs = [r for r in runs if r.preset == preset]
            if not rs:
                continue
            att, mlp = GEOMETRY.get(preset, ("?", "?"))
            bad = sum(1 for r in rs if r.status != "ok" or r.spiked)
            loss = _loss(best[preset]) if math.isfinite(best[preset].mean) else "diverged"
            out.append(f"| {preset} | {att} | {mlp} | {loss} | {trio(rs, 'attn_sigma_max')} | "
                       f"{trio(rs, 'mlp_sigma_max')} | {trio(rs, 'max_logit')} | {bad}/{len(rs)} |")
        out.append("")
    return "\n".join(out) if out else _no_record("manifold-geometry")


def render_regime_probe(repo: Path, rec: Path | None = None) -> str:
    """How far each probed curve rises one grid step either side of its optimum (megatron_md/sweep/curvature.py)."""
    R = _records()
    rec = rec or R.latest(repo, "regime-probe")
    if rec is None:
        return _no_record("regime-probe")
    from megatron_md.sweep.curvature import curvature, curvature_markdown
    from megatron_md.sweep.results import read_csv

    rows = read_csv(rec / "results.csv")
    seeds = len({r["seed"] for r in rows})
    return (f"Rise of the final eval loss one grid step (a factor 2 in LR) below and above each curve's optimum, "
            f"in standard errors of the difference over seeds (unpaired; paired: of the per-seed differences); "
            f"up to {seeds} seeds. From `{rec.relative_to(repo).as_posix()}/results.csv`.\n\n"
            + curvature_markdown(curvature(rows)))


def render_claims(repo: Path, only: Path | None = None) -> str:
    """Every claim of the judged records (records.judged), or (``only``) the claims that one record judges."""
    R = _records()
    claims = []
    transfer = R.latest(repo, "lr-transfer")  # the ablations compare against its Muon
    judges = {"lr-transfer": R.lr_transfer_claims, "manifold-geometry": R.manifold_claims,
              "md-ablations": lambda rec, rel: R.ablation_claims(rec, rel, transfer)}
    for kind in CLAIM_KINDS:
        for rec in R.judged(repo, kind):
            if only is None or Path(only).resolve() == rec.resolve():
                claims += judges[kind](rec, str(rec.relative_to(repo)))
    if not claims:
        return "_No records yet._"
    lines = ["| claim | at this scale | evidence (loss gaps: mean difference ± 2 standard errors) | reproduce |",
             "|---|---|---|---|"]
    for c in claims:
        lines.append(f"| {c.claim} | **{c.verdict}** | {c.evidence} | `bash {c.record}/reproduce.sh` |")
    return "\n".join(lines)


def with_figures(render_table: Callable[..., str], kind: str, pattern: str, alt: str) -> Callable[[Path], str]:
    """``render_table`` followed by the record's figures matching ``pattern``, linked from the repository root
    (``render`` makes the links relative to the page; a record's own README links its figures itself), for
    each judged record of the kind, newest first."""
    def one(repo: Path, rec: Path | None) -> str:
        figures = sorted(rec.glob(pattern)) if rec is not None else []

        def link(f: Path) -> str:
            label = f" ({f.stem.partition('_')[2] or f.stem})" if len(figures) > 1 else ""  # spectra_lr0.1 -> lr0.1
            return f"![{alt}{label}]({f.relative_to(repo).as_posix()})"
        return "\n\n".join([render_table(repo, rec), *map(link, figures)])

    def block(repo: Path) -> str:
        recs = _records().judged(repo, kind)
        return "\n\n".join(one(repo, rec) for rec in recs) if recs else one(repo, None)
    return block


BLOCKS: dict[str, Callable[[Path], str]] = {
    "optimizer_step": render_optimizer_step,
    "optimizer_state": render_optimizer_state,
    "ns_engine": render_ns_engine,
    "gpu_bench": render_gpu_bench,
    "plan": render_plan,
    "records_claims": render_claims,
    "records_regime_probe": render_regime_probe,
    "records_lr_transfer": with_figures(render_lr_transfer, "lr-transfer", "lr_transfer.png",
                                        "final loss vs LR per width, optimum marked"),
    "records_md_ablations": with_figures(render_md_ablations, "md-ablations", "ablations.png",
                                         "final loss vs matrix LR per MuonMD variant"),
    "records_manifold": with_figures(render_manifold, "manifold-geometry", "spectra_*.png",
                                     "attention and MLP σ_max, max attention logit"),
}


# ----------------------------------------------------------------------------- splicing

MARKER = re.compile(r"^<!-- (BEGIN|END) ([A-Za-z0-9_]+) -->$", re.MULTILINE)  # a marker is a line of its own
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")  # [text](target) and ![alt](target)


class MarkersMissing(ValueError):
    pass


def doc_files(repo: Path) -> list[Path]:
    """The pages that may hold generated blocks: README.md and docs/*.md."""
    return [f for f in [Path(repo) / "README.md", *sorted((Path(repo) / "docs").glob("*.md"))] if f.is_file()]


def locate(files, names=None, known=None) -> dict[str, Path]:
    """Which of ``files`` holds each block of ``names`` (default: every known block). Each must appear exactly
    once across the files, as a BEGIN line followed by its END line; a marker of an unknown name is an error
    too (a typo would otherwise leave a block unrendered). Raises MarkersMissing listing every problem."""
    known = set(BLOCKS if known is None else known)
    names = list(names or known)
    seen: dict[str, list[tuple[Path, str, int]]] = {}
    for f in files:
        for m in MARKER.finditer(Path(f).read_text()):
            seen.setdefault(m[2], []).append((Path(f), m[1], m.start()))
    problems = [f"{f}: unknown block '{n}' (known: {', '.join(sorted(known))})"
                for n, hits in seen.items() if n not in known for f in sorted({h[0] for h in hits})]
    where = {}
    for name in names:
        hits = seen.get(name, [])
        begins = [h for h in hits if h[1] == "BEGIN"]
        ends = [h for h in hits if h[1] == "END"]
        begin, end = BEGIN.format(name=name), END.format(name=name)
        if not hits:
            problems.append(f"no '{begin}' ... '{end}' in {', '.join(map(str, files)) or 'no files'}: "
                            f"add the pair, each on a line of its own, where the {name} block belongs")
        elif len(begins) != 1 or len(ends) != 1 or begins[0][0] != ends[0][0] or begins[0][2] > ends[0][2]:
            places = "; ".join(f"{h[1]} in {h[0]}" for h in hits)
            problems.append(f"block '{name}' must appear exactly once, '{begin}' before '{end}' in the same "
                            f"file, across {len(files)} file(s); found: {places}")
        else:
            where[name] = begins[0][0]
    if problems:
        raise MarkersMissing("\n".join(problems))
    return where


def relink(body: str, repo: Path, page: Path) -> str:
    """``body``'s relative Markdown links, written from the repository root, made relative to ``page``'s folder
    (a block in docs/ links ../records/...). URLs, anchors and absolute paths are left alone."""
    base = Path(page).resolve().parent
    root = Path(repo).resolve()

    def fix(m: re.Match) -> str:
        target = m[2]
        if "://" in target or target.startswith(("#", "/", "mailto:")):
            return m[0]
        path, hash_, anchor = target.partition("#")
        rel = Path(os.path.relpath(root / path, base)).as_posix()
        return f"{m[1]}{rel}{hash_}{anchor}{m[3]}"
    return LINK.sub(fix, body)


def splice(text: str, name: str, body: str) -> str:
    """``text`` with the lines between the ``name`` markers replaced by ``body``."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    pattern = re.compile("^" + re.escape(begin) + r"$.*?^" + re.escape(end) + "$", re.DOTALL | re.MULTILINE)
    if len(pattern.findall(text)) != 1:
        raise MarkersMissing(
            f"expected exactly one pair of markers '{begin}' ... '{end}', each on a line of its own "
            f"(found {len(pattern.findall(text))}); add them where the {name} block belongs"
        )
    return pattern.sub(lambda _: f"{begin}\n{body.strip()}\n{end}", text, count=1)


def render(text: str, repo: Path, names=None, page: Path | None = None) -> str:
    """``text`` (the page ``page``, default ``repo``/README.md) with the blocks ``names`` (default: all)
    rendered; their links are made relative to the page."""
    page = Path(repo) / "README.md" if page is None else page
    for name in names or BLOCKS:
        text = splice(text, name, relink(BLOCKS[name](repo), repo, page))
    return text


RECORD_KINDS = {"lr-transfer": render_lr_transfer, "md-ablations": render_md_ablations,
                "manifold-geometry": render_manifold, "regime-probe": render_regime_probe}
CLAIM_KINDS = ("lr-transfer", "md-ablations", "manifold-geometry")  # a probe judges no claim of the papers


def record_kind(name: str):
    """The kind of a record directory, from the end of its name (None if it is none of them)."""
    return next((k for k in RECORD_KINDS if name.endswith("-" + k)), None)


def render_record(readme_text: str, repo: Path, rec: Path) -> str:
    """A record's own README: its ``record_summary`` (the table of that record) and ``record_claims``."""
    kind = record_kind(rec.name)
    if kind is None:
        raise MarkersMissing(f"{rec.name} does not end with one of -{', -'.join(RECORD_KINDS)}")
    page = rec / "README.md"
    readme_text = splice(readme_text, "record_summary", relink(RECORD_KINDS[kind](repo, rec), repo, page))
    if kind in CLAIM_KINDS and any(r.resolve() == rec.resolve() for r in _records().judged(repo, kind)):
        readme_text = splice(readme_text, "record_claims", relink(render_claims(repo, only=rec), repo, page))
    return readme_text


def record_readmes(repo: Path) -> list[Path]:
    """records/*/README.md that carry a record_summary block (and hold results)."""
    out = []
    for readme in sorted(Path(repo).glob("records/*/README.md")):
        kind = record_kind(readme.parent.name)
        if kind and BEGIN.format(name="record_summary") in readme.read_text() and \
                any(readme.parent.glob(_records().RESULTS_GLOB[kind])):
            out.append(readme)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Rewrite the generated blocks of README.md and docs/*.md "
                                             "(and of the records' READMEs) from benchmarks/results/ and records/.")
    ap.add_argument("--file", "--readme", dest="files", action="append", metavar="PAGE",
                    help="a Markdown page to search for blocks (repeatable; default: README.md and docs/*.md "
                         "of --repo). Every block asked for must be in exactly one of them")
    ap.add_argument("--repo", default=str(REPO), help="where benchmarks/results/ and records/ are read")
    ap.add_argument("--check", action="store_true", help="exit 1 if a page is out of date; write nothing")
    ap.add_argument("--block", action="append", choices=sorted(BLOCKS), help="only this block (repeatable)")
    args = ap.parse_args(argv)
    repo = Path(args.repo)
    pages = [Path(f) for f in args.files] if args.files else doc_files(repo)
    try:
        where = locate(pages, args.block)
    except MarkersMissing as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    jobs = []
    for page in dict.fromkeys(where.values()):  # each page once, in the order of the blocks
        names = [n for n, p in where.items() if p == page]
        jobs.append((page, lambda text, page=page, names=names: render(text, repo, names, page)))
    if not args.block:  # the records' own READMEs too
        jobs += [(r, lambda text, rec=r.parent: render_record(text, repo, rec)) for r in record_readmes(repo)]
    updates = []  # rendered in full before anything is written
    for page, fn in jobs:
        old = page.read_text()
        try:
            updates.append((page, old, fn(old)))
        except MarkersMissing as e:
            print(f"error: {page}: {e}", file=sys.stderr)
            return 2
    stale = 0
    for page, old, new in updates:
        if args.check:
            if new != old:
                diff = difflib.unified_diff(old.splitlines(), new.splitlines(), str(page), "generated", lineterm="")
                print("\n".join(diff))
                print(f"{page} is out of date: run python tools/render_readme_tables.py", file=sys.stderr)
                stale += 1
            else:
                print(f"{page} is up to date")
        elif new != old:
            page.write_text(new)
            print(f"rewrote {page}")
        else:
            print(f"{page} already up to date")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
