"""Reject invalid settings before any work starts, naming the flag and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from megatron_md.mcore.families import family_of
from megatron_md.training.config import RunConfig, range_errors


class ConfigError(ValueError):
    """A setting that cannot work; the message names the flag and how to fix it."""


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def _collector() -> tuple[list[str], Callable[[bool, str], None]]:
    """(errors, need): ``need(cond, msg)`` records ``msg`` when ``cond`` is false."""
    errors: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    return errors, need


def validate_config(cfg: RunConfig, world_size: int) -> None:
    """Raise ConfigError naming every invalid combination found."""
    out_of_range = range_errors(cfg)  # first: the checks below divide by these sizes
    if out_of_range:
        raise ConfigError("invalid settings:\n  - " + "\n  - ".join(out_of_range))
    errors = layout_errors(cfg, world_size) + optimizer_errors(cfg, world_size)
    errors += data_errors(cfg) + moe_layer_errors(cfg) + input_errors(cfg) + checkpoint_dir_errors(cfg)
    errors += performance_errors(cfg, world_size)
    errors += backend_errors(cfg)
    if cfg.logging.log_update_norms and not cfg.logging.diagnostics_interval:
        errors.append("--log-update-norms is measured on diagnostics steps: add --diagnostics-interval N (N > 0)")
    if errors:
        raise ConfigError("invalid settings:\n  - " + "\n  - ".join(errors))


def layout_errors(cfg: RunConfig, world_size: int) -> list[str]:
    """The parallel sizes against the world, the model's shapes and the batch."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    errors, need = _collector()
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    need(
        world_size % (tp * pp) == 0,
        f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
        f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes "
        "(--nproc-per-node) or change the sizes",
    )
    need(
        m.num_attention_heads % tp == 0,
        f"--num-attention-heads {m.num_attention_heads} is not divisible by "
        f"--tensor-model-parallel-size {tp}; use a TP size that divides the heads",
    )
    need(
        m.num_query_groups % tp == 0,
        f"--num-query-groups {m.num_query_groups} is not divisible by --tensor-model-parallel-size "
        f"{tp}; use a TP size that divides the query groups",
    )
    need(
        m.num_attention_heads % m.num_query_groups == 0,
        f"--num-attention-heads {m.num_attention_heads} is not a multiple of --num-query-groups "
        f"{m.num_query_groups}",
    )
    need(
        m.num_layers % pp == 0,
        f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
        "choose a PP size that divides the layers",
    )
    need(m.ffn_hidden_size % tp == 0, f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by TP {tp}")
    if m.num_experts:
        need(
            m.num_experts % ep == 0,
            f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}; "
            "use an EP size that divides the experts",
        )
        need(
            1 <= m.moe_router_topk <= m.num_experts,
            f"--moe-router-topk {m.moe_router_topk} must be between 1 and --num-experts {m.num_experts}",
        )
        need(
            (world_size // pp) % (ep * etp) == 0,
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} must divide "
            f"the {world_size // pp} ranks of a pipeline stage; launch more processes or lower EP",
        )
        need(
            not (tp > 1 and not p.sequence_parallel),
            "MoE with --tensor-model-parallel-size > 1 requires --sequence-parallel (megatron-core "
            "rule); add --sequence-parallel",
        )
    else:
        need(ep == 1, "--expert-model-parallel-size > 1 needs an MoE model (--num-experts)")
    need(not (p.sequence_parallel and tp == 1), "--sequence-parallel needs --tensor-model-parallel-size > 1")
    if p.sequence_parallel:
        need(
            m.seq_length % tp == 0,
            f"--seq-length {m.seq_length} must be divisible by TP {tp} with --sequence-parallel",
        )

    if world_size % (tp * pp) == 0:
        dp = data_parallel_size(cfg, world_size)
        gbs = t.global_batch_size or t.micro_batch_size * dp
        need(
            gbs % (t.micro_batch_size * dp) == 0,
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {t.micro_batch_size} x "
            f"data-parallel size {dp}; use a multiple of {t.micro_batch_size * dp}",
        )
    return errors


def optimizer_errors(cfg: RunConfig, world_size: int) -> list[str]:
    """The schedule, the LR settings and the optimizer family's own checks."""
    m, p, t, o = cfg.model, cfg.parallel, cfg.training, cfg.optimizer
    errors, need = _collector()
    errors += schedule_errors(cfg, world_size)
    need(t.train_iters > 0 or cfg.checkpoint.save is not None, "--train-iters 0 only makes sense with --save (a seed checkpoint)")
    need(0 <= o.min_lr <= o.lr, f"--min-lr {o.min_lr} must be between 0 and --lr {o.lr}")
    need(
        o.lr_warmup_iters < (o.lr_decay_iters or t.train_iters) or o.lr_warmup_iters == 0,
        f"--lr-warmup-iters {o.lr_warmup_iters} must be smaller than the decay horizon "
        f"(--lr-decay-iters or --train-iters {t.train_iters})",
    )
    if o.lr_decay_style == "WSD":
        need(o.lr_wsd_decay_iters is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters")
    family_of(cfg).validate(cfg, need)
    need(m.seq_length <= m.max_position_embeddings, "--seq-length exceeds --max-position-embeddings")
    if family_of(cfg).steps_matrices and p.use_distributed_optimizer:
        need(
            t.bf16,
            f"--optimizer {o.optimizer} with --use-distributed-optimizer uses megatron-core's "
            "layer-wise distributed optimizer, which only supports bf16: add --bf16",
        )
    return errors


def input_errors(cfg: RunConfig) -> list[str]:
    """Data paths and the tokenizer files they need."""
    d = cfg.data
    errors, need = _collector()
    if not d.mock_data:
        need(bool(d.data_path or d.train_data_path),
             "no data: pass --data-path PREFIX (see tools/preprocess_data.py), --train-data-path, or --mock-data")
        need(
            d.tokenizer_type == "NullTokenizer" or bool(d.tokenizer_model or d.vocab_file or d.merge_file),
            "--tokenizer-model is required with --data-path (a SentencePiece .model from "
            "tools/train_tokenizer.py, a Hugging Face tokenizer.json or directory; or GPT-2 BPE "
            "--vocab-file and --merge-file)",
        )
    if not d.mock_data and d.tokenizer_type != "NullTokenizer":
        from megatron_md.training.data.tokenizer import tokenizer_errors

        for e in tokenizer_errors(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file):
            need(False, e)
    return errors


def checkpoint_dir_errors(cfg: RunConfig) -> list[str]:
    """--load, --pretrained-checkpoint and --save: what they hold, and that nothing saved is overwritten."""
    errors, need = _collector()
    c = cfg.checkpoint
    same_dir = bool(c.load and c.save) and Path(c.load).resolve() == Path(c.save).resolve()
    if c.load and not Path(c.load).exists() and not same_dir:
        # --load X --save X on a fresh X is the requeue pattern: start from scratch.
        need(False, f"--load {c.load}: directory does not exist (drop --load to start from scratch)")
    if c.pretrained_checkpoint and not (Path(c.pretrained_checkpoint) / "latest_checkpointed_iteration.txt").exists():
        need(False, f"--pretrained-checkpoint {c.pretrained_checkpoint}: no latest_checkpointed_iteration.txt there")
    if c.save:
        has_ckpt = (Path(c.save) / "latest_checkpointed_iteration.txt").exists()
        resuming_here = c.load and Path(c.load).resolve() == Path(c.save).resolve()
        need(
            not has_ckpt or resuming_here,
            f"--save {c.save} already holds checkpoints; pass --load {c.save} to resume from them, "
            "or choose a new --save directory (existing checkpoints are never overwritten)",
        )
    if c.save_interval:
        need(c.save is not None, "--save-interval needs --save DIR")
    return errors


def validate_for_inference(cfg: RunConfig, world_size: int = 1) -> None:
    """What score, generate and export use of a saved config: the model, its layer backend and the tokenizer files.
    Not the data, the schedule or the checkpoint directories: a checkpoint imported from Hugging Face names no
    data, and none is needed to run it."""
    m = cfg.model
    errors = range_errors(cfg)
    if not errors and m.num_attention_heads % m.num_query_groups:
        errors.append(f"--num-attention-heads {m.num_attention_heads} is not a multiple of --num-query-groups "
                      f"{m.num_query_groups}")
    errors += backend_errors(cfg) + moe_layer_errors(cfg)
    d = cfg.data
    if not d.mock_data and d.tokenizer_type != "NullTokenizer" and (d.tokenizer_model or d.vocab_file or d.merge_file):
        from megatron_md.training.data.tokenizer import tokenizer_errors

        errors += tokenizer_errors(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file)
    if errors:
        raise ConfigError("invalid settings:\n  - " + "\n  - ".join(errors))


def moe_layer_errors(cfg: RunConfig) -> list[str]:
    """--moe-layer-freq: a pattern that parses, with at least one MoE layer; a dense model leaves it at 1."""
    from megatron_md.models.presets import moe_layer_pattern

    m = cfg.model
    if not m.num_experts:
        return [] if str(m.moe_layer_freq).strip() == "1" else [
            f"--moe-layer-freq {m.moe_layer_freq} needs an MoE model (--num-experts)"]
    try:
        pattern = moe_layer_pattern(m)
    except ValueError as e:
        return [str(e)]
    return [] if any(pattern) else [f"--moe-layer-freq {m.moe_layer_freq}: no MoE layer left (give --num-experts "
                                    "unset for a dense model)"]


def data_errors(cfg: RunConfig) -> list[str]:
    """Megatron-LM's rules for the per-split paths, and what the document switches need."""
    d, m = cfg.data, cfg.model
    errors = []
    per_split = d.train_data_path or d.valid_data_path or d.test_data_path
    if per_split and d.data_path:
        errors.append("--data-path with --train/valid/test-data-path: give one (the per-split paths replace "
                      "--data-path and --split)")
    if (d.valid_data_path or d.test_data_path) and not d.train_data_path:
        errors.append("--valid-data-path / --test-data-path need --train-data-path")
    if per_split and d.mock_data:
        errors.append("--mock-data with --train/valid/test-data-path: give one")
    if d.reset_attention_mask and (m.attention_backend in ("flash", "fused")
                                   or (m.attention_backend == "auto" and m.transformer_impl == "transformer_engine")):
        errors.append(f"--reset-attention-mask needs an attention that takes a per-sample mask: --attention-backend "
                      f"unfused, sdpa or local, not {m.attention_backend}")
    return errors


def schedule_errors(cfg: RunConfig, world_size: int) -> list[str]:
    """Sample-based training and the warmup flags, with Megatron-LM's rules. With --train-samples this is where
    --train-iters is set: the samples divided by the global batch, rounded down (as Megatron-LM)."""
    o, t, p = cfg.optimizer, cfg.training, cfg.parallel
    errors: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    need(o.lr_warmup_fraction is None or (o.lr_warmup_iters == 0 and o.lr_warmup_samples == 0),
         "--lr-warmup-fraction with --lr-warmup-iters or --lr-warmup-samples: give one warmup")
    need(o.decoupled_lr is None or family_of(cfg).takes_decoupled_lr,
         f"--decoupled-lr is megatron-core AdamW's embedding/output LR; --optimizer {o.optimizer} sets those with "
         "its own flags (--embedding-lr, --output-lr)" if family_of(cfg).holds_md_groups else
         f"--decoupled-lr works with --optimizer adam, not {o.optimizer}")
    need(o.decoupled_min_lr is None or o.decoupled_lr is not None, "--decoupled-min-lr needs --decoupled-lr")
    if not t.train_samples:
        need(o.lr_warmup_samples == 0 and o.lr_decay_samples is None,
             "--lr-warmup-samples and --lr-decay-samples need --train-samples (else use --lr-warmup-iters and "
             "--lr-decay-iters)")
        return errors
    need(o.lr_warmup_iters == 0 and o.lr_decay_iters is None,
         "--train-samples counts the schedule in samples: use --lr-warmup-samples and --lr-decay-samples, not "
         "--lr-warmup-iters / --lr-decay-iters")
    need(not t.rampup_batch_size, "--train-samples with --rampup-batch-size is not implemented: give --train-iters")
    tp_pp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if world_size % tp_pp == 0:
        gbs = t.global_batch_size or t.micro_batch_size * data_parallel_size(cfg, world_size)
        need(t.train_samples >= gbs, f"--train-samples {t.train_samples} is less than one global batch ({gbs})")
        t.train_iters = t.train_samples // gbs
    decay = o.lr_decay_samples or t.train_samples
    need(o.lr_warmup_samples < decay or o.lr_warmup_samples == 0,
         f"--lr-warmup-samples {o.lr_warmup_samples} must be smaller than the decay horizon ({decay} samples)")
    return errors


def performance_errors(cfg: RunConfig, world_size: int) -> list[str]:
    """The speed, memory, MoE, checkpoint and profiling knobs (issue 16), each naming its flag and fix."""
    m, p, t, c = cfg.model, cfg.parallel, cfg.training, cfg.checkpoint
    errors: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    need(not p.overlap_param_gather or (p.use_distributed_optimizer and p.overlap_grad_reduce),
         "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (the gather it "
         "overlaps is the distributed optimizer's, launched by the gradient buckets)")
    if p.ddp_bucket_size is not None:
        need(p.overlap_grad_reduce, "--ddp-bucket-size only matters with --overlap-grad-reduce (without it each "
             "buffer is reduced as one bucket after the backward pass); add --overlap-grad-reduce or drop it")
    layers_per_stage = m.num_layers // max(p.pipeline_model_parallel_size, 1)
    if m.recompute_num_layers is not None:
        need(1 <= m.recompute_num_layers <= layers_per_stage,
             f"--recompute-num-layers {m.recompute_num_layers} must be between 1 and the {layers_per_stage} "
             "layers of a pipeline stage")
    if m.num_experts:
        if m.moe_expert_capacity_factor is not None:
            need(m.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss", "none"),
                 f"--moe-expert-capacity-factor works with --moe-router-load-balancing-type aux_loss, "
                 f"seq_aux_loss or none, not {m.moe_router_load_balancing_type}")
        need(not m.moe_pad_expert_input_to_capacity or m.moe_expert_capacity_factor is not None,
             "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        shared = m.moe_shared_expert_intermediate_size
        need(shared is not None or not m.moe_shared_expert_gate,
             "--moe-shared-expert-gate gates the shared expert: it needs --moe-shared-expert-intermediate-size")
        need(shared is None or (shared > 0 and shared % p.tensor_model_parallel_size == 0),
             f"--moe-shared-expert-intermediate-size {shared} must be > 0 and divisible by TP "
             f"{p.tensor_model_parallel_size}")
    if t.rampup_batch_size:
        errors += _rampup_errors(cfg, world_size)
    if t.profile:
        need(1 <= t.profile_step_start < t.profile_step_end,
             f"--profile-step-start {t.profile_step_start} must be >= 1 and below --profile-step-end "
             f"{t.profile_step_end}")
        ranks = t.profile_ranks or ["0"]
        need(all(r.isdigit() and int(r) < world_size for r in ranks),
             f"--profile-ranks {' '.join(ranks)}: global ranks of this run are 0..{world_size - 1}")
    need(cfg.logging.timing_log_level <= 2, f"--timing-log-level {cfg.logging.timing_log_level}: the levels are 0, "
         "1 and 2")
    need(t.empty_unused_memory_level <= 2, f"--empty-unused-memory-level {t.empty_unused_memory_level}: the "
         "levels are 0 (never), 1 (after each forward-backward) and 2 (after the optimizer step too)")
    if c.keep_last_n_checkpoints is not None:
        need(c.save is not None, "--keep-last-n-checkpoints needs --save DIR")
    need(not c.async_save or c.save is not None, "--async-save needs --save DIR")
    return errors


def backend_errors(cfg: RunConfig) -> list[str]:
    """--attention-backend against the layer spec the run will build (decided as the model build decides
    it, TE importing or not), and the MoE options that need a kernel, so what the build cannot take is refused
    before any process starts."""
    import torch

    from megatron_md.models.backends import resolved_attention_backend, use_transformer_engine

    m, device = cfg.model, cfg.training.device
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    try:
        use_te = use_transformer_engine(m.transformer_impl, cpu)
        resolved_attention_backend(m, cpu=cpu, use_te=use_te)
    except ValueError as e:
        return [str(e)]
    return moe_errors(m, cpu=cpu, use_te=use_te)


# MoE options that mean nothing in a dense model, with their defaults
MOE_ONLY = {"moe_z_loss_coeff": None, "moe_expert_capacity_factor": None, "moe_shared_expert_intermediate_size": None,
            "moe_shared_expert_gate": False,
            "moe_router_dtype": None, "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
            "moe_permute_fusion": False}


def moe_errors(m, *, cpu: bool, use_te: bool) -> list[str]:
    """The router options and the recomputed modules, each naming its flag and the fix."""
    from megatron_md.models.backends import moe_grouped_gemm

    errors: list[str] = []
    mods = set(m.recompute_modules or ())
    if mods and m.recompute_granularity != "selective":
        errors.append(f"--recompute-modules {' '.join(sorted(mods))} applies to --recompute-granularity selective; "
                      "add it, or drop --recompute-modules")
    if not m.num_experts:
        errors += [f"--{name.replace('_', '-')} needs an MoE model (--num-experts)"
                   for name, default in MOE_ONLY.items() if getattr(m, name) != default]
        if mods & {"moe", "moe_act", "shared_experts"}:
            errors.append("--recompute-modules moe, moe_act and shared_experts need an MoE model (--num-experts)")
        return errors
    if m.moe_router_enable_expert_bias and m.moe_router_score_function == "softmax":
        errors.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (or "
                      "sqrtsoftplus): megatron-core biases only those scores")
    if m.moe_permute_fusion and not use_te:
        where = "this run is on the CPU" if cpu else "transformer_engine does not import"
        errors.append(f"--moe-permute-fusion needs Transformer Engine's permute kernels on CUDA ({where}); drop it")
    if "moe_act" in mods and not moe_grouped_gemm(m, use_te, warn=False):
        errors.append("--recompute-modules moe_act needs grouped GEMM experts (Transformer Engine on CUDA); "
                      "recompute moe instead")
    if "shared_experts" in mods and not m.moe_shared_expert_intermediate_size:
        errors.append("--recompute-modules shared_experts needs --moe-shared-expert-intermediate-size")
    return errors


def _rampup_errors(cfg: RunConfig, world_size: int) -> list[str]:
    t = cfg.training
    try:
        start, incr, samples = (int(x) for x in t.rampup_batch_size)
    except ValueError:
        return [f"--rampup-batch-size {' '.join(t.rampup_batch_size)}: expected three integers, START INCREMENT "
                "SAMPLES"]
    dp = data_parallel_size(cfg, world_size) or 1
    unit = t.micro_batch_size * dp
    gbs = t.global_batch_size or unit
    if not (1 <= start < gbs and incr >= 1 and samples >= 1):
        return [f"--rampup-batch-size {start} {incr} {samples}: need 1 <= START < --global-batch-size {gbs}, "
                "INCREMENT >= 1 and SAMPLES >= 1"]
    errors = []
    if start % unit or incr % unit:
        errors.append(f"--rampup-batch-size {start} {incr} {samples}: START and INCREMENT must be multiples of "
                      f"--micro-batch-size x data-parallel size = {unit}")
    if (gbs - start) % incr:
        errors.append(f"--rampup-batch-size {start} {incr} {samples}: --global-batch-size {gbs} minus START must "
                      "be a multiple of INCREMENT")
    return errors

