"""Checkpoints through megatron.core.dist_checkpointing (torch_dist), written atomically.

Layout (Megatron's): ``SAVE/iter_0000100/`` holding the sharded tensors, a human-readable
``run_config.yaml`` and the tokenizer model, plus ``SAVE/latest_checkpointed_iteration.txt``.
A save goes to ``iter_XXXXXXX.partial`` and is renamed only after every rank finished, and the
``latest`` file is replaced last, so a run killed mid-save leaves the previous checkpoint
loadable. Existing checkpoints are never overwritten.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model as unwrap

from megatron_md.mcore import multi_tensor
from megatron_md.mcore.run_hooks import RunHooks
from megatron_md.mcore.optimizer_checkpoint import (
    after_load,
    byte_sharded_optimizers,
    has_byte_sharded_state,
    layer_wise_groups_from_config,
    prepare_for_load,
)
from megatron_md.training.checkpoints.integrity import (LATEST, iter_dir, latest_iteration, verify_checkpoint,
                                                       write_manifest)
from megatron_md.training.checkpoints.preemption import maybe_delay_save

RUN_CONFIG = "run_config.yaml"
# megatron's byte-sharded DistributedOptimizer (adam): 'dp_reshardable' writes each rank's buffer
# shard in parallel and reshards across DP only; 'fully_reshardable' gathers a canonical per-parameter
# state on DP rank 0 at save and loads at any layout (--dist-ckpt-optim-fully-reshardable).
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"


class CheckpointMismatch(ValueError):
    """A checkpoint that cannot be loaded into this run as asked (layout, optimizer); says the way out."""


def current_layout() -> dict[str, int]:
    """The parallel layout a checkpoint is saved at (stored in its common state)."""
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(with_context_parallel=True),
    }


def describe_layout(layout: dict) -> str:
    return " x ".join(f"{k.upper()}{layout[k]}" for k in ("tp", "pp", "ep", "etp", "dp") if k in layout)


def check_optimizer_reshard(root, saved: dict, optimizer) -> None:
    """Refuse, before reading any tensor, byte-sharded optimizer state this layout cannot take."""
    layout, now = saved.get("layout"), current_layout()
    if layout is None or not has_byte_sharded_state(optimizer):
        return  # saved before layouts were recorded: megatron itself reports a mismatch
    count = saved.get("byte_sharded_optimizers")
    if count is not None and count != byte_sharded_optimizers(optimizer):
        raise CheckpointMismatch(
            f"--load {root}: the distributed Adam state was saved at {describe_layout(layout)} by {count} "
            f"byte-sharded optimizer(s); this run ({describe_layout(now)}) has {byte_sharded_optimizers(optimizer)} "
            "(megatron-core keeps expert parameters in an optimizer of their own only when EP > 1), and megatron "
            "cannot map the state between them. Resume at the saved EP size, or pass --no-load-optim to keep the "
            "weights and start the optimizer afresh."
        )
    if saved.get("optim_sharding", DP_RESHARDABLE) != DP_RESHARDABLE:
        return
    if any(layout.get(k) != now[k] for k in ("tp", "pp", "ep", "etp")):
        raise CheckpointMismatch(
            f"--load {root}: the distributed Adam state was saved at {describe_layout(layout)} in the "
            f"'dp_reshardable' format, which only reshards across data parallel; this run is "
            f"{describe_layout(now)}. Resume at the saved TP/PP/EP sizes, or resume there once with "
            "--dist-ckpt-optim-fully-reshardable and save (that checkpoint loads at any layout), "
            "or pass --no-load-optim to keep the weights and start the optimizer afresh."
        )


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _hooks(optimizer, hooks):
    """The family's run hooks (mcore/run_hooks.py): required with an optimizer, whose extra state they save."""
    if hooks is None and optimizer is not None:
        raise TypeError("an optimizer comes with its family's run hooks (hooks=, from build_optimizer_and_hooks): "
                        "they save and load the state megatron does not")
    return hooks if hooks is not None else RunHooks()


def _sharded_state(
    model, optimizer, *, is_loading: bool, with_optim: bool, with_rng: bool, layer_wise: bool = False,
    optim_sharding: str = DP_RESHARDABLE, avoid_prefix: bool = True, hooks=None,
) -> dict:
    model_sd = unwrap(model).sharded_state_dict()
    state: dict[str, Any] = {"model": model_sd}
    if with_optim:
        # avoid_prefix (Megatron-LM's choice for new checkpoints): per-parameter optimizer state is keyed
        # by parameter name alone, not also by the optimizer's position in the chain, which changes with
        # the layout (megatron chains expert params apart only when EP > 1).
        metadata = {"distrib_optim_sharding_type": optim_sharding, "chained_optim_avoid_prefix": avoid_prefix}
        state["optimizer"] = layer_wise_groups_from_config(
            optimizer, optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
        )
        # what the family keeps beyond megatron's per-parameter state (MD's gains): beside it
        extras = _hooks(optimizer, hooks).sharded_extras(optimizer, loading=is_loading, layer_wise=layer_wise)
        state.update(extras)
        state["optimizer_extras"] = sorted(extras)
    if with_rng:
        # One object per global rank; restored only when the world size is unchanged.
        state["rng_state"] = ShardedObject(
            "rng_state", _rng_state(), (dist.get_world_size(),), (dist.get_rank(),), replica_id=0
        )
    return state


def _publish(root: Path, final: Path, partial: Path, iteration: int, run_config_yaml: str,
             tokenizer_model: str | None, keep_last: int | None) -> None:
    """On every rank, once every rank's shards are written: the run config, the tokenizer files and the checksums
    beside the shards, then (rank 0) the rename to ``iter_``, the latest file and the pruning."""
    rank = dist.get_rank()
    maybe_delay_save(iteration)
    dist.barrier()
    if rank == 0:
        (partial / RUN_CONFIG).write_text(run_config_yaml)
        import yaml

        from megatron_md.training.data.tokenizer import save_tokenizer_files

        # which tokenizer files to keep: the run config's data section (SentencePiece, HF, GPT-2 BPE)
        data = (yaml.safe_load(run_config_yaml) or {}).get("data") or {}
        if data:
            save_tokenizer_files(data, partial)
        elif tokenizer_model:
            shutil.copy2(tokenizer_model, partial / "tokenizer.model")
    write_manifest(partial)  # collective: every rank hashes a share of the files, rank 0 writes checksums.json
    if rank == 0:
        if final.exists():  # keep, never overwrite, what was there
            final.rename(final.with_name(f"{final.name}.old-{int(time.time())}"))
        partial.rename(final)
        tmp = root / (LATEST + ".tmp")
        tmp.write_text(f"{iteration}\n")
        os.replace(tmp, root / LATEST)
        if keep_last:
            prune_checkpoints(root, keep_last)
    dist.barrier()


def save_checkpoint(
    root: str | Path,
    iteration: int,
    model,
    optimizer,
    scheduler,
    *,
    consumed_samples: int,
    run_config_yaml: str,
    tokenizer_model: str | None,
    extra: dict | None = None,
    layer_wise: bool = False,
    fully_reshardable: bool = False,
    async_save: bool = False,
    fully_parallel: bool = True,
    keep_last: int | None = None,
    hooks=None,
) -> Path:
    """Save atomically; returns the final ``iter_`` directory. ``hooks``: the optimizer family's run hooks (the
    state they keep is saved beside megatron's).

    ``async_save``: the shards are written by a forked process while training goes on; the checkpoint is
    published (checksums, rename, latest file, pruning) by ``finalize_saves`` on every rank once all
    ranks' writes are done. ``keep_last``: then delete all but the newest ``keep_last`` checkpoints.
    """
    root = Path(root)
    final = iter_dir(root, iteration)
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():  # left by a run killed mid-save: never a valid checkpoint
            shutil.rmtree(partial)
        partial.mkdir()
    dist.barrier()
    optim_sharding = FULLY_RESHARDABLE if fully_reshardable else DP_RESHARDABLE
    state = _sharded_state(
        model, optimizer, is_loading=False, with_optim=True, with_rng=True, layer_wise=layer_wise,
        optim_sharding=optim_sharding, hooks=hooks,
    )
    state.update(
        iteration=iteration,
        layout=current_layout(),
        optim_sharding=optim_sharding,
        optim_avoid_prefix=True,
        byte_sharded_optimizers=byte_sharded_optimizers(optimizer),
        consumed_samples=consumed_samples,
        scheduler=scheduler.state_dict(),
        world_size=dist.get_world_size(),
        extra=extra or {},
    )
    request = dist_checkpointing.save(
        state, str(partial), sharded_strategy=save_strategy(fully_parallel), async_sharded_save=async_save,
        async_strategy=async_strategy())

    publish = functools.partial(_publish, root, final, partial, iteration, run_config_yaml, tokenizer_model,
                                keep_last)
    if request is None:
        publish()
    else:  # megatron's queue runs publish() after the background write, in finalize_saves()
        request.add_finalize_fn(publish)
        async_queue().schedule_async_request(request)
    return final


_ASYNC_QUEUE = None


def async_queue():
    """megatron's queue of background checkpoint writes (a fork per save; CPU tensors are then the
    fork's copy-on-write snapshot, so training may update the weights while the child writes)."""
    global _ASYNC_QUEUE
    if _ASYNC_QUEUE is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        _ASYNC_QUEUE = AsyncCallsQueue()
    return _ASYNC_QUEUE


def finalize_saves(blocking: bool = False) -> int:
    """Publish the background saves that have finished (all of them, waiting, when ``blocking``); returns
    how many. A collective: call it on every rank, at the same points."""
    if _ASYNC_QUEUE is None or not _ASYNC_QUEUE.get_num_unfinalized_calls():
        return 0
    return len(_ASYNC_QUEUE.maybe_finalize_async_calls(blocking=blocking))


def async_strategy() -> str:
    """NVIDIA Resiliency Extension's writer when installed (megatron's default), else megatron-core's own."""
    from megatron.core.dist_checkpointing.strategies.nvrx import has_nvrx_async_support

    return "nvrx" if has_nvrx_async_support() else "mcore"


def save_strategy(fully_parallel: bool):
    """torch_dist; fully parallel spreads the writing of replicated tensors over the data-parallel ranks."""
    if not fully_parallel or ps.get_data_parallel_world_size(with_context_parallel=True) == 1:
        return None  # megatron's default strategy
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), ps.get_data_parallel_group(with_context_parallel=True))


def load_strategy(path: Path, fully_parallel: bool):
    if not fully_parallel or ps.get_data_parallel_world_size(with_context_parallel=True) == 1:
        return None
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(str(path)), ps.get_data_parallel_group(with_context_parallel=True))


def prune_checkpoints(root: str | Path, keep_last: int) -> list[Path]:
    """Delete published ``iter_`` checkpoints older than the newest ``keep_last`` (rank 0, after a publish).

    Only complete checkpoints are candidates (``.partial`` and ``.old-*`` directories are never touched),
    and never the one ``latest_checkpointed_iteration.txt`` names, whatever ``keep_last`` says.
    """
    root = Path(root)
    latest = latest_iteration(root)
    found = []
    for d in root.glob("iter_*"):
        suffix = d.name[len("iter_"):]
        if d.is_dir() and suffix.isdigit():
            found.append((int(suffix), d))
    found.sort()
    doomed = [d for it, d in found[:-keep_last] if it != latest] if keep_last >= 1 else []
    for d in doomed:
        shutil.rmtree(d)
    return doomed


def load_checkpoint(
    root: str | Path,
    model,
    optimizer=None,
    scheduler=None,
    *,
    load_optim: bool = True,
    load_rng: bool = True,
    iteration: int | None = None,
    layer_wise: bool = False,
    verify: bool = True,
    fully_parallel: bool = False,
    hooks=None,
) -> dict:
    """Load model (and optimizer, scheduler, RNG) in place; returns the common state. ``hooks``: the optimizer
    family's run hooks (required with an optimizer): they load their state, or make it from the loaded weights.

    ``verify`` (collective) first checks the files against their checksums.json, reading nothing else.
    """
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            raise FileNotFoundError(f"--load {root}: no {LATEST} found there")
    path = iter_dir(root, iteration)
    if not path.is_dir():
        raise FileNotFoundError(f"--load {root}: {path.name} is listed as latest but missing")
    if verify:
        verify_checkpoint(path)
    common = dist_checkpointing.load_common_state_dict(str(path))
    same_world = common.get("world_size") == dist.get_world_size()
    with_optim = load_optim and optimizer is not None
    if with_optim:
        check_optimizer_reshard(root, common, optimizer)
        prepare_for_load(optimizer)
    state = _sharded_state(
        model, optimizer, is_loading=True, with_optim=with_optim, with_rng=load_rng and same_world,
        layer_wise=layer_wise, optim_sharding=common.get("optim_sharding", DP_RESHARDABLE),
        avoid_prefix=common.get("optim_avoid_prefix", False),  # checkpoints from before it was recorded
        hooks=hooks,
    )
    hooks = _hooks(optimizer, hooks)
    extras = {k: state[k] for k in state.pop("optimizer_extras", [])}
    if with_optim and (why := hooks.missing_extras(root, common, extras)):
        raise CheckpointMismatch(why)
    loaded = dist_checkpointing.load(state, str(path), sharded_strategy=load_strategy(path, fully_parallel))
    unwrap(model).load_state_dict(loaded["model"])
    if with_optim:
        with torch.no_grad():  # fp32 distributed Adam's main params are views of the model's (leaf) params
            optimizer.load_state_dict(loaded["optimizer"])
        after_load(optimizer)
        multi_tensor.use_foreach(optimizer)  # the load replaced the param groups (and their foreach)
        hooks.load_extras(optimizer, loaded)
    elif optimizer is not None:
        # New weights in the model: refresh fp32 master copies, and the family's state from them (MD's gains
        # take the loaded norms where they can, so the loaded function is kept; the note says what moved).
        optimizer.reload_model_params()
        common["weights_note"] = hooks.from_weights(optimizer)
    if scheduler is not None and load_optim:
        scheduler.load_state_dict(common["scheduler"])
    if "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    common["path"] = str(path)
    common["rng_restored"] = "rng_state" in loaded
    return common


def read_run_config(ckpt_root: str | Path, iteration: int | None = None) -> tuple[str, Path]:
    """The run_config.yaml text stored beside a checkpoint, and that checkpoint's directory."""
    if iteration is None:
        iteration = latest_iteration(ckpt_root)
        if iteration is None:
            raise FileNotFoundError(f"--load {ckpt_root}: no {LATEST} there")
    path = iter_dir(ckpt_root, iteration)
    cfg = path / RUN_CONFIG
    if not cfg.exists():
        raise FileNotFoundError(f"--load {ckpt_root}: {cfg} is missing")
    return cfg.read_text(), path

