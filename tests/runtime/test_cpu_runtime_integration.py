"""CPU runtime, integration: megatron-core's RNG, a GPT with DDP and its optimizers at world size 1."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _layout_probe as lp  # noqa: E402

# ------------------------------------------------------------------------------- integration


@pytest.mark.parametrize("inference", [False, True], ids=["default", "inference_tracker"])
def test_model_parallel_cuda_manual_seed(mp_world, inference):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    kw = dict(inference_rng_tracker=True, force_reset_rng=True) if inference else {}
    model_parallel_cuda_manual_seed(1234, **kw)
    tracker = get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    if inference:  # the no-op tracker: fork() is a plain context
        assert not torch.equal(torch.get_rng_state(), before)
        return
    assert {"model-parallel-rng", "expert-parallel-rng", "data-parallel-rng"} <= set(
        tracker.get_states()
    )
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched by the fork
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)  # the tracked stream advanced
    model_parallel_cuda_manual_seed(1234)  # reseeding reproduces the tracked draws
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), a)


def test_gpt_ddp_adam_train_and_checkpoint(mp_world, tmp_path):
    """World size 1: GPTModel + megatron DDP + Adam, 2 steps, torch_dist save/load bit-exact.

    dist-ckpt's save creates a spawn-context multiprocessing Manager (filesystem_async.py:65);
    the spawned child re-imports ``__main__``, which is pytest's own guarded entry point here, so
    no extra setting is needed (scripts need an ``if __name__ == "__main__"`` guard).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    cfg = lp.tiny_config()
    model = lp.build_gpt(cfg)
    assert all(p.device.type == "cpu" for p in model.parameters())
    chunks = [lp.wrap_ddp(cfg, model)]
    opt = lp.make_optimizer(chunks, optimizer="adam", lr=1e-3)
    losses = lp.train_steps(chunks, opt, cfg, steps=2)
    assert all(math.isfinite(x) for x in losses)
    assert losses[1] < losses[0], losses  # same batch twice: Adam must reduce the loss

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(ckpt), sharded_strategy=None)
    assert (ckpt / ".metadata").exists()
    ref = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt))
    model.load_state_dict(loaded)
    now = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert now.keys() == ref.keys()
    assert all(torch.equal(now[k], ref[k]) for k in ref)


@pytest.mark.parametrize(
    "optimizer, bf16, dist_opt, inner",
    [
        ("adam", True, True, "DistributedOptimizer"),
        ("muon", False, False, "TensorParallelMuon"),
        ("muon", True, False, "Float16OptimizerWithFloat16Params"),
    ],
    ids=["adam-bf16-distopt", "muon-fp32", "muon-bf16"],
)
def test_gpt_optimizer_variants(mp_world, optimizer, bf16, dist_opt, inner):
    """get_megatron_optimizer paths that check param.type() against 'torch.cuda.*Tensor'."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    model_parallel_cuda_manual_seed(1234)
    cfg = lp.tiny_config(bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
    model = lp.build_gpt(cfg)
    if bf16:
        model = Float16Module(cfg, model)  # before DDP, as training does
    chunks = [lp.wrap_ddp(cfg, model, use_distributed_optimizer=dist_opt)]
    opt = lp.make_optimizer(
        chunks, optimizer=optimizer, bf16=bf16, use_distributed_optimizer=dist_opt
    )
    names = [type(o).__name__ for o in opt.chained_optimizers]
    names += [type(getattr(o, "optimizer", None)).__name__ for o in opt.chained_optimizers]
    assert inner in names, names
    losses = lp.train_steps(chunks, opt, cfg, steps=2)
    assert all(math.isfinite(x) for x in losses) and losses[1] < losses[0], losses
