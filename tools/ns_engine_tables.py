"""The ``ns_engine`` block of docs/performance.md, from ``benchmarks/ns_engine.py`` (imported by
``render_readme_tables.py``)."""

from __future__ import annotations

import json
from pathlib import Path


def _verdict(v: dict) -> str:
    return "met" if v.get("met") else "**NOT met**"


def _gf(x: float) -> str:
    return f"{x / 1e9:,.1f}"


def ns_engine_markdown(result: dict) -> str:
    """One table per section, each with its target and verdict (values from the JSON only)."""
    s, v = result.get("sections", {}), result.get("verdicts", {})
    m = result.get("machine", {})
    out = [f"Orthogonalisation engine on CPU ({m.get('cpu', '?')}, gloo, `benchmarks/ns_engine.py`, "
           f"`benchmarks/results/ns_engine_cpu.json`).", ""]
    if "tp2_time" in s:
        t = s["tp2_time"]
        out += [f"**TP2, optimizer step** ({t['model']} at its real shape, {t['layout']}; median of "
                f"{len(next(iter(t['step_s'].values())))} round-robin steps, each the slowest rank's time):", "",
                "| optimizer | step median (ms) |", "|---|---:|"]
        out += [f"| `{k}` | {1e3 * x:,.0f} |" for k, x in t["median_step_s"].items()]
        out += [""]
        for k, x in t["ratios"].items():
            vv = v.get(f"tp2 {k}", {})
            out.append(f"- {k} = **{x:.3f}** (target ≤ {vv.get('max', '?')}: {_verdict(vv)})")
        out.append("")
    if "flops" in s:
        out += ["**NS FLOPs per rank**, counted by the engine over one step against the analytic total of "
                "orthogonalising every block once (`muon_md`):", "",
                "| layout | model | analytic GFLOP | per rank GFLOP | sum / analytic | max / mean | NS calls per rank "
                "| buckets per rank |", "|---|---|---:|---|---:|---:|---|---|"]
        for label, r in s["flops"]["rows"].items():
            per = ", ".join(_gf(x) for x in r["flops_per_rank"])
            out.append(f"| {label} | {r['model']} | {_gf(r['analytic_flops'])} | {per} | "
                       f"{r['sum_over_analytic']:.4f} | {r['max_over_mean']:.3f} | "
                       f"{', '.join(map(str, r['ns_calls_per_rank']))} | "
                       f"{', '.join(map(str, r['buckets_per_rank']))} |")
        bad = [k for k, x in v.items() if k.startswith("flops") and not x.get("met")]
        out += ["", "Targets: sum within 1% of the analytic total, max/mean ≤ 1.15: "
                + ("all met." if not bad else "NOT met: " + "; ".join(bad) + "."), ""]
    if "comm" in s:
        c = s["comm"]
        b = c["bytes_max_rank"]
        vv = v.get("comm muon_md/adam", {})
        out += [f"**Communication per step** ({c['model']}, {c['layout']}; payload bytes handed to process-group "
                "calls by the busiest rank during DDP grad sync + `optimizer.step()`):", "",
                "| optimizer | MiB per rank per step |", "|---|---:|"]
        out += [f"| `{k}` | {x / 2**20:,.1f} |" for k, x in b.items()]
        out += ["", f"muon_md / distributed Adam = **{c['ratio']['muon_md/adam']:.3f}** (target ≤ 1.25: "
                f"{_verdict(vv)}).", ""]
    if "ns_rate" in s:
        r = s["ns_rate"]
        vv = v.get("ns_rate min fraction of GEMM", {})
        out += [f"**NS rate against this machine's GEMM rate** (world 1, {r['threads']} threads, {r['dtype']}, one "
                "bucket per dense-181m shape, all 12 layers stacked):", "",
                "| bucket | NS GFLOP/s | best NS-GEMM GFLOP/s | fraction |", "|---|---:|---:|---:|"]
        for name, row in r["rows"].items():
            out.append(f"| {row['batch']} × {name} | {row['ns_gflops']:,.1f} | {row['peak_gemm_gflops']:,.1f} | "
                       f"{row['fraction']:.3f} |")
        out += ["", f"Lowest fraction {r['min_fraction']:.3f} (target ≥ 0.7: {_verdict(vv)}).", ""]
    if "moe64" in s:
        r = s["moe64"]
        e = r["engine"]["batched"]
        vv = v.get("moe64 batched/per_matrix time", {})
        md = r["model"]
        out += [f"**MoE with {md['num_experts']} experts per layer** (world 1, {md['num_layers']} layers, hidden "
                f"{md['hidden_size']}, expert FFN {md['moe_ffn_hidden_size']}): NS calls per step "
                f"{e['ns_calls']} for {e['matrices']} matrices in {e['buckets']} buckets "
                f"({'equal' if r['calls_equal_buckets'] else 'NOT equal'}); per-matrix loop "
                f"{r['engine']['per_matrix']['ns_calls']} calls. Step median batched "
                f"{1e3 * r['median_step_s']['batched']:,.0f} ms, per-matrix {1e3 * r['median_step_s']['per_matrix']:,.0f} "
                f"ms: ratio **{r['ratio']['batched/per_matrix']:.3f}** (target ≤ 1: {_verdict(vv)}).", ""]
    return "\n".join(out).rstrip()


def render_ns_engine(repo: Path) -> str:
    path = repo / "benchmarks" / "results" / "ns_engine_cpu.json"
    if not path.exists():
        return "_No results yet: run `python benchmarks/ns_engine.py`._"
    return ns_engine_markdown(json.loads(path.read_text()))
