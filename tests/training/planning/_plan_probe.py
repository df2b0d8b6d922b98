"""Multi-rank probe: what the trainer really allocates, for ``megatron-md plan`` to be checked against.

Run under torchrun (or plain python for world size 1) by ``tests/training/planning/test_plan.py`` with a JSON list
of cases (``{"name", "model", "cli"}``: a preset and ``train`` config fields). For each case it builds the
model and optimizer with megatron_md's own builders, runs one forward (saved-tensor hooks count the bytes
autograd keeps for backward), backward and optimizer step, then sums on each rank:

- params: the DDP param buffers (distributed optimizer) or the model's parameter storages;
- grads: the DDP grad buffers (dense and expert-parallel);
- master: fp32 parameters the inner optimizers step that are not model storages (bf16 master weights);
- state: every tensor in the inner optimizers' state (moments, momentum, MD gains and their moments, duals);
- activations: unique storages saved for backward in the forward, model storages excluded;
- scores: the part of ``activations`` in tensors whose last two dims are (seq, seq): the attention
  probabilities, their copies, dropout masks and causal masks that unfused attention keeps.

Rank 0 prints ``PROBE {name: {metric: max over ranks}}``. The ``__main__`` guard matters: megatron's
dist-ckpt re-imports the file.
"""

from __future__ import annotations

import json
import sys

import torch


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def measure(case: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_md.mcore.optimizer_checkpoint import walk
    from megatron_md.training.build import (build_optimizer, build_wrapped_model, setup_parallel,
                                            vocab_size_for)
    from megatron_md.training.config import resolve

    cli = {"mock_data": True, "wandb_mode": "disabled", "device": "cpu", "seed": 1234, **case["cli"]}
    cfg = resolve(case["model"], None, cli)
    setup_parallel(cfg)
    model, _ = build_wrapped_model(cfg, vocab_size_for(cfg, None), cpu=True)
    optimizer, _ = build_optimizer(cfg, model)

    buffers = list(model.buffers) + list(model.expert_parallel_buffers)
    model_storages = {storage_key(p): storage_bytes(p) for p in model.module.parameters()}
    param_buffers = [b.param_data for b in buffers if getattr(b, "param_data", None) is not None]
    params = sum(b.numel() * b.element_size() for b in param_buffers) if param_buffers else sum(
        model_storages.values())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)

    # Forward on one micro-batch with every tensor autograd saves for backward counted once per storage.
    m, t = cfg.model, cfg.training
    tp = ps.get_tensor_model_parallel_world_size()
    g = torch.Generator().manual_seed(1 + ps.get_data_parallel_rank())
    tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length), generator=g)
    saved: dict[int, int] = {}
    scores: dict[int, int] = {}

    def pack(x):
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            k = storage_key(x)
            if k not in model_storages:
                saved[k] = storage_bytes(x)
                if x.dim() >= 2 and tuple(x.shape[-2:]) == (m.seq_length, m.seq_length):
                    scores[k] = storage_bytes(x)
        return x

    position_ids = torch.arange(m.seq_length).unsqueeze(0).expand_as(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = model(tokens, position_ids, None, labels=torch.roll(tokens, -1, 1))
    activations = sum(saved.values())
    out.float().mean().backward()
    model.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok, f"{case['name']}: optimizer.step() failed"

    state_seen, master_seen = {}, {}
    for o in walk(optimizer):
        if not isinstance(o, torch.optim.Optimizer):
            continue
        for s in o.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:  # step counters are scalars
                    # a view's own bytes: MD keeps same-shape matrices' state as views of one stacked tensor
                    state_seen[(storage_key(v), v.storage_offset(), tuple(v.shape))] = v.numel() * v.element_size()
        for group in o.param_groups:
            for p in group["params"]:
                k = storage_key(p)
                if k not in model_storages and all(k != storage_key(b) for b in param_buffers):
                    master_seen[k] = p.numel() * p.element_size()
    vals = torch.tensor([params, grads, sum(master_seen.values()), sum(state_seen.values()), activations,
                         sum(scores.values())], dtype=torch.float64)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    keys = ("params", "grads", "master", "state", "activations", "scores")
    return {**dict(zip(keys, map(int, vals.tolist()))), "tp": tp, "dp": ps.get_data_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size()}


def main() -> None:
    import torch.distributed as dist

    from megatron_md.training.arguments import quiet_megatron

    quiet_megatron()
    torch.set_num_threads(1)
    cases = json.loads(sys.argv[1])
    out = {c["name"]: measure(c) for c in cases}
    if dist.get_rank() == 0:
        print("PROBE " + json.dumps(out), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
