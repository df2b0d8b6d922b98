"""Building a run's pieces from its config: process groups and seeds, the DDP-wrapped model, the optimizer.

Shared by the trainer, ``score``, the LR-sweep coordinate check and the benchmarks.
"""

from __future__ import annotations

import dataclasses

import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from megatron_md.models.builder import build_model, padded_vocab_size
from megatron_md.mcore.families import FAMILIES, family_of
from megatron_md.training.config import RunConfig
from megatron_md.training.validate import data_parallel_size, validate_config


def setup_parallel(cfg: RunConfig, check=validate_config):
    """Runtime, process groups and seeds, after ``check(cfg, world)`` (the training checks; score, generate and
    export pass ``validate_for_inference``). Returns the Runtime."""
    from megatron_md.runtime import activate, select_runtime
    from megatron_md.runtime.distributed import init_distributed

    rt = select_runtime(cfg.training.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check(cfg, world)
    activate(rt)
    minutes = cfg.training.distributed_timeout_minutes
    init_distributed(rt, timeout_s=round(60 * minutes))
    p = cfg.parallel
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        distributed_timeout_minutes=minutes,
    )
    seed_everything(cfg.training.seed)
    return rt


def seed_everything(seed: int) -> None:
    # Megatron's convention: pipeline stages draw different streams; TP ranks share one.
    s = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    tensor_parallel.model_parallel_cuda_manual_seed(s)


def make_tokenizer(cfg: RunConfig):
    """megatron-core's tokenizer for the run's --tokenizer-* flags; None for mock data / NullTokenizer."""
    from megatron_md.training.data.tokenizer import tokenizer_for_data

    return tokenizer_for_data(cfg.data)


def vocab_size_for(cfg: RunConfig, tokenizer) -> int:
    raw = tokenizer.vocab_size if tokenizer is not None else cfg.model.vocab_size
    return padded_vocab_size(raw, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)


def build_wrapped_model(cfg: RunConfig, vocab: int, cpu: bool):
    """GPTModel for this stage, in Float16Module when bf16, in megatron DDP."""
    model = build_model(cfg, vocab, cpu=cpu)
    config = model.config
    # read by the schedules (no per-micro-batch mean), DDP (no 1/DP) and finalize_model_grads (1/total tokens)
    config.calculate_per_token_loss = cfg.training.calculate_per_token_loss
    config.deterministic_mode = cfg.training.deterministic_mode
    if not cpu:
        model.cuda(torch.cuda.current_device())
    if cfg.training.bf16:
        model = Float16Module(config, model)
    p = cfg.parallel
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not (cfg.training.bf16 and p.grad_reduce_in_bf16),
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        bucket_size=ddp_bucket_size(cfg),
        # The distributed optimizers reduce-scatter into buffers laid out for them: byte-sharded for
        # adam, whole-matrix shards for the layer-wise one (below).
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # we check ourselves and skip the step instead of crashing
    )
    from megatron_md.mcore.param_tags import tag_params

    tag_params(model)  # layout-independent names for optimizer state, routing and diagnostics
    layout = layer_wise_param_layout(cfg, model, ddp_config) if layer_wise(cfg) else None
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, full_param_layout=layout)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp, config


def ddp_bucket_size(cfg: RunConfig) -> int | None:
    """Elements per communication bucket: megatron's rule (one bucket per buffer without overlap; with it
    max(40M, 1M x DP) unless --ddp-bucket-size), resolved here because the layer-wise layout below packs
    its shards into buckets of this size before DDP would fill it in."""
    p = cfg.parallel
    if not p.overlap_grad_reduce:
        return None
    return p.ddp_bucket_size or max(40_000_000, 1_000_000 * ps.get_data_parallel_world_size(with_context_parallel=True))


def layer_wise_param_layout(cfg: RunConfig, model, ddp_config):
    """megatron-core's shard-aligned DDP layout for the layer-wise distributed optimizer.

    Every matrix the matrix optimizer steps goes to a buffer whose buckets are LPT-packed by size into
    whole-matrix DP shards (a rank then keeps optimizer state for its shard only, and the updated weights
    come back by the buffer all-gather); the parameters it leaves to AdamW go to a byte-sharded buffer
    for megatron's DistributedOptimizer. Without a layout megatron falls back to assigning matrices by
    count in ping-pong order, which at DP2 left one rank holding 0.93 of MD's state on ``tiny-dense``.
    """
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    steps_matrix = matrix_optimizer_routing(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # read by DDP's buffer grouping and by the layout
        p.is_managed_by_layer_wise_optimizer = steps_matrix(p)
    return LayerWiseDistributedOptimizer.compute_full_param_layout(
        params, ddp_config.bucket_size, ps.get_data_parallel_world_size(with_context_parallel=True), ddp_config,
        expert_data_parallel_world_size=ps.get_expert_data_parallel_world_size(),
    )


def matrix_optimizer_routing(cfg: RunConfig):
    """``p -> bool``: whether the matrix (layer-wise) optimizer steps ``p``; the same rule its registry
    entry routes by, so buffers and param groups agree."""
    return family_of(cfg).routing(cfg)


def ns_matmul_precision(setting: str, device: torch.device) -> str:
    """--muon-fp32-matmul-prec resolved: 'auto' is bf16 Newton-Schulz ('medium') on GPUs and fp32 on CPU,
    where a bf16 GEMM without native bf16 units took 737 ms against 7 ms in fp32 (256x2048, one core)."""
    if setting != "auto":
        return setting
    return "highest" if device.type == "cpu" else "medium"


def ns_tp_mode(setting: str, optimizer: str) -> str:
    """--muon-tp-mode resolved: 'auto' is the family's mode (one owner per matrix for MD and Manifold Muon,
    our engine; megatron Muon's TP-size-independent 'duplicated' for muon)."""
    return FAMILIES[optimizer].default_ns_tp_mode if setting == "auto" else setting


def build_optimizer(cfg: RunConfig, ddp_model):
    """megatron's optimizer for the run's family, and its LR scheduler."""
    optimizer, scheduler, _ = build_optimizer_and_hooks(cfg, ddp_model)
    return optimizer, scheduler


def build_optimizer_and_hooks(cfg: RunConfig, ddp_model, timers=None):
    """The optimizer, its scheduler, and the family's per-run hooks (``families.RunHooks``); ``timers``: the
    run's megatron-core Timers (OptimizerConfig.timers), or None."""
    o, t = cfg.optimizer, cfg.training
    family = family_of(cfg)
    common = dict(
        optimizer=o.optimizer,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=t.bf16,
        timers=timers,
        params_dtype=torch.bfloat16 if t.bf16 else torch.float32,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer and not family.steps_matrices,
        use_layer_wise_distributed_optimizer=layer_wise(cfg),
        # the Muon section's fields are megatron's own OptimizerConfig fields (family_configs.MuonConfig): passed
        # whole, with its two 'auto' values resolved
        **{**dataclasses.asdict(o.muon), "muon_tp_mode": ns_tp_mode(o.muon.muon_tp_mode, o.optimizer),
           "muon_fp32_matmul_prec": ns_matmul_precision(o.muon.muon_fp32_matmul_prec,
                                                        next(ddp_model.parameters()).device)},
        **({"decoupled_lr": o.decoupled_lr, "decoupled_min_lr": o.decoupled_min_lr} if o.decoupled_lr else {}),
    )
    optimizer, hooks = family.build(cfg, common, ddp_model)
    from megatron_md.mcore import multi_tensor

    multi_tensor.use_foreach(optimizer)  # megatron's per-tensor fallbacks -> foreach (mcore/multi_tensor.py)
    gbs = global_batch_size(cfg)
    warmup, decay, horizon = schedule_samples(cfg, gbs)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=horizon,
        wd_incr_style="constant",
        wsd_decay_steps=(o.lr_wsd_decay_iters or 0) * gbs if o.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style=o.lr_wsd_decay_style,
    )
    return optimizer, scheduler, hooks


def schedule_samples(cfg: RunConfig, gbs: int) -> tuple[float, int, int]:
    """(warmup, decay horizon, training horizon) in samples, as Megatron-LM counts them: from --train-samples and
    the -samples flags when training is sample-based, else iterations x the global batch; --lr-warmup-fraction
    is a share of the decay horizon."""
    o, t = cfg.optimizer, cfg.training
    if t.train_samples:
        decay, horizon, warmup = o.lr_decay_samples or t.train_samples, t.train_samples, o.lr_warmup_samples
    else:
        decay, horizon = max(o.lr_decay_iters or t.train_iters, 1) * gbs, max(t.train_iters, 1) * gbs
        warmup = o.lr_warmup_iters * gbs
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    return warmup, decay, horizon


def layer_wise(cfg: RunConfig) -> bool:
    """Matrix optimizers shard over DP through megatron's layer-wise optimizer (whole matrices)."""
    return cfg.parallel.use_distributed_optimizer and family_of(cfg).steps_matrices


def global_batch_size(cfg: RunConfig) -> int:
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    return cfg.training.global_batch_size or cfg.training.micro_batch_size * data_parallel_size(cfg, world)


def with_vocab(model_cfg, vocab: int):
    import copy

    m = copy.copy(model_cfg)
    m.vocab_size = vocab
    return m
