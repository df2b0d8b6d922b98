"""Per-rank optimizer-state bytes under the layer-wise distributed optimizer: DP1 against DP2.

One run launches the same model twice on the CPU runtime (gloo) with ``--use-distributed-optimizer
--bf16``: once on one rank and once on two data-parallel ranks. Each rank builds the model and the
optimizers (default: muon_md, adam_md, manifold_muon --geometry hetero), gives every parameter the
same fixed random gradient and takes one ``optimizer.step()`` (MD state is made on a matrix's first
step), then reports the bytes of state it holds:

- ``md_state``: the MD / Manifold-Muon state of the matrices those optimizers manage (momentum or
  Adam moments, row/column gains and their Adam moments, manifold duals) — the figure issue 14 bounds:
  the largest DP2 rank must hold at most 0.55x the DP1 rank's;
- ``all_state``: every inner optimizer's state plus fp32 master weights, for context.

Writes ``--out`` (JSON) and the same name with ``.md`` (the table docs/checkpoints.md shows).

    python benchmarks/optimizer_state.py                              # dense-181m at its real shape
    python benchmarks/optimizer_state.py --model tiny-dense --out /tmp/state.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "optimizer_state_cpu.json"
OPTIMIZERS = ("muon_md", "adam_md", "manifold_muon", "muon", "adam")
BOUND = 0.55  # issue 14: per-rank MD state at DP2 <= 0.55x DP1


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dense-181m", help="model preset, at its real shape (default dense-181m)")
    ap.add_argument("--optimizers", default="muon_md,adam_md,manifold_muon",
                    help="comma-separated subset of " + ",".join(OPTIMIZERS))
    ap.add_argument("--dp", type=int, default=2, help="data-parallel size compared with DP1")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)  # one rank's measurement, into DIR
    args = ap.parse_args(argv)
    args.optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    bad = [o for o in args.optimizers if o not in OPTIMIZERS]
    if bad or not args.optimizers:
        ap.error(f"--optimizers: unknown {bad}; choose from {','.join(OPTIMIZERS)}")
    if args.dp < 2:
        ap.error("--dp must be at least 2")
    return args


# ----------------------------------------------------------------------------- one rank

def _config(args, name: str):
    from megatron_md.training.config import resolve

    cli = {"optimizer": name, "mock_data": True, "wandb_mode": "disabled", "device": "cpu", "bf16": True,
           "use_distributed_optimizer": True, "seed": args.seed, "micro_batch_size": 1}
    if name == "manifold_muon":
        cli["geometry"] = "hetero"
    return resolve(args.model, None, cli)


def _tensor_bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x) for x in obj)
    return 0


def all_state_bytes(optimizer) -> int:
    """Every inner torch optimizer's state plus the fp32 master copies megatron keeps for bf16."""
    import torch

    from megatron_md.mcore.optimizer_checkpoint import walk

    total = 0
    for o in walk(optimizer):
        if isinstance(o, torch.optim.Optimizer):
            total += _tensor_bytes(list(o.state.values()))
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            total += _tensor_bytes([list(g) for g in (getattr(o, attr, None) or [])])
    return total


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_md.mcore.md_locate import md_state_bytes
    from megatron_md.training.build import build_optimizer, build_wrapped_model, seed_everything, setup_parallel
    from megatron_md.training.build import vocab_size_for

    torch.set_num_threads(1)
    out = {}
    setup_parallel(_config(args, args.optimizers[0]))
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in args.optimizers:
        cfg = _config(args, name)
        seed_everything(args.seed)
        model, _ = build_wrapped_model(cfg, vocab_size_for(cfg, None), cpu=True)
        optimizer, _ = build_optimizer(cfg, model)
        gen = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            for _, p in sorted(model.module.named_parameters(), key=lambda kv: kv[0]):
                p.main_grad.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 1e-3)
        ok, _, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"{name}: optimizer.step() failed")
        md = md_state_bytes(optimizer)
        out[name] = {"md_state": md["state"], "md_matrices": md["matrices"], "all_state": all_state_bytes(optimizer),
                     "parameters": sum(p.numel() for p in model.module.parameters())}
        del model, optimizer
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": world, "results": out}))
    dist.barrier()


# ----------------------------------------------------------------------------- the comparison

def launch(args, nproc: int, directory: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--worker", str(directory), "--model", args.model, "--optimizers", ",".join(args.optimizers),
           "--seed", str(args.seed), "--dp", str(args.dp)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"DP{nproc} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(Path(directory, f"rank{r}.json").read_text()) for r in range(nproc)]


def compare(dp1: list[dict], dpn: list[dict], optimizers: list[str]) -> dict:
    rows = {}
    for name in optimizers:
        base = dp1[0]["results"][name]
        ranks = [r["results"][name] for r in dpn]
        row = {"parameters": base["parameters"], "dp1": {k: base[k] for k in ("md_state", "all_state", "md_matrices")},
               "dpn": [{k: r[k] for k in ("md_state", "all_state", "md_matrices")} for r in ranks]}
        if base["md_state"]:
            row["md_state_ratio"] = max(r["md_state"] for r in ranks) / base["md_state"]
            row["bound"] = BOUND
            row["met"] = row["md_state_ratio"] <= BOUND
        row["all_state_ratio"] = max(r["all_state"] for r in ranks) / base["all_state"]
        rows[name] = row
    return rows


def markdown(result: dict) -> str:
    """The docs table, rendered by tools/render_readme_tables.py (one renderer for both places)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_readme_tables", REPO / "tools" / "render_readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.optimizer_state_markdown(result)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "dp1").mkdir()
        (Path(tmp) / "dpn").mkdir()
        dp1 = launch(args, 1, Path(tmp) / "dp1")
        dpn = launch(args, args.dp, Path(tmp) / "dpn")
    out = Path(args.out)
    result = {
        "benchmark": "optimizer_state",
        "schema": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "source": f"benchmarks/results/{out.name}" if out.parent == DEFAULT_OUT.parent else str(out),
        "settings": {"model": args.model, "dp": args.dp, "parameters": dp1[0]["results"][args.optimizers[0]]["parameters"],
                     "optimizers": args.optimizers, "precision": "bf16 params, fp32 masters and state",
                     "distributed_optimizer": "megatron-core LayerWiseDistributedOptimizer"},
        "results": compare(dp1, dpn, args.optimizers),
        "wall_s": time.perf_counter() - t0,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out} and {out.with_suffix('.md')} ({result['wall_s']:.0f}s)")
    return 0 if all(r.get("met", True) for r in result["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
