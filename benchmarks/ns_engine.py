"""The orthogonalisation engine, counted and timed on gloo: who runs Newton-Schulz, how often, at what cost.

Every section is one torchrun on the CPU runtime (or one process); every figure comes from this run:

- ``tp2_time``: ``dense-181m`` at its real shape (12 layers, vocab 131072) at TP2 (2 ranks). Optimizer-step
  time of muon_md (engine: one owner per matrix, batched by shape), muon_md ``--muon-tp-mode duplicated``
  (every TP rank runs every NS) and megatron's ``muon --muon-tp-mode duplicated``, round-robin in one run.
- ``flops``: NS FLOPs each rank computed, counted by the engine over one step, at TP2 and layer-wise DP2
  (``dense-181m``) and EP2 (a 64-expert MoE, layer-wise): summed over ranks against the analytic total of
  orthogonalising every matrix once (from the world-1 model's block shapes), and max/mean over ranks.
- ``comm``: payload bytes each rank hands to process-group calls during one step (DDP grad sync plus
  ``optimizer.step()``), muon_md against megatron's distributed Adam on the same layout (TP2 x DP2, bf16,
  ``--use-distributed-optimizer``). Activations' TP traffic is the same for both and not part of a step here.
- ``ns_rate``: world 1, the achieved rate of the engine's NS kernel (FLOPs / seconds) on each bucket of
  ``dense-181m``, against this machine's measured GEMM rate at the same shapes (best of the three NS GEMMs).
- ``moe64``: world 1, a MoE with 64 small experts per layer: NS calls per step against the engine's buckets,
  and the step time batched against the per-matrix loop (``--md-ns-per-matrix``).

    python benchmarks/ns_engine.py                      # all sections (about 25 minutes on 2 cores)
    python benchmarks/ns_engine.py --sections flops,moe64 --out /tmp/ns.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comm_counter import CommCounter  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "ns_engine_cpu.json"
SECTIONS = ("tp2_time", "flops", "comm", "ns_rate", "moe64")
TARGETS = {  # issue 15
    "tp2_time": {"muon_md/muon_md_duplicated": 0.6, "muon_md/muon_duplicated": 0.75},
    "flops": {"sum_over_analytic_error": 0.01, "max_over_mean": 1.15},
    "comm": {"muon_md/adam": 1.25},
    "ns_rate": {"min_fraction_of_gemm": 0.7},
}
# 64 small experts (fc1 128x128, fc2 128x64): the regime where batching pays on CPU too (see
# megatron_md/parallel/orthogonalize.py CPU_BATCH_MAX_ELEMENTS); larger matrices loop inside their bucket there.
MOE64 = {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 4, "kv_channels": 32,
         "num_experts": 64, "moe_ffn_hidden_size": 64, "ffn_hidden_size": 512, "moe_router_topk": 2,
         "vocab_size": 8192}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--steps", type=int, default=6, help="timed steps per subject (tp2_time, moe64)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)  # one rank of one section
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown {bad}; choose from {','.join(SECTIONS)}")
    return args


# ----------------------------------------------------------------------------- building one subject

def run_config(model: str, optimizer: str, **cli):
    from megatron_md.training.config import resolve

    base = {"optimizer": optimizer, "mock_data": True, "wandb_mode": "disabled", "device": "cpu", "seed": 1234,
            "micro_batch_size": 1, "muon_num_ns_steps": 5}
    if model == "moe64":
        model, base = "tiny-moe", {**base, **MOE64}
    if optimizer == "muon":
        base.update(muon_tp_mode="duplicated", muon_fp32_matmul_prec="highest")
    return resolve(model, None, {**base, **cli})


class Subject:
    """A model and its optimizer; every parameter's grad buffer refilled with the same fixed gradient per step."""

    def __init__(self, name: str, cfg):
        import torch

        from megatron_md.training.build import build_optimizer, build_wrapped_model, seed_everything, vocab_size_for

        self.name, self.cfg = name, cfg
        seed_everything(1234)
        self.model, _ = build_wrapped_model(cfg, vocab_size_for(cfg, None), cpu=True)
        self.optimizer, _ = build_optimizer(cfg, self.model)
        gen = torch.Generator().manual_seed(99)
        with torch.no_grad():
            for _, p in sorted(self.model.module.named_parameters(), key=lambda kv: kv[0]):
                p.main_grad.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
        self.buffers = list(self.model.buffers) + list(self.model.expert_parallel_buffers)
        self.saved = [b.grad_data.clone() for b in self.buffers]

    def engines(self):
        from megatron_md.mcore.optimizer_checkpoint import walk

        return [o.ortho_engine for o in walk(self.optimizer) if hasattr(o, "ortho_engine")]

    def step(self, grad_sync: bool = False) -> float:
        """Seconds of one step: refill grads, (DDP grad sync), ``optimizer.step()``."""
        for b, g in zip(self.buffers, self.saved):
            b.grad_data.copy_(g)
        t0 = time.perf_counter()
        if grad_sync:
            self.model.finish_grad_sync()
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"{self.name}: optimizer.step() failed")
        return time.perf_counter() - t0

    def engine_stats(self) -> dict:
        out = {"matrices": 0, "owned": 0, "buckets": 0, "kernel_calls": 0, "ns_calls": 0, "flops": 0.0, "collectives": 0,
               "bytes_sent": 0}
        for e in self.engines():
            for k in out:
                out[k] += getattr(e.stats, k)
        return out

    def reset_stats(self) -> None:
        for e in self.engines():
            e.stats.reset()


def analytic_ns_flops(s: Subject) -> tuple[float, int]:
    """Σ msign FLOPs of every Muon-base block of a world-1 model (each matrix once), and the block count."""
    from megatron_md.optim.blocks import matrix_blocks
    from megatron_md.optim.md import MDHyperParams, resolve_split_shapes
    from megatron_md.parallel.orthogonalize import msign_flops
    from megatron_md.mcore.optimizer_checkpoint import walk

    total, count = 0.0, 0
    for o in walk(s.optimizer):
        if not hasattr(o, "ortho_engine"):
            continue
        for g in o.param_groups:
            hp = MDHyperParams.from_group(g)
            if not o.base_for(hp).orthogonalizes:
                continue
            for p in g["params"]:
                for blk in matrix_blocks(p.shape, resolve_split_shapes(p, hp)):
                    total += msign_flops(*blk.shape, hp.ns_steps)
                    count += 1
    return total, count


# ----------------------------------------------------------------------------- one rank of a section

def worker(spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_md.training.build import setup_parallel

    torch.set_num_threads(spec.get("threads", 1))
    subjects_spec = spec["subjects"]
    setup_parallel(run_config(spec["model"], subjects_spec[0]["optimizer"], **subjects_spec[0]["cli"]))
    subjects = [Subject(s["name"], run_config(spec["model"], s["optimizer"], **s["cli"])) for s in subjects_spec]
    if spec.get("analytic"):
        total, count = analytic_ns_flops(subjects[0])
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "results": {"flops": total, "blocks": count}}
    out = {}
    for s in subjects:  # warm-up step (lazy MD state, first-touch allocations)
        s.step(spec.get("grad_sync", False))
    if spec.get("count"):
        for s in subjects:
            s.reset_stats()
            with CommCounter() as comm:
                s.step(spec.get("grad_sync", False))
            out[s.name] = {"engine": s.engine_stats(), "comm": comm.summary()}
    times: dict[str, list[float]] = {s.name: [] for s in subjects}
    for r in range(spec.get("steps", 0)):
        for i in range(len(subjects)):
            s = subjects[(r + i) % len(subjects)]  # rotate who goes first, same order on every rank
            dist.barrier()
            t = torch.tensor([s.step()], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank is done
            times[s.name].append(float(t))
    for name, ts in times.items():
        if ts:
            out.setdefault(name, {})["step_s"] = ts
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "results": out}


def launch(spec: dict, nproc: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "dir": tmp}
        path = Path(tmp, "spec.json")
        path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               __file__, "--worker", str(path)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{spec['section']} ({nproc} ranks) failed:\n{proc.stderr[-5000:]}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nproc)]


def _median(ts: list[float]) -> float:
    return statistics.median(ts)


# ----------------------------------------------------------------------------- the sections

def section_tp2_time(args) -> dict:
    subjects = [{"name": "muon_md", "optimizer": "muon_md", "cli": {"tensor_model_parallel_size": 2}},
                {"name": "muon_md_duplicated", "optimizer": "muon_md",
                 "cli": {"tensor_model_parallel_size": 2, "muon_tp_mode": "duplicated"}},
                {"name": "muon_duplicated", "optimizer": "muon", "cli": {"tensor_model_parallel_size": 2}}]
    ranks = launch({"section": "tp2_time", "model": "dense-181m", "subjects": subjects, "steps": args.steps,
                    "count": True}, 2)
    res = ranks[0]["results"]
    med = {k: _median(v["step_s"]) for k, v in res.items()}
    ratios = {"muon_md/muon_md_duplicated": med["muon_md"] / med["muon_md_duplicated"],
              "muon_md/muon_duplicated": med["muon_md"] / med["muon_duplicated"]}
    per_rank_flops = {name: [r["results"][name]["engine"]["flops"] for r in ranks] for name in ("muon_md",)}
    return {"model": "dense-181m", "layout": "TP2 (2 ranks, 1 thread each), fp32", "median_step_s": med,
            "step_s": {k: v["step_s"] for k, v in res.items()}, "ratios": ratios, "ns_flops_per_rank": per_rank_flops,
            "engine": {k: [r["results"][k]["engine"] for r in ranks] for k in res}}


def section_flops(args) -> dict:
    layouts = {
        "TP2": ("dense-181m", 2, {"tensor_model_parallel_size": 2}),
        "layer-wise DP2": ("dense-181m", 2, {"bf16": True, "use_distributed_optimizer": True}),
        "EP2 (64 experts, layer-wise)": ("moe64", 2, {"expert_model_parallel_size": 2, "bf16": True,
                                                      "use_distributed_optimizer": True}),
    }
    rows = {}
    for label, (model, nproc, cli) in layouts.items():
        world1 = launch({"section": "analytic", "model": model, "analytic": True,
                         "subjects": [{"name": "muon_md", "optimizer": "muon_md", "cli": {}}]}, 1)[0]["results"]
        analytic, blocks = world1["flops"], world1["blocks"]
        ranks = launch({"section": "flops", "model": model, "count": True,
                        "subjects": [{"name": "muon_md", "optimizer": "muon_md", "cli": cli}]}, nproc)
        eng = [r["results"]["muon_md"]["engine"] for r in ranks]
        flops = [e["flops"] for e in eng]
        mean = statistics.fmean(flops)
        rows[label] = {"model": model, "ranks": nproc, "analytic_flops": analytic, "analytic_blocks": blocks,
                       "flops_per_rank": flops, "sum_over_analytic": sum(flops) / analytic,
                       "max_over_mean": max(flops) / mean if mean else None,
                       "owned_per_rank": [e["owned"] for e in eng], "ns_calls_per_rank": [e["ns_calls"] for e in eng],
                       "buckets_per_rank": [e["buckets"] for e in eng]}
    return {"rows": rows}


def section_comm(args) -> dict:
    cli = {"tensor_model_parallel_size": 2, "bf16": True, "use_distributed_optimizer": True}
    subjects = [{"name": "muon_md", "optimizer": "muon_md", "cli": cli},
                {"name": "adam", "optimizer": "adam", "cli": cli}]
    ranks = launch({"section": "comm", "model": "dense-181m", "count": True, "grad_sync": True,
                    "subjects": subjects}, 4)
    per = {name: [r["results"][name]["comm"] for r in ranks] for name in ("muon_md", "adam")}
    worst = {name: max(c["bytes"] for c in per[name]) for name in per}
    return {"model": "dense-181m", "layout": "TP2 x DP2 (4 ranks), bf16, --use-distributed-optimizer",
            "bytes_max_rank": worst, "ratio": {"muon_md/adam": worst["muon_md"] / worst["adam"]}, "per_rank": per}


def section_ns_rate(args) -> dict:
    import torch

    from megatron_md.parallel.orthogonalize import msign_flops, msign_kernel

    torch.set_num_threads(2)
    from megatron_md.training.config import resolve

    m = resolve("dense-181m", None, {"vocab_size": 131072}).model
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    blocks = [(m.num_attention_heads * kv, m.hidden_size), (m.num_query_groups * kv, m.hidden_size),
              (m.num_query_groups * kv, m.hidden_size), (m.hidden_size, m.num_attention_heads * kv),
              (m.ffn_hidden_size * (2 if m.swiglu else 1), m.hidden_size), (m.hidden_size, m.ffn_hidden_size)]
    shapes: dict[tuple, int] = {}
    for shape in blocks:  # one engine bucket per distinct shape, every layer's blocks stacked
        shapes[shape] = shapes.get(shape, 0) + m.num_layers
    rows = {}
    for (rows_, cols), B in shapes.items():
        name = f"{rows_}x{cols}"
        X = torch.randn(B, rows_, cols)
        s, l = min(rows_, cols), max(rows_, cols)
        Y = torch.randn(B, s, l)
        A = torch.randn(B, s, s)

        def best(fn, reps=3):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return min(ts)

        kernel = msign_kernel(5, "quintic")  # what the engine runs on a bucket (a CPU loop above 2^15 elements)
        t_ns = best(lambda: kernel.fn([X], []))
        gemm = {"XXt": (best(lambda: torch.bmm(Y, Y.mT)), 2.0 * B * s * s * l),
                "AA": (best(lambda: torch.bmm(A, A)), 2.0 * B * s ** 3),
                "AX": (best(lambda: torch.bmm(A, Y)), 2.0 * B * s * s * l)}
        peak = max(f / t for t, f in gemm.values())
        rate = B * msign_flops(rows_, cols, 5) / t_ns
        rows[name] = {"batch": B, "shape": [rows_, cols], "ns_s": t_ns, "ns_gflops": rate / 1e9,
                      "gemm_gflops": {k: f / t / 1e9 for k, (t, f) in gemm.items()}, "peak_gemm_gflops": peak / 1e9,
                      "fraction": rate / peak}
    return {"threads": 2, "dtype": "fp32", "rows": rows,
            "min_fraction": min(r["fraction"] for r in rows.values())}


def section_moe64(args) -> dict:
    subjects = [{"name": "batched", "optimizer": "muon_md", "cli": {}},
                {"name": "per_matrix", "optimizer": "muon_md", "cli": {"md_ns_per_matrix": True}}]
    ranks = launch({"section": "moe64", "model": "moe64", "subjects": subjects, "steps": args.steps,
                    "count": True, "threads": 2}, 1)
    res = ranks[0]["results"]
    med = {k: _median(v["step_s"]) for k, v in res.items()}
    eng = {k: v["engine"] for k, v in res.items()}
    return {"model": {**MOE64}, "median_step_s": med, "ratio": {"batched/per_matrix": med["batched"] / med["per_matrix"]},
            "engine": eng, "calls_equal_buckets": eng["batched"]["ns_calls"] == eng["batched"]["buckets"]}


def verdicts(sections: dict) -> dict:
    out = {}
    if "tp2_time" in sections:
        for k, bound in TARGETS["tp2_time"].items():
            v = sections["tp2_time"]["ratios"][k]
            out[f"tp2 {k}"] = {"value": v, "max": bound, "met": v <= bound}
    if "flops" in sections:
        for label, row in sections["flops"]["rows"].items():
            err = abs(row["sum_over_analytic"] - 1.0)
            out[f"flops {label} sum/analytic"] = {"value": row["sum_over_analytic"], "max_error": 0.01, "met": err <= 0.01}
            out[f"flops {label} max/mean"] = {"value": row["max_over_mean"], "max": 1.15,
                                             "met": row["max_over_mean"] <= 1.15}
    if "comm" in sections:
        v = sections["comm"]["ratio"]["muon_md/adam"]
        out["comm muon_md/adam"] = {"value": v, "max": 1.25, "met": v <= 1.25}
    if "ns_rate" in sections:
        v = sections["ns_rate"]["min_fraction"]
        out["ns_rate min fraction of GEMM"] = {"value": v, "min": 0.7, "met": v >= 0.7}
    if "moe64" in sections:
        m = sections["moe64"]
        out["moe64 calls == buckets"] = {"value": m["engine"]["batched"]["ns_calls"], "met": m["calls_equal_buckets"]}
        v = m["ratio"]["batched/per_matrix"]
        out["moe64 batched/per_matrix time"] = {"value": v, "max": 1.0, "met": v <= 1.0}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        res = worker(spec)
        Path(spec["dir"], f"rank{res['rank']}.json").write_text(json.dumps(res))
        import torch.distributed as dist

        dist.barrier()
        return 0
    t0 = time.perf_counter()
    out_path = Path(args.out)
    previous = json.loads(out_path.read_text()) if out_path.exists() else {}
    sections = dict(previous.get("sections", {}))  # a partial rerun keeps the other sections' figures
    fns = {"tp2_time": section_tp2_time, "flops": section_flops, "comm": section_comm, "ns_rate": section_ns_rate,
           "moe64": section_moe64}
    for name in args.sections:
        t = time.perf_counter()
        print(f"[ns_engine] {name} ...", flush=True)
        sections[name] = {**fns[name](args), "wall_s": time.perf_counter() - t,
                          "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        print(json.dumps(sections[name].get("ratios") or sections[name].get("ratio") or
                         sections[name].get("min_fraction") or "", default=str), flush=True)
    result = {"benchmark": "ns_engine", "schema": 1,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "cpu": _cpu_name()}, "sections": sections, "verdicts": verdicts(sections),
              "wall_s": time.perf_counter() - t0}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    md = _renderer().ns_engine_markdown(result)
    out_path.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _renderer():
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_readme_tables", REPO / "tools" / "render_readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    sys.exit(main())
