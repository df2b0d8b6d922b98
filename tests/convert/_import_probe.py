"""Multi-rank probe: an imported checkpoint's logits at another layout (TP2 x EP2 on 2 ranks).

Run by tests/convert/test_hf_import.py as ``_import_probe.py CKPT TOKENS.pt OUT.pt LAYOUT_JSON``: every rank
builds the checkpoint's model at the layout, loads it through ``dist_checkpointing`` (which reshards the
layout-free import), runs the tokens, gathers the vocab-parallel logits over TP, and rank 0 saves them.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import yaml


def main() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_md.models.builder import build_model
    from megatron_md.training.arguments import quiet_megatron
    from megatron_md.training.build import make_tokenizer, setup_parallel, vocab_size_for
    from megatron_md.training.checkpoints import checkpointing as ckpt
    from megatron_md.training.config import RunConfig
    from megatron_md.training.validate import validate_for_inference

    quiet_megatron()
    root, tokens_file, out, layout = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    text, _ = ckpt.read_run_config(root)
    cfg = RunConfig.from_dict(yaml.safe_load(text))
    for k, v in layout.items():
        setattr(cfg.parallel, k, v)
    cfg.parallel.use_distributed_optimizer = False
    cfg.training.device, cfg.training.nproc_per_node = "cpu", int(os.environ.get("WORLD_SIZE", "1"))
    cfg.checkpoint.save = cfg.checkpoint.load = cfg.checkpoint.save_interval = None
    cfg.model.transformer_impl = "local"
    setup_parallel(cfg, check=validate_for_inference)
    model = build_model(cfg, vocab_size_for(cfg, make_tokenizer(cfg)), cpu=True)
    ckpt.load_checkpoint(root, model, load_optim=False, load_rng=False, verify=True)
    model.eval()
    tokens = torch.load(tokens_file)["tokens"]
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        local = model(tokens, pos, None).float().contiguous()
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    if dist.get_rank() == 0:
        torch.save(torch.cat(parts, dim=-1), out)
    dist.barrier()


if __name__ == "__main__":
    main()
