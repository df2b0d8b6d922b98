"""Probe: re-save one of our checkpoints in Megatron-LM's torch_dist layout, as Megatron-LM would write it.

Run by test_megatron_lm.py (``python _megatron_lm_writer.py JSON``; one rank) with ``{"src": our checkpoint root,
"iteration": N, "out": Megatron-LM root}``. It builds the run's model, optimizer and scheduler with megatron_md's
own builders from the ``run_config.yaml`` saved there, loads iteration N into them, and saves what Megatron-LM's
``generate_state_dict`` + ``save_checkpoint`` save, through the same megatron-core ``dist_checkpointing.save``
(https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/megatron/training/checkpointing.py):

- reproduced: ``args`` (an argparse Namespace under Megatron-LM's arg names, with the values its validate_args
  fills in), ``checkpoint_version`` 3.0, ``iteration``, ``model`` (GPTModel.sharded_state_dict), ``optimizer``
  (the optimizer's sharded_state_dict with Megatron-LM's metadata: dp_reshardable, chained_optim_avoid_prefix),
  ``opt_param_scheduler``, ``rng_state`` (a ShardedObject over (PP, TP) with the DP rank as replica, its key names),
  ``num_floating_point_operations_so_far``, the content metadata, and ``latest_checkpointed_iteration.txt``;
- left out: ``rerun_state_machine`` (Megatron-LM's rerun state; nothing here reads it) and the ModelOpt state.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch


def megatron_lm_args(cfg, vocab: int, consumed: int) -> argparse.Namespace:
    """Megatron-LM's args for this run, after its validate_args (dest names, its conventions)."""
    m, p, o, t = cfg.model, cfg.parallel, cfg.optimizer, cfg.training
    gqa = m.num_query_groups not in (None, m.num_attention_heads)
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, group_query_attention=gqa,
        num_query_groups=m.num_query_groups if gqa else 1, kv_channels=m.kv_channels,
        seq_length=m.seq_length, max_position_embeddings=m.max_position_embeddings,
        position_embedding_type=m.position_embedding_type, use_rotary_position_embeddings=False,
        add_position_embedding=True, rotary_base=m.rotary_base, rotary_percent=m.rotary_percent,
        rotary_interleaved=False, use_rope_scaling=False, rotary_seq_len_interpolation_factor=None,
        normalization=m.normalization, norm_epsilon=m.norm_epsilon, apply_layernorm_1p=m.apply_layernorm_1p,
        swiglu=m.swiglu, squared_relu=False, quick_geglu=False, openai_gelu=False,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        add_bias_linear=not m.disable_bias_linear, add_qkv_bias=not m.disable_bias_linear,
        qk_layernorm=m.qk_layernorm, multi_latent_attention=False, mtp_num_layers=None, num_experts=m.num_experts,
        attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout, init_method_std=m.init_method_std,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by, padded_vocab_size=vocab,
        vocab_size=m.vocab_size, tokenizer_type="NullTokenizer", mock_data=True, transformer_impl="local",
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size, context_parallel_size=1,
        data_parallel_size=1, world_size=1, rank=0, use_distributed_optimizer=p.use_distributed_optimizer,
        optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, lr_decay_style=o.lr_decay_style,
        lr_warmup_iters=o.lr_warmup_iters, weight_decay=o.weight_decay, clip_grad=o.clip_grad,
        adam_eps=o.adam_eps, bf16=t.bf16, fp16=False, params_dtype=torch.bfloat16 if t.bf16 else torch.float32,
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size, train_iters=t.train_iters,
        seed=t.seed, consumed_train_samples=consumed, consumed_valid_samples=0, ckpt_format="torch_dist",
        no_save_optim=None, no_save_rng=None, dist_ckpt_optim_fully_reshardable=False,
    )


def main() -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_md.training.arguments import quiet_megatron
    from megatron_md.training.build import (build_optimizer_and_hooks, build_wrapped_model, make_tokenizer, setup_parallel,
                                            vocab_size_for)
    from megatron_md.training.checkpoints import checkpointing as ckpt
    from megatron_md.training.config import resolve

    quiet_megatron()
    torch.set_num_threads(1)
    job = json.loads(sys.argv[1])
    src = Path(job["src"])
    cfg = resolve(None, str(ckpt.iter_dir(src, job["iteration"]) / ckpt.RUN_CONFIG), {})
    c = cfg.checkpoint
    c.save = c.load = c.pretrained_checkpoint = c.save_interval = None
    setup_parallel(cfg)
    vocab = vocab_size_for(cfg, make_tokenizer(cfg))
    model, _ = build_wrapped_model(cfg, vocab, cpu=True)
    optimizer, scheduler, hooks = build_optimizer_and_hooks(cfg, model)
    with torch.no_grad():
        common = ckpt.load_checkpoint(src, model, optimizer, scheduler, iteration=job["iteration"], load_rng=False,
                                      hooks=hooks)

    # Megatron-LM's generate_state_dict, in its order
    metadata = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}
    state = {"args": megatron_lm_args(cfg, vocab, common["consumed_samples"]), "checkpoint_version": 3.0,
             "iteration": job["iteration"]}
    state["model"] = ckpt.unwrap(model).sharded_state_dict(metadata=metadata)
    state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=False, metadata=metadata)
    state["opt_param_scheduler"] = scheduler.state_dict()
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),  # no CUDA here
           "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    state["rng_state"] = ShardedObject(
        "rng_state", [rng], (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    state["num_floating_point_operations_so_far"] = 0

    out = Path(job["out"])
    name = out / f"iter_{job['iteration']:07d}"
    if dist.get_rank() == 0:
        name.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(name), content_metadata=metadata)
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text(str(job["iteration"]))
        print("WROTE " + str(name), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
