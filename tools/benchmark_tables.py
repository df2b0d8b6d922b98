"""The optimizer_step, optimizer_state and gpu_bench blocks from benchmarks/results/ (for render_readme_tables.py)."""

from __future__ import annotations

import json
from pathlib import Path


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
    runs = [(n, x) for n, x in secs.items() if x.get("kind") in ("train", "moe", "moe_whole")]
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
            f" ({x['variant']})" if x.get("variant") else "") + (
            f", {x['attention_backend']} attention" if x.get("attention_backend") else "")
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
    if any(x.get("moe_grouped_gemm") is False for _, x in runs if x.get("kind") == "moe"):
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
    return "\n".join(lines + gpu_bench_issue30_lines(result))


def gpu_bench_issue30_lines(result: dict) -> list[str]:
    """The sections added by issue 30, each only when the run has it: sdpa against local attention, the
    optimizer-step profiles, the DGram retraction micro-benchmark, and the whole MoE against the plan."""
    secs, lines = result["sections"], []
    ok = {n: x for n, x in secs.items() if x.get("status") == "ok"}
    pairs = []
    for n, x in ok.items():
        if x.get("kind") == "train" and x.get("attention_backend") == "sdpa" and not x.get("variant"):
            local = next((y for y in ok.values() if y.get("kind") == "train" and y.get("optimizer") == x["optimizer"]
                          and y.get("attention_backend") == "local" and not y.get("variant")), None)
            if local:
                it, mem = (f"{_num(local.get(k), f)} → {_num(x.get(k), f)}" for k, f in
                           (("iter_ms", ",.1f"), ("peak_memory_gib", ".1f")))
                pairs.append(f"`{x['optimizer']}` {x['tokens_per_s'] / local['tokens_per_s']:.2f}x tokens/s "
                             f"({it} ms an iteration, peak {mem} GiB)")
    if pairs:
        lines += ["", "SDPA against megatron-core's local attention (same optimizer, same run): "
                  + "; ".join(pairs) + "."]
    prof = [(n, x) for n, x in secs.items() if isinstance(x.get("profile"), dict)]
    if prof:
        steps = next((x["profile"].get("steps") for _, x in prof if "steps" in x["profile"]), "?")
        lines += ["", f"Optimizer step under torch.profiler ({steps} steps after the timed run; per step; syncs are "
                  "host calls that wait for the device: cudaStreamSynchronize, cudaDeviceSynchronize, "
                  "cudaEventSynchronize, synchronous cudaMemcpy):", "",
                  "| section | kernel launches | syncs | D2H copies | GPU busy |", "|---|---:|---:|---:|---:|"]
        for n, x in prof:
            p = x["profile"]
            if "error" in p:
                lines.append(f"| `{n}` | **failed**: {p['error'][:120].replace('|', '/')} |  |  |  |")
                continue
            per = p["steps"] or 1
            lines.append(f"| `{n}` | {p['launches'] / per:,.0f} | {p['syncs'] / per:,.1f} | "
                         f"{p['memcpy_dtoh'] / per:,.1f} | {_num(p.get('gpu_busy_fraction'), '.0%')} |")
    r = secs.get("retraction")
    if r is not None:
        lines += ["", "DGram retraction (`megatron_md/optim/manifolds.py`; each variant found at run time; fp32 "
                  f"input, median of {r.get('reps', '?')} calls; off-Gram: max ‖Off(RᵀR)‖/‖RᵀR‖; to exact: "
                  "relative "
                  "distance to the fp64-eigh result, which the column-preserving variant differs from by design):"]
        if r.get("status") != "ok":
            lines += ["", _failure(r) + "."]
        else:
            lines += ["", "| retraction | batch × shape | ms | off-Gram | to exact |", "|---|---|---:|---:|---:|"]
            for row in r["rows"]:
                b, m, n_ = row["shape"]
                if row["status"] != "ok":
                    lines.append(f"| {row['name']} | {b} × {m}×{n_} | {_failure(row)} |  |  |")
                    continue
                lines.append(f"| {row['name']} | {b} × {m}×{n_} | {row['ms']:,.2f} | {row['off_gram_rel']:.1e} | "
                             f"{_num(row.get('diff_to_exact_rel'), '.1e')} |")
    w = secs.get("moe_whole")
    if w is not None and w.get("status") == "ok":
        plan = w.get("plan") or {}
        pred = (f"`megatron-md plan` predicted {plan['predicted_gib']:.1f} GiB (recompute {plan['recompute']}, "
                f"{plan['attention_kernel']} attention): measured/predicted {_num(w.get('peak_vs_plan'), '.2f')}"
                if "predicted_gib" in plan else f"no plan prediction ({plan.get('error', 'not computed')[:120]})")
        lines += ["", f"`{w['preset']}` whole on one device (`{w['optimizer']}`, {w.get('attention_backend')} "
                  f"attention, micro-batch {w['micro_batch_size']} × sequence {w['seq_length']}, {w['iterations']} "
                  f"iterations): {_num(w['tokens_per_s'], ',.0f')} tokens/s, optimizer step "
                  f"{_num(w['optimizer_step_ms'], ',.0f')} ms, "
                  f"peak {_num(w.get('peak_memory_gib'), '.1f')} GiB; {pred}."]
    return lines


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


# ----------------------------------------------------------------------------- max_logit_cost

MAX_LOGIT_COST_RESULT = "benchmarks/results/max_logit_cost_cpu.json"


def max_logit_cost_markdown(result: dict, source: str) -> str:
    m = result.get("machine", {})
    lines = [f"From `{source}` ({result.get('date', '?')}, {m.get('cpu', 'CPU')}, {result.get('threads')} thread(s), "
             f"median of {result.get('repeats')}; fp32, batch 1, one rank's heads, head dim 128). Attention = the "
             "core attention's forward + backward; probe = the no-grad measurement of every head's largest logit.",
             "", "| preset | heads / groups | sequence | sdpa (ms) | probe: chunked Q·Kᵀ (ms) | share | local (ms) "
             "| probe: its scores (ms) | share |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ms = r["ms"]
        lines.append(f"| {r['preset']} | {r['heads']} / {r['groups']} | {r['seq']} | {ms['sdpa']:.1f} | "
                     f"{ms['probe_qk']:.1f} | {100 * r['sdpa_share']:.1f}% | {ms['local']:.1f} | "
                     f"{ms['probe_scores']:.1f} | {100 * r['local_share']:.1f}% |")
    return "\n".join(lines)


def render_max_logit_cost(repo: Path) -> str:
    path = repo / MAX_LOGIT_COST_RESULT
    if not path.exists():
        return "_No results yet: run `python benchmarks/max_logit_cost.py --threads 1`._"
    return max_logit_cost_markdown(json.loads(path.read_text()), MAX_LOGIT_COST_RESULT)


LOADER_RESULT = "benchmarks/results/loader_cpu.json"


def loader_markdown(doc: dict, source: str) -> str:
    s, m = doc["settings"], doc["machine"]
    head = (f"The input pipeline on the CPU runtime (`{source}`, {doc['created']}, {m.get('cpu', 'CPU')}; "
            f"`benchmarks/loader.py`): one rank, micro-batches of 1 x {s['seq_length']} tokens from the embedded "
            f"corpus; *delivered* is the DataLoader alone after its first batch, *in training* a {s['model']} run at "
            "that length with `--timing-log-level 2` (the `batch-generator` timer over the iteration time).")
    rows = ["| --num-workers | delivered (tokens/s) | first batch (ms) | iteration (ms) | wait for data (ms) | "
            "share of the iteration |", "|---:|---:|---:|---:|---:|---:|"]
    for r in doc["results"]:
        rows.append(f"| {r['workers']} | {r['tokens_per_s']:,.0f} | {r['first_batch_ms']:.0f} | {r['iter_ms']:.0f} | "
                    f"{r['batch_wait_ms']:.1f} | {100 * r['wait_share']:.2f}% |")
    return head + "\n\n" + "\n".join(rows)


def render_loader(repo: Path) -> str:
    path = repo / LOADER_RESULT
    if not path.exists():
        return "_No results yet: run `python benchmarks/loader.py`._"
    return loader_markdown(json.loads(path.read_text()), LOADER_RESULT)
