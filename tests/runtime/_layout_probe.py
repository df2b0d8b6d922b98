"""Tiny-GPT helpers for the CPU-runtime tests, and a multi-rank layout probe.

Imported by test_cpu_runtime.py for the helpers; run under torchrun by
test_multirank_layouts.py (``python -m torch.distributed.run --nproc-per-node 2 _layout_probe.py``).
Each probe part prints one line ``PROBE {"part": ..., "ok": ..., ...}`` on rank 0.
The ``__main__`` guard matters: dist-ckpt and spawn-mode multiprocessing re-import this file.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from functools import partial

import torch

SEQ, VOCAB, MBS = 16, 128, 2


def tiny_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # CUDA-kernel fusions have no CPU implementation
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(cfg, num_experts=None, pre_process=True, post_process=True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre_process,
        post_process=post_process,
    )


def wrap_ddp(cfg, model, use_distributed_optimizer=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
    )
    return DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)


def make_optimizer(model_chunks, optimizer="adam", **kw):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    kw.setdefault("lr", 1e-3)
    kw.setdefault("clip_grad", 1.0)
    return get_megatron_optimizer(OptimizerConfig(optimizer=optimizer, **kw), model_chunks)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)  # identical on every rank
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, -1).contiguous(),
        "loss_mask": torch.ones(MBS, SEQ),
    }


def _loss_func(loss_mask, output_tensor):
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides loss in place


def _forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    return out, partial(_loss_func, b["loss_mask"])


def train_steps(model_chunks, optimizer, cfg, steps=2, num_microbatches=1):
    """Run ``steps`` optimizer steps through get_forward_backward_func; return lm losses."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.grad_scale_func = optimizer.scale_loss
    fwd_bwd = get_forward_backward_func()
    losses = []
    for step in range(steps):
        for m in model_chunks:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        data = iter([batch(i) for i in range(num_microbatches)])  # same data each step
        out = fwd_bwd(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=model_chunks,
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        assert ok, "optimizer step skipped"
        # only the last pipeline stage sees the loss; share it so every rank can report
        loss = torch.tensor(
            [sum(float(o["lm loss"]) for o in out) / max(len(out), 1), float(len(out) > 0)]
        )
        torch.distributed.all_reduce(loss)
        losses.append(float(loss[0] / loss[1]))
    return losses


# ---------------------------------------------------------------------------- multi-rank probe


def _emit(part, t0, **result):
    if torch.distributed.get_rank() == 0:
        print("PROBE " + json.dumps({"part": part, "s": round(time.time() - t0, 2), **result}))
        sys.stdout.flush()


def _run_part(name, fn):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    t0 = time.time()
    try:
        tp, pp, ep, body = fn()
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
        )
        model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        result = body()
        finite = all(math.isfinite(x) for x in result.get("losses", [0.0]))
        _emit(name, t0, ok=finite, **result)
    except Exception as e:  # report and keep probing the other layouts
        err = f"{type(e).__name__}: {e}"
        _emit(name, t0, ok=False, error=err, tb=traceback.format_exc()[-1500:])
    finally:
        ps.destroy_model_parallel()


def _dense(tp):
    """Forward + backward of the tiny GPT; CPU init is TP-invariant, so TP=1 and 2 must agree."""

    def body():
        from megatron.core import parallel_state as ps

        cfg = tiny_config(tensor_model_parallel_size=tp)
        model = build_gpt(cfg)
        b = batch(0)
        loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).float().mean()
        loss.backward()
        w = model.decoder.layers[0].mlp.linear_fc1.weight
        return {
            "tp_world": ps.get_tensor_model_parallel_world_size(),
            "fc1_local_rows": int(w.shape[0]),
            "loss": loss.item(),
            "grad_finite": bool(torch.isfinite(w.grad).all()),
        }

    return tp, 1, 1, body


def _pp2():
    def body():
        from megatron.core import parallel_state as ps

        cfg = tiny_config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
        model = build_gpt(
            cfg,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
        )
        chunks = [wrap_ddp(cfg, model)]
        opt = make_optimizer(chunks)
        losses = train_steps(chunks, opt, cfg, steps=2, num_microbatches=2)
        return {"pp_world": ps.get_pipeline_model_parallel_world_size(), "losses": losses}

    return 1, 2, 1, body


def _moe_ep2(dispatcher):
    def body():
        from megatron.core import parallel_state as ps

        cfg = tiny_config(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type=dispatcher,
            expert_model_parallel_size=2,
            add_bias_linear=False,
        )
        model = build_gpt(cfg, num_experts=4)
        chunks = [wrap_ddp(cfg, model)]
        opt = make_optimizer(chunks)
        losses = train_steps(chunks, opt, cfg, steps=2)
        experts = model.decoder.layers[0].mlp.experts
        return {
            "ep_world": ps.get_expert_model_parallel_world_size(),
            "local_experts": len(experts.local_experts),
            "losses": losses,
        }

    return 1, 1, 2, body


def _muon_tp2():
    def body():
        cfg = tiny_config(tensor_model_parallel_size=2)
        model = build_gpt(cfg)
        chunks = [wrap_ddp(cfg, model)]
        opt = make_optimizer(chunks, optimizer="muon", muon_tp_mode="duplicated")
        inner = [type(o.optimizer).__name__ for o in getattr(opt, "chained_optimizers", [opt])]
        losses = train_steps(chunks, opt, cfg, steps=2)
        return {"optimizer": type(opt).__name__, "inner": inner, "losses": losses}

    return 2, 1, 1, body


def main():
    from megatron_md.runtime import activate, select_runtime
    from megatron_md.runtime.distributed import destroy_distributed, init_distributed

    rt = select_runtime("cpu")
    init_distributed(rt, timeout_s=120)
    activate(rt)
    torch.set_num_threads(1)
    parts = {
        "dense_tp1": partial(_dense, 1),
        "dense_tp2": partial(_dense, 2),
        "pp2": _pp2,
        "moe_ep2_allgather": partial(_moe_ep2, "allgather"),
        "moe_ep2_alltoall": partial(_moe_ep2, "alltoall"),
        "muon_tp2_duplicated": _muon_tp2,
    }
    only = os.environ.get("PROBE_PARTS")
    for name, fn in parts.items():
        if only and name not in only.split(","):
            continue
        _run_part(name, fn)
    destroy_distributed()


if __name__ == "__main__":
    main()
