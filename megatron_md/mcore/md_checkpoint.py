"""MD gain state in torch_dist checkpoints, reshardable across TP, PP, EP and DP sizes.

megatron-core checkpoints optimizer state only when it has its parameter's shape; MD's gain
vectors (and their Adam moments) do not. They are saved here as their own ShardedTensors,
keyed by each matrix's canonical name (global layer and expert index), so any layout can load
them: ``md/<name>/row`` is ``[3, M]`` (ρ, Adam m, Adam v), ``md/<name>/col`` is ``[3, N]``,
sharded along the matrix's TP axis; a flat gain is ``md/<name>/flat``, ``[3, 1]``. SwiGLU fc1 rows are
stored as ``[3, 2, M/2]`` (gate, up) so the layout does not depend on how TP interleaves the two halves.
Whole-matrix side state (Manifold Muon's duals, SOAP's Kronecker factors and eigenbases) is saved
replicated across TP.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_md.mcore.md_locate import md_optimizers, md_wrappers, sync_model_params
from megatron_md.mcore.md_config import GAIN_KEYS
from megatron_md.optim.gains import LOWRANK_AXES
from megatron_md.optim.bases import BASES

DUAL_KEYS = ("dual", "dual_q", "dual_k", "dual_v")
# whole-matrix state kept by every TP rank alike, and its checkpoint prefix
# low-rank gain factors are saved whole too (lowrank gains are refused on TP shards, so every TP rank holds them)
LOWRANK_KEYS = tuple(f"{k}_{a}" for a in LOWRANK_AXES for k in ("rho", "exp_avg", "exp_avg_sq"))


def full_keys() -> dict[str, str]:
    """Whole-matrix state entries and their checkpoint prefix: Manifold Muon's duals, every base's side state
    (SOAP's Kronecker factors; read when called, so a plugin's base counts), low-rank gain factors."""
    side = tuple(k for b in BASES.values() for k in b.side_state)
    return {**{k: "mm" for k in DUAL_KEYS}, **{k: "md" for k in side}, **{k: "md" for k in LOWRANK_KEYS}}


def _tp(p):
    if getattr(p, "expert_tp", False):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _dp_rank(p) -> int:
    if getattr(p, "expert_tp", False):
        return ps.get_expert_data_parallel_rank()
    return ps.get_data_parallel_rank(with_context_parallel=True)


def _axis_tensor(p, state, axis: str, layer_wise: bool, loading: bool) -> ShardedTensor:
    data = torch.stack([state[f"rho_{axis}"], state[f"exp_avg_{axis}"], state[f"exp_avg_sq_{axis}"]])
    if loading:
        data = torch.empty_like(data)
    tp_rank, tp_size = _tp(p)
    sharded = (axis != "flat" and getattr(p, "tensor_model_parallel", False)
               and p.partition_dim == (0 if axis == "row" else 1))
    dp = 0 if layer_wise else _dp_rank(p)
    key = f"md/{p.md_key}/{axis}"
    split_axis = 1
    if axis == "row" and p.md_swiglu:  # (gate, up) halves: same layout at every TP size
        data, split_axis = data.view(3, 2, -1), 2
    if not sharded or tp_size == 1:
        return ShardedTensor.from_rank_offsets(key, data, replica_id=(tp_rank, dp))
    return ShardedTensor.from_rank_offsets(key, data, (split_axis, tp_rank, tp_size), replica_id=(0, dp))


def md_sharded_state(optimizer, *, loading: bool = False, layer_wise: bool = False) -> dict:
    """ShardedTensors holding every local MD gain state (empty buffers when ``loading``)."""
    out, full = {}, full_keys()
    for opt in md_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p) or {}
                key = getattr(p, "md_key", None)
                if key is None:
                    continue
                for name, prefix in full.items():  # Manifold Muon's duals, SOAP's factors: TP-replicated
                    if name in state:
                        tp_rank, _ = _tp(p)
                        t = state[name]
                        out[f"{key}/{name}"] = ShardedTensor.from_rank_offsets(
                            f"{prefix}/{key}/{name}", torch.empty_like(t) if loading else t,
                            replica_id=(tp_rank, 0 if layer_wise else _dp_rank(p)),
                        )
                if "gain_step" not in state:
                    continue
                for axis in ("row", "col", "flat"):
                    if f"rho_{axis}" in state:
                        out[f"{key}/{axis}"] = _axis_tensor(p, state, axis, layer_wise, loading)
                tp_rank, _ = _tp(p)
                # Step counters: the gains' Adam step, and an Adam base's own step, which megatron's
                # common-step mechanism does not carry for a layer-wise optimizer's ranks.
                for name, sub in (("gain_step", "step"), ("step", "base_step")):
                    if name in state:
                        step = state[name].reshape(1).float()
                        out[f"{key}/{sub}"] = ShardedTensor.from_rank_offsets(
                            f"md/{key}/{sub}", torch.empty_like(step) if loading else step,
                            replica_id=(tp_rank, 0 if layer_wise else _dp_rank(p)),
                        )
    return out


def load_md_state(optimizer, loaded: dict) -> int:
    """Copy loaded gain state into the optimizers; returns how many matrices were restored."""
    restored, full = 0, full_keys()
    for opt in md_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                key = getattr(p, "md_key", None)
                state = opt.state.get(p)
                if key is None or not state:
                    continue
                for name in full:
                    if f"{key}/{name}" in loaded and name in state:
                        state[name].copy_(loaded[f"{key}/{name}"])
                if f"{key}/step" not in loaded:
                    continue
                for axis in ("row", "col", "flat"):
                    if f"{key}/{axis}" in loaded:
                        data = loaded[f"{key}/{axis}"].reshape(3, -1)
                        for i, name in enumerate(("rho", "exp_avg", "exp_avg_sq")):
                            state[f"{name}_{axis}"].copy_(data[i])
                state["gain_step"].copy_(loaded[f"{key}/step"].reshape(()))
                if f"{key}/base_step" in loaded:
                    state["step"] = loaded[f"{key}/base_step"].reshape(()).clone()
                restored += 1
    return restored


def reset_md_from_weights(optimizer, recover: bool | None = None) -> str | None:
    """After loading bare weights (``--pretrained-checkpoint``, ``--no-load-optim``: no MD state comes along),
    fresh MD state from them. ``recover`` (default: each optimizer's ``--md-loaded-weights``): the gains take
    the loaded norms wherever they can hold them, so the loaded function is kept; the rest is projected.
    Returns a line for the log saying, per group role, the largest relative change of a matrix over all ranks
    (None without MD)."""
    moved: dict[str, float] = {}
    wrappers = md_wrappers(optimizer)
    for _, inner in wrappers:
        for role, change in inner.reset_from_weights(recover).items():
            moved[role] = max(moved.get(role, 0.0), change)
    sync_model_params(optimizer)
    if not wrappers:
        return None
    roles = sorted(moved)
    if torch.distributed.is_initialized():  # every rank holds the same role names (the same model)
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, moved)
        roles = sorted({r for d in every for r in d})
        moved = {r: max(d.get(r, 0.0) for d in every) for r in roles}
    kept = [r for r in roles if moved[r] == 0.0]
    changed = [f"{r} {moved[r]:.3g}" for r in roles if moved[r] > 0.0]
    return ("loaded weights: " + (f"kept exactly, norms in the gains ({', '.join(kept)})" if kept else "")
            + ("; " if kept and changed else "")
            + (f"projected, largest relative change |W - P(W)|/|W|: {', '.join(changed)}" if changed else "")
            + (f" (gains keep a group's norms: {', '.join(_KEEP[r] for r in roles if moved[r] > 0.0 and r in _KEEP)})"
               if any(moved[r] > 0.0 and r in _KEEP for r in roles) else ""))


# The flag that gives a group gains able to hold its loaded norms (the manifold groups have none to give).
_KEEP = {"embedding": "--md-embedding-gains row", "output": "--md-output-gains row", "hidden": "--md-gains rowcol",
         "router": "--md-gains rowcol"}


__all__ = ["md_sharded_state", "load_md_state", "reset_md_from_weights", "GAIN_KEYS"]
