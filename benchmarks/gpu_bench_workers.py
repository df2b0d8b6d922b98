"""The measuring processes of ``gpu_bench.py``: one GEMM or one training section per process, so an
out-of-memory or a crash loses that section only. Run by the driver as ``gpu_bench.py --worker KIND``."""

from __future__ import annotations

import json
import statistics
import time
import traceback
from pathlib import Path

from gpu_bench_sections import planned_memory, profile_optimizer_steps, worker_retraction

FLOPS_FORMULA = (
    "the trainer's (megatron_md.training.observability.throughput.model_flops_per_step, Megatron-LM's "
    "formula): per token 12*L*h^2*((1 + g/a + s/(2h))*(a*d/h) + ffn/h*glu*k + V/(2*L*h)) with g query groups, "
    "a heads, d head dim, glu 1.5 for SwiGLU, k routed experts (+ shared) for MoE, V the padded vocab; causal "
    "attention counts half the s^2 term; recomputation is not counted; model TFLOP/s = FLOPs per token x "
    "tokens/s"
)


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def worker_gemm(spec: dict) -> dict:
    import torch

    cuda = spec["device"] == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for n in spec["sizes"]:
        a = torch.randn(n, n, device=spec["device"], dtype=dtype)
        b = torch.randn(n, n, device=spec["device"], dtype=dtype)
        c = torch.empty(n, n, device=spec["device"], dtype=dtype)
        for _ in range(3):
            torch.matmul(a, b, out=c)
        _sync(cuda)
        t0 = time.perf_counter()
        for _ in range(spec["reps"]):
            torch.matmul(a, b, out=c)
        _sync(cuda)
        s = (time.perf_counter() - t0) / spec["reps"]
        rows.append({"n": n, "ms": s * 1e3, "tflops": 2 * n**3 / s / 1e12})
        del a, b, c
    best = max(rows, key=lambda r: r["tflops"])
    return {"status": "ok", "dtype": str(dtype).replace("torch.", ""), "reps": spec["reps"],
            "sizes": rows, "best_tflops": best["tflops"], "best_n": best["n"]}


def flops_per_token(m, vocab: int, active: int) -> tuple[int, float]:
    """(N, FLOPs per token): N = active parameters minus the input embedding (for the record), FLOPs as the
    trainer's log line counts them (FLOPS_FORMULA)."""
    from megatron_md.training.observability.throughput import model_flops_per_step

    input_embedding = vocab * m.hidden_size if m.untie_embeddings_and_output_weights else 0
    if m.position_embedding_type == "learned_absolute":
        input_embedding += m.max_position_embeddings * m.hidden_size
    return active - input_embedding, model_flops_per_step(m, vocab, 1) / m.seq_length


def worker_train(spec: dict) -> dict:
    """Build the trainer from ``megatron-md train`` flags and run it, timing every phase of every step."""
    import torch

    from megatron_md.training.arguments import quiet_megatron, train_parser

    quiet_megatron()
    from megatron_md.models.presets import count_parameters
    from megatron_md.runtime.distributed import destroy_distributed
    from megatron_md.training import config as C
    from megatron_md.training.build import with_vocab
    from megatron_md.training.checkpoints.checkpointing import unwrap
    from megatron_md.training.trainer import Trainer

    t_start = time.perf_counter()
    plan = None
    if spec.get("plan"):  # before the run: a prediction, from the flags alone
        try:
            plan = planned_memory(spec["argv"])
        except (Exception, SystemExit) as e:  # noqa: BLE001 (the measurement stands without it)
            plan = {"error": f"{type(e).__name__}: {e}"[:500]}
    args = vars(train_parser().parse_args(spec["argv"]))
    args.pop("config", None)
    cfg = C.resolve(None, None, args)
    cuda = cfg.training.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - t_start
    rows, cur = [], {}
    fwd_bwd, opt_step, train_step = trainer.forward_backward, trainer.optimizer.step, trainer.train_step

    def timed(fn, key):
        def wrapper(*a, **k):
            # Cheap: the trainer itself syncs right after forward/backward (loss .item()) and before the
            # step (finiteness flag); the sync after the step keeps its tail out of the next iteration.
            _sync(cuda)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            _sync(cuda)
            cur[key] = time.perf_counter() - t0
            return out
        return wrapper

    def step_and_record():
        cur.clear()
        loss, grad_norm, ok = timed(train_step, "iter")()
        rows.append({"iter": cur["iter"], "fwd_bwd": cur.get("fwd_bwd"), "step": cur.get("step"),
                     "loss": loss, "ok": ok})
        if time.time() > spec["stop_at"] and len(rows) < cfg.training.train_iters:
            cfg.training.train_iters = trainer.state.iteration + 1  # the loop ends after this iteration
        return loss, grad_norm, ok

    trainer.forward_backward = timed(fwd_bwd, "fwd_bwd")  # evaluate() goes through it too: not recorded
    trainer.optimizer.step = timed(opt_step, "step")
    trainer.train_step = step_and_record
    profile = None
    try:
        trainer.train()
        if spec.get("profile_steps"):  # after the timed run, on its last gradients: not in the medians
            try:
                profile = profile_optimizer_steps(opt_step, spec["profile_steps"], cuda)
            except Exception as e:  # noqa: BLE001 (the section's timings stand without it)
                profile = {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        destroy_distributed()
    if not rows:
        raise RuntimeError("no training iteration ran")
    warmup = spec["warmup"] if len(rows) > spec["warmup"] else min(1, len(rows) - 1)
    timed_rows = rows[warmup:]
    m = cfg.model
    counts = count_parameters(with_vocab(m, trainer.vocab))
    n_flops, per_token = flops_per_token(m, trainer.vocab, counts.active)
    tokens_per_iter = trainer.gbs * m.seq_length
    tokens_per_s = tokens_per_iter * len(timed_rows) / sum(r["iter"] for r in timed_rows)
    it_ms, fb_ms, st_ms = (_median(r[k] for r in timed_rows) for k in ("iter", "fwd_bwd", "step"))
    it_ms, fb_ms = it_ms * 1e3, fb_ms * 1e3
    st_ms = st_ms * 1e3 if st_ms is not None else None
    model = unwrap(trainer.model)
    experts = next((type(mod).__name__ for name, mod in model.named_modules() if name.endswith("mlp.experts")), None)
    metrics = Path(cfg.logging.run_dir) / "metrics.jsonl"
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if '"lm_loss"' in line] \
        if metrics.exists() else []
    losses = [r["loss"] for r in rows if r["loss"] is not None]
    return {
        "status": "ok",
        "stopped_early": len(rows) < spec["steps"],
        "model": {"preset": cfg.preset, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                  "num_attention_heads": m.num_attention_heads, "num_query_groups": m.num_query_groups,
                  "kv_channels": m.kv_channels, "ffn_hidden_size": m.ffn_hidden_size, "vocab_size": trainer.vocab,
                  "num_experts": m.num_experts, "moe_router_topk": m.moe_router_topk if m.num_experts else None,
                  "moe_ffn_hidden_size": m.moe_ffn_hidden_size, "parameters_total": counts.total,
                  "parameters_active": counts.active, "parameters_flops": n_flops},
        "layer_spec": "transformer_engine" if getattr(model, "megatron_md_uses_te", False) else "local",
        "experts_module": experts,
        "moe_grouped_gemm": bool(getattr(trainer.tconfig, "moe_grouped_gemm", False)) if m.num_experts else None,
        "seq_length": m.seq_length, "micro_batch_size": cfg.training.micro_batch_size,
        "global_batch_size": trainer.gbs, "tokens_per_iter": tokens_per_iter,
        "iterations": len(rows), "warmup": warmup, "timed_iterations": len(timed_rows),
        "skipped_steps": sum(1 for r in rows if not r["ok"]),
        "iter_ms": it_ms, "fwd_bwd_ms": fb_ms, "optimizer_step_ms": st_ms,
        "other_ms": it_ms - fb_ms - (st_ms or 0.0),
        "optimizer_step_share": st_ms / it_ms if st_ms is not None else None,
        "tokens_per_s": tokens_per_s, "flops_per_token": per_token, "model_tflops": per_token * tokens_per_s / 1e12,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "times_ms": {k: [None if r[k] is None else round(r[k] * 1e3, 3) for r in rows] for k in ("iter", "fwd_bwd", "step")},
        "logged_last": {k: logged[-1].get(k) for k in ("iteration", "lm_loss", "tokens_per_s", "iter_time_ms")}
        if logged else None,
        "build_s": build_s,
        "attention_backend": m.attention_backend, "transformer_impl": m.transformer_impl,
        "profile": profile, "plan": plan,
        "peak_vs_plan": (torch.cuda.max_memory_allocated() / 2**30 / plan["predicted_gib"])
        if cuda and plan and "predicted_gib" in plan else None,
    }


def run_worker(args) -> int:
    spec = json.loads(args.spec)
    try:
        result = {"gemm": worker_gemm, "train": worker_train, "retraction": worker_retraction}[args.worker](spec)
    except BaseException as e:  # noqa: BLE001 (recorded, the driver decides)
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000],
                  "traceback": traceback.format_exc()[-4000:]}
    Path(args.result).write_text(json.dumps(result, indent=1))
    return 0 if result["status"] == "ok" else 1
