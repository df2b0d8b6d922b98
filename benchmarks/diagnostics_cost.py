"""Cost of the weight and attention diagnostics at a preset's shapes: old exact/dense vs current.

For one layer of the preset (default ``dense-1.29b``):

- ``matrix_stats`` on QKV, proj, fc1 and fc2 at their full (TP-gathered) shapes, Gaussian (std 0.02,
  init-like): the former path (``torch.linalg.svdvals`` plus the Gram for ‖Off‖) against the
  current one (``megatron_md.training.observability.diagnostics.matrix_stats``: Lanczos on the Gram and on its
  inverse above ``EXACT_SVD_MAX_SIDE``), with the estimates' relative error against the SVD.
- The attention probe for one layer at the preset's sequence length (and any ``--seq-lengths``),
  batch 1, bf16 q/k: the former dense computation (full S×S float32 logits per head) against
  ``attention_stats`` (query chunks): wall time and peak extra resident memory, each variant in a
  fresh subprocess (peak RSS above the RSS once q and k exist).

Then per layer, × layers (one diagnostics step), and ÷ ``--diagnostics-interval`` (the default
from ``training/config.py``): the amortised cost per training step. Writes ``--out`` (JSON).

    python benchmarks/diagnostics_cost.py
    python benchmarks/diagnostics_cost.py --threads 1 --repeats 3 --seq-lengths 4096
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from optimizer_step import machine_info  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "diagnostics_cost_cpu.json"


# ----------------------------------------------------------------------------- the former paths

def old_matrix_stats(W: torch.Tensor) -> dict[str, float]:
    """The former ``matrix_stats``: a full SVD for σ_max/σ_min."""
    sv = torch.linalg.svdvals(W)
    X = W if W.shape[0] >= W.shape[1] else W.T
    gram = X.T @ X
    off = (gram.pow(2).sum() - gram.diagonal().pow(2).sum()).clamp_min(0).sqrt()
    return {"sigma_max": sv.max().item(), "sigma_min": sv.min().item(), "off_gram": off.item(),
            "fro": W.norm().item()}


def dense_attention_stats(q: torch.Tensor, k: torch.Tensor) -> tuple[float, float]:
    """The former probe body: all heads' S×S float32 logits at once."""
    q0, k0 = q.float(), k.float()
    if k0.shape[1] != q0.shape[1]:
        k0 = k0.repeat_interleave(q0.shape[1] // k0.shape[1], dim=1)
    logits = torch.einsum("shd,thd->hst", q0, k0) / math.sqrt(q0.shape[-1])
    s = logits.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=logits.device).tril()
    logits = logits.masked_fill(~causal, float("-inf"))
    probs = logits.softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()
    return logits.masked_fill(~causal, -1e30).max().item(), entropy.item()


# ----------------------------------------------------------------------------- shapes

def layer_shapes(preset: str) -> dict:
    from megatron_md.training.config import resolve

    m = resolve(preset, None, {}).model
    heads, groups, kv = m.num_attention_heads, m.num_query_groups, m.kv_channels
    fc1_rows = m.ffn_hidden_size * (2 if m.swiglu else 1)
    return {
        "hidden_size": m.hidden_size, "num_layers": m.num_layers, "seq_length": m.seq_length,
        "heads": heads, "groups": groups, "kv_channels": kv, "ffn_hidden_size": m.ffn_hidden_size,
        "swiglu": m.swiglu,
        "matrices": {  # megatron weight layout [out, in]
            "attention.qkv": [(heads + 2 * groups) * kv, m.hidden_size],
            "attention.proj": [m.hidden_size, heads * kv],
            "mlp.fc1": [fc1_rows, m.hidden_size],
            "mlp.fc2": [m.hidden_size, m.ffn_hidden_size],
        },
    }


def _timed(fn, repeats: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


# ----------------------------------------------------------------------------- attention child

def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def probe_child(variant: str, seq: int, heads: int, groups: int, d: int, repeats: int, threads: int) -> dict:
    """Runs in a fresh process: time and peak extra RSS of one probe variant."""
    from megatron_md.training.observability.diagnostics import PROBE_BLOCK_ELEMS, PROBE_CHUNK, attention_stats

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q = (2 * torch.randn(seq, heads, d, generator=g)).bfloat16()
    k = (2 * torch.randn(seq, groups, d, generator=g)).bfloat16()
    if variant == "dense":
        fn = lambda q=q, k=k: dense_attention_stats(q, k)  # noqa: E731
    else:
        fn = lambda q=q, k=k: tuple(t.item() for t in attention_stats(q, k))  # noqa: E731
    fn(q[:64], k[:64])  # first-call costs (code pages, allocator) out of the peak
    base = _rss_kib("VmRSS")
    times, (max_logit, entropy) = _timed(fn, repeats)
    peak = _rss_kib("VmHWM")
    return {"variant": variant, "seq": seq, "time_s": times, "best_s": min(times), "median_s": statistics.median(times),
            "peak_extra_mib": max(0, peak - base) / 1024, "max_logit": max_logit, "entropy": entropy,
            "chunk": PROBE_CHUNK, "block_elems": PROBE_BLOCK_ELEMS}


def run_probe(variant: str, seq: int, shapes: dict, repeats: int, threads: int, timeout: int) -> dict:
    cmd = [sys.executable, __file__, "--_probe-child", json.dumps(
        dict(variant=variant, seq=seq, heads=shapes["heads"], groups=shapes["groups"], d=shapes["kv_channels"],
             repeats=repeats, threads=threads))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "seq": seq, "error": f"timed out after {timeout}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    return {"variant": variant, "seq": seq, "error": f"exit {proc.returncode}: {proc.stderr[-500:]}"}


# ----------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="dense-1.29b")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads (default 1: on a shared 2-core machine two threads made small ops erratic)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed calls per measurement; the best is used (least disturbed on a shared machine)")
    ap.add_argument("--seq-lengths", default="", help="extra probe sequence lengths besides the preset's (comma-separated)")
    ap.add_argument("--dense-max-seq", type=int, default=4096, help="skip the dense probe above this length (memory)")
    ap.add_argument("--child-timeout", type=int, default=900)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--_probe-child", dest="probe_child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe_child:
        print("PROBE " + json.dumps(probe_child(**json.loads(args.probe_child))), flush=True)
        return 0
    from megatron_md.training.config import LoggingConfig
    from megatron_md.training.observability.diagnostics import EXACT_SVD_MAX_SIDE, LANCZOS_STEPS, matrix_stats

    torch.set_num_threads(args.threads)
    interval = LoggingConfig().diagnostics_interval
    shapes = layer_shapes(args.preset)
    layers = shapes["num_layers"]
    print(f"{args.preset}: {shapes['matrices']}, seq {shapes['seq_length']}, {layers} layers, "
          f"diagnostics every {interval} steps, {args.threads} threads", flush=True)

    g = torch.Generator().manual_seed(0)
    warm = torch.randn(512, 512, generator=g)  # first-call costs (LAPACK, allocator) out of the timings
    old_matrix_stats(warm), matrix_stats(warm), matrix_stats(warm.double().mul(torch.linspace(1, 1e-3, 512)).float())
    mats = {}
    for name, (rows, cols) in shapes["matrices"].items():
        W = torch.randn(rows, cols, generator=g) * 0.02
        old_t, new_t = [], []
        for _ in range(args.repeats):  # interleaved: background load hits both alike
            t, old = _timed(lambda: old_matrix_stats(W), 1)
            old_t += t
            t, new = _timed(lambda: matrix_stats(W), 1)
            new_t += t
        mats[name] = {
            "shape": [rows, cols], "old_s": old_t, "new_s": new_t,
            "old_best_s": min(old_t), "new_best_s": min(new_t),
            "old_median_s": statistics.median(old_t), "new_median_s": statistics.median(new_t),
            "condition_number": old["sigma_max"] / old["sigma_min"],
            "float64_gram_redo": old["sigma_max"] / new["sigma_min"] > 300.0,
            "rel_err_sigma_max": new["sigma_max"] / old["sigma_max"] - 1,
            "rel_err_sigma_min": new["sigma_min"] / old["sigma_min"] - 1,
        }
        r = mats[name]
        print(f"  matrix_stats {name:15s} {rows}x{cols}: SVD {r['old_best_s']:.2f}s -> {r['new_best_s']:.2f}s "
              f"(cond {r['condition_number']:.0f}, σ_max {r['rel_err_sigma_max']:+.2e}, "
              f"σ_min {r['rel_err_sigma_min']:+.2e})", flush=True)

    seqs = [shapes["seq_length"]] + [int(s) for s in args.seq_lengths.split(",") if s.strip()]
    probes = []
    for seq in dict.fromkeys(seqs):
        for variant in ("dense", "chunked"):
            if variant == "dense" and seq > args.dense_max_seq:
                probes.append({"variant": variant, "seq": seq, "skipped": f"above --dense-max-seq {args.dense_max_seq}"})
                continue
            r = run_probe(variant, seq, shapes, args.repeats, args.threads, args.child_timeout)
            probes.append(r)
            if "best_s" in r:
                print(f"  attention probe {variant:7s} seq {seq}: {r['best_s']:.3f}s, peak +{r['peak_extra_mib']:.0f} MiB "
                      f"(max logit {r['max_logit']:.4f}, entropy {r['entropy']:.6f})", flush=True)
            else:
                print(f"  attention probe {variant:7s} seq {seq}: {r}", flush=True)

    def probe_s(variant):
        return next((p["best_s"] for p in probes if p["variant"] == variant and p["seq"] == shapes["seq_length"]
                     and "best_s" in p), float("nan"))

    summary = {}
    for path, mkey, pkey in (("old", "old_best_s", "dense"), ("new", "new_best_s", "chunked")):
        per_layer_m = sum(r[mkey] for r in mats.values())
        per_layer = per_layer_m + probe_s(pkey)
        summary[path] = {
            "matrix_stats_per_layer_s": per_layer_m, "probe_per_layer_s": probe_s(pkey), "per_layer_s": per_layer,
            "per_diagnostics_step_s": per_layer * layers, "amortised_per_training_step_s": per_layer * layers / interval,
        }
        s = summary[path]
        print(f"  {path}: per layer {s['per_layer_s']:.2f}s (matrices {per_layer_m:.2f}s + probe {s['probe_per_layer_s']:.3f}s), "
              f"x{layers} layers {s['per_diagnostics_step_s']:.1f}s, /{interval} = {s['amortised_per_training_step_s']:.3f}s per step",
              flush=True)

    result = {
        "benchmark": "diagnostics_cost",
        "schema": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(args.threads),
        "settings": {
            "preset": args.preset, **{k: v for k, v in shapes.items()}, "diagnostics_interval": interval,
            "repeats": args.repeats, "statistic": "best of repeats (min); medians kept too", "threads": args.threads, "exact_svd_max_side": EXACT_SVD_MAX_SIDE,
            "lanczos_steps": LANCZOS_STEPS, "matrices_kind": "Gaussian, std 0.02 (init-like)",
            "probe": "batch 1 (first sequence), bf16 q/k, float32 logits; each variant in its own process",
            "not_included": "TP gathers, all_gather_object of the results, MD gain statistics",
        },
        "matrix_stats": mats,
        "attention_probe": probes,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
