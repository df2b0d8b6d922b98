"""Reject invalid settings before any work starts, naming the flag and the fix."""

from __future__ import annotations

from pathlib import Path

from megatron_md.training.config import RunConfig


class ConfigError(ValueError):
    """A setting that cannot work; the message names the flag and how to fix it."""


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def validate_config(cfg: RunConfig, world_size: int) -> None:
    """Raise ConfigError for the first invalid combination found."""
    m, p, t, o = cfg.model, cfg.parallel, cfg.training, cfg.optimizer
    errors: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        need(getattr(p, name) >= 1, f"--{name.replace('_', '-')} must be >= 1")
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
        need(t.micro_batch_size >= 1, "--micro-batch-size must be >= 1")
        need(
            gbs % (t.micro_batch_size * dp) == 0,
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {t.micro_batch_size} x "
            f"data-parallel size {dp}; use a multiple of {t.micro_batch_size * dp}",
        )
    need(t.train_iters >= 0, "--train-iters must be >= 0")
    need(t.train_iters > 0 or cfg.checkpoint.save is not None, "--train-iters 0 only makes sense with --save (a seed checkpoint)")
    need(o.lr > 0, "--lr must be > 0")
    need(0 <= o.min_lr <= o.lr, f"--min-lr {o.min_lr} must be between 0 and --lr {o.lr}")
    need(
        o.lr_warmup_iters < (o.lr_decay_iters or t.train_iters) or o.lr_warmup_iters == 0,
        f"--lr-warmup-iters {o.lr_warmup_iters} must be smaller than the decay horizon "
        f"(--lr-decay-iters or --train-iters {t.train_iters})",
    )
    if o.lr_decay_style == "WSD":
        need(o.lr_wsd_decay_iters is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters")
    need(o.clip_grad >= 0, "--clip-grad must be >= 0 (0 disables clipping)")
    if o.optimizer == "manifold_muon":
        for name in ("manifold_dual_steps", "manifold_msign_steps", "manifold_fast_dual_steps",
                     "manifold_fast_msign_steps"):
            need(getattr(o, name) >= 1, f"--{name.replace('_', '-')} must be >= 1")
        for name in ("manifold_dual_lr", "manifold_fast_dual_lr"):
            need(getattr(o, name) > 0, f"--{name.replace('_', '-')} must be > 0")
    if o.optimizer == "muon":
        need(o.muon_tp_mode != "layer_sharded",
             "--muon-tp-mode layer_sharded is MD's and Manifold Muon's engine; megatron-core 0.19's muon takes "
             "duplicated, distributed or blockwise")
    elif o.optimizer in ("muon_md", "manifold_muon"):
        need(o.muon_tp_mode in ("auto", "layer_sharded", "duplicated"),
             f"--muon-tp-mode {o.muon_tp_mode} is megatron Muon's; {o.optimizer} orthogonalises whole matrices: "
             "use layer_sharded (default) or duplicated")
    if o.optimizer in ("muon_md", "adam_md", "manifold_muon"):
        need(o.muon_scale_mode == "spectral",
             f"--muon-scale-mode is megatron Muon's; {o.optimizer} scales its update with --md-scale-mode")
        need(o.muon_extra_scale_factor == 1.0,
             f"--muon-extra-scale-factor is megatron Muon's; {o.optimizer} has no extra update scale (its LR sets "
             "the step: --matrix-lr)")
    if o.optimizer == "manifold_muon":
        need(o.md_ns_coefficients == "quintic" or "md" in o.geometry,
             "--md-ns-coefficients applies to MD groups only and --geometry "
             f"{o.geometry} has none; Manifold Muon uses Polar Express (--manifold-msign-steps, "
             "--manifold-fast-msign-steps)")
        need(o.muon_num_ns_steps == 5 or "md" in o.geometry,
             "--muon-num-ns-steps applies to MD groups only and --geometry "
             f"{o.geometry} has none; set --manifold-msign-steps / --manifold-fast-msign-steps instead")
    need(cfg.logging.log_interval >= 1, "--log-interval must be >= 1")
    need(m.seq_length <= m.max_position_embeddings, "--seq-length exceeds --max-position-embeddings")
    if o.optimizer != "adam" and p.use_distributed_optimizer:
        need(
            t.bf16,
            f"--optimizer {o.optimizer} with --use-distributed-optimizer uses megatron-core's "
            "layer-wise distributed optimizer, which only supports bf16: add --bf16",
        )

    d = cfg.data
    if not d.mock_data:
        need(bool(d.data_path), "no data: pass --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
        need(
            d.tokenizer_type == "NullTokenizer" or bool(d.tokenizer_model or d.vocab_file or d.merge_file),
            "--tokenizer-model is required with --data-path (a SentencePiece .model from "
            "tools/train_tokenizer.py, a Hugging Face tokenizer.json or directory; or GPT-2 BPE "
            "--vocab-file and --merge-file)",
        )
    if not d.mock_data and d.tokenizer_type != "NullTokenizer":
        from megatron_md.training.tokenizer import tokenizer_errors

        for e in tokenizer_errors(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file):
            need(False, e)

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
    if c.save_interval is not None:
        need(c.save_interval >= 1, "--save-interval must be >= 1")
        need(c.save is not None, "--save-interval needs --save DIR")

    if errors:
        raise ConfigError("invalid settings:\n  - " + "\n  - ".join(errors))
