"""Multi-rank probe: the orthogonalisation engine against the duplicated path, on megatron's real stack.

Run under torchrun (``tests/parallel/test_engine_layouts.py``). One process group layout per launch; for
each mode (duplicated and layer_sharded per matrix, both with MD's per-matrix step; layer_sharded with the
batched step) the same model is built from the same seed,
fed the same gradients for a few optimizer steps, and its parameters compared. Rank 0 prints one line
``PROBE {...}``. The ``__main__`` guard matters: megatron's dist-ckpt re-imports the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch


def config(args, mode: str, per_matrix: bool, step_per_matrix: bool = False):
    from megatron_md.training.config import resolve

    cli = {"optimizer": args.optimizer, "mock_data": True, "wandb_mode": "disabled", "device": "cpu",
           "seed": 1234, "micro_batch_size": 1, "tensor_model_parallel_size": args.tp,
           "pipeline_model_parallel_size": args.pp, "expert_model_parallel_size": args.ep,
           "muon_tp_mode": mode, "md_ns_per_matrix": per_matrix, "md_per_matrix_step": step_per_matrix,
           "bf16": args.distopt,
           "use_distributed_optimizer": args.distopt, "clip_grad": 0.0, "matrix_lr": 0.05}
    if args.tp > 1 and args.model.endswith("moe"):
        cli["sequence_parallel"] = True
    if args.optimizer == "manifold_muon":
        cli["geometry"] = args.geometry
    return resolve(args.model, None, cli)


def _seed(name: str, step: int, p) -> int:
    from megatron.core import parallel_state as ps

    tag = f"{name}/{step}"
    if getattr(p, "tensor_model_parallel", False):  # shards differ; replicas must agree
        expert = not getattr(p, "allreduce", True)
        tag += f"/tp{ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()}"
    if not getattr(p, "allreduce", True):
        tag += f"/ep{ps.get_expert_model_parallel_rank()}"
    return int(hashlib.sha256(tag.encode()).hexdigest()[:12], 16)


def run_mode(args, mode: str, per_matrix: bool, step_per_matrix: bool = False) -> tuple[dict, dict]:
    from megatron_md.mcore.optimizer_checkpoint import walk
    from megatron_md.training.build import build_optimizer, build_wrapped_model, seed_everything, vocab_size_for

    cfg = config(args, mode, per_matrix, step_per_matrix)
    seed_everything(1234)
    model, _ = build_wrapped_model(cfg, vocab_size_for(cfg, None), cpu=True)
    optimizer, _ = build_optimizer(cfg, model)
    start = {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
    for step in range(args.steps):
        with torch.no_grad():
            for name, p in model.module.named_parameters():
                g = torch.Generator().manual_seed(_seed(name, step, p))
                p.main_grad.copy_(torch.randn(p.shape, generator=g) * 1e-2)
        ok, _, _ = optimizer.step()
        assert ok, f"{mode}: optimizer.step() failed"
    params = {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
    stats = {"matrices": 0, "owned": 0, "buckets": 0, "kernel_calls": 0, "flops": 0.0}
    for o in walk(optimizer):
        engine = getattr(o, "ortho_engine", None)
        if engine is not None:
            for k in stats:
                stats[k] += getattr(engine.stats, k)
    stats["moved"] = max(float((params[n] - start[n]).abs().max()) for n in params)
    return params, stats


def main() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_md.training.build import setup_parallel

    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", default="muon_md")
    ap.add_argument("--geometry", default="hetero")
    ap.add_argument("--model", default="tiny-dense")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--distopt", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    setup_parallel(config(args, "duplicated", False))
    # the reference and the per-matrix engine run MD's per-matrix step too; "batched" is everything batched
    ref, _ = run_mode(args, "duplicated", False, step_per_matrix=True)
    batched, stats = run_mode(args, "layer_sharded", False)
    single, stats1 = run_mode(args, "layer_sharded", True, step_per_matrix=True)

    def worst(a: dict, b: dict) -> float:
        out = 0.0
        for n in a:
            scale = b[n].abs().max().clamp_min(1e-12)
            out = max(out, float((a[n] - b[n]).abs().max() / scale))
        return out

    def worst_ulps(a: dict, b: dict) -> float:
        """Largest difference in bf16 units in the last place of the reference value: fp32 rounding of a master
        weight can move its bf16 copy across a rounding boundary, by one such unit."""
        out = 0.0
        for n in a:
            exponent = torch.floor(torch.log2(b[n].abs().clamp_min(2.0**-126)))
            out = max(out, float(((a[n] - b[n]).abs() / torch.exp2(exponent - 7)).max()))
        return out

    t = torch.tensor([worst(batched, ref), worst(single, ref), stats["moved"], worst_ulps(batched, ref)],
                     dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    # Every TP rank submits each of its matrices; the TP (or expert-TP) group computes each exactly once.
    counts = torch.tensor([stats["matrices"], stats["owned"], stats1["kernel_calls"], stats1["owned"],
                           stats["kernel_calls"], stats["buckets"]], dtype=torch.float64)
    tp_sum = counts.clone()
    dist.all_reduce(tp_sum, group=ps.get_tensor_model_parallel_group())
    tp = ps.get_tensor_model_parallel_world_size()
    once = bool(tp_sum[1] == counts[0]) if args.ep == 1 else bool(tp_sum[1] <= counts[0])
    flag = torch.tensor([0.0 if once else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print("PROBE " + json.dumps({
            "batched_vs_duplicated": float(t[0]), "per_matrix_vs_duplicated": float(t[1]),
            "batched_vs_duplicated_bf16_ulps": float(t[3]),
            "once_per_tp_group": bool(flag.item() == 0.0), "max_param_change": float(t[2]), "tp": tp, "matrices": int(counts[0]),
            "owned": int(counts[1]), "kernel_calls": int(counts[4]), "buckets": int(counts[5]),
            "per_matrix_kernel_calls": int(counts[2]),
        }), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
