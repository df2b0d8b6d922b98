"""MuonMD / AdamMD inside megatron-core: registry entries and the TP/EP hooks (the config and group defaults:
``md_config.py``; the param groups and the AdamW routing: ``md_param_groups.py``).

``--optimizer muon_md`` / ``adam_md`` / ``lion_md`` / ``soap_md`` are registered in megatron-core's
emerging-optimizer registry, so they ride on its param groups, bf16 master weights, chained and layer-wise
distributed optimizers. Routing (docs/optimizers.md §1.8):

- hidden matrices (QKV split per Q/K/V block, proj, fc1, fc2, each expert's own matrices):
  MD with the base update (Muon, Adam, Lion or SOAP), flat sphere, row+col gains, ``--matrix-lr``
  (out-projections in their own group when ``embed`` or ``--md-out-proj-radius`` needs to tell them apart);
- MoE router: MD-Muon on the row sphere with Keller Jordan's scale (unit-norm rows);
- word embedding: row sphere, no gains, Adam, ``--embedding-lr``;
- LM head: row sphere, ``--md-output-gains``, Adam, ``--lr``;
- 1-D parameters (norms) and learned position embeddings: AdamW, ``--lr``.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

from megatron_md.mcore import compat, naming
from megatron_md.mcore.family_configs import gains_holding_norms
from megatron_md.mcore.md_config import MDOptimizerConfig, group_defaults, ns_settings, side_keys
from megatron_md.mcore.md_param_groups import routes_to_adamw
from megatron_md.optim import adam
from megatron_md.optim.bases import BASES
from megatron_md.optim.hyperparams import MDHyperParams
from megatron_md.optim.md_optimizer import MDOptimizer
from megatron_md.mcore.timing import timed
from megatron_md.parallel.orthogonalize import OrthogonalizationEngine, msign_kernel
from megatron_md.parallel.tp import ShardedReducer, duplicated_orthogonalizer

class MegatronMD(MDOptimizer):
    """MDOptimizer whose reductions and msign follow each parameter's TP (or expert-TP) shards.

    Under megatron's layer-wise distributed optimizer each DP rank keeps only the matrices it owns in
    ``param_groups`` (narrowed after construction), so state is made lazily: a rank holds MD state
    (momentum, gains, gain moments, duals) for its own matrices only.
    """

    lazy_state = True

    def __init__(self, params, config: MDOptimizerConfig, pg_collection=None):
        self.pg_collection = pg_collection
        self.ns = ns_settings(config)
        adam.set_compile(config.md.md_compile)
        self.ortho_engine = OrthogonalizationEngine(per_matrix=config.md.md_ns_per_matrix)
        self.timers = config.timers  # megatron-core's Timers of the run (mcore/timing.py), or None
        self.keep_loaded = config.md.md_loaded_weights == "keep"
        self.ortho_engine.timed = lambda name: timed(self.timers, name)
        self.per_matrix = config.md.md_per_matrix_step
        self._kernels: dict[tuple, object] = {}
        # a base with a section of its own takes the run's (the same typed object the flags filled)
        self._bases = {name: cls(config.base_options.get(cls.section_name)) if cls.section else cls()
                       for name, cls in BASES.items()}
        self._reducers: dict[int, ShardedReducer] = {}
        if config.md_base == "soap" and pg_collection is not None:
            sizes = [g.size() for g in (getattr(pg_collection, "tp", None), getattr(pg_collection, "expt_tp", None))
                     if g is not None]
            if max(sizes, default=1) > 1:
                raise ValueError("soap_md keeps Kronecker factors of whole matrices, so it does not run on "
                                 "tensor-parallel shards; use --tensor-model-parallel-size 1 (and "
                                 "--expert-tensor-parallel-size 1) or another MD base")
        super().__init__(params, group_defaults(config), self._bases[config.md_base])

    # -- hooks -----------------------------------------------------------------------------------
    def base_for(self, hp: MDHyperParams):
        return self._bases[hp.md_base or "muon"]

    def _group_of(self, p: torch.Tensor):
        if self.pg_collection is None:
            return None
        return self.pg_collection.expt_tp if getattr(p, "expert_tp", False) else self.pg_collection.tp

    def reducer_for(self, p: torch.Tensor) -> ShardedReducer:
        r = self._reducers.get(id(p))
        if r is None:
            dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            r = self._reducers[id(p)] = ShardedReducer(self._group_of(p), dim)
        return r

    def orthogonalizer_for(self, p: torch.Tensor, hp: MDHyperParams):
        r = self.reducer_for(p)
        return duplicated_orthogonalizer(r.group, r.dim, hp.ns_steps, hp.ns_coefficients, self.ns["dtype"],
                                         self.ns["matmul_precision"])

    def msign_kernel(self, hp: MDHyperParams):
        key = (hp.ns_steps, hp.ns_coefficients)
        if key not in self._kernels:
            self._kernels[key] = msign_kernel(hp.ns_steps, hp.ns_coefficients, self.ns["dtype"],
                                              self.ns["matmul_precision"])
        return self._kernels[key]

    # -- megatron's expectations -----------------------------------------------------------------
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        """Create state for every param (megatron calls this before a torch_dist load)."""
        hp = MDHyperParams.from_group(group)
        for p in group["params"]:
            if skip_non_grad_params and p.grad is None:
                continue
            if not self.state[p]:
                self._init_param(p, hp, project=False)

    @torch.no_grad()
    def reset_from_weights(self, recover: bool | None = None) -> dict[str, float]:
        """Fresh state for weights loaded without it (a pretrained or imported checkpoint, --no-load-optim).

        ``recover`` (default ``--md-loaded-weights keep``): the loaded weights stay the model's and their norms
        go into the gains (``preserve_init``'s rule), so the first step starts from the loaded function exactly.
        Groups whose gains cannot hold the norms (no gains, low-rank gains, the orthogonal sphere kind, per-head
        column spheres), and every group without ``recover``, are projected on their spheres with gains 1.
        Returns, per group role, the largest relative change ``|W - P(W)| / |W|`` of a matrix on this rank
        (0 where kept).
        """
        moved: dict[str, float] = {}
        recover = self.keep_loaded if recover is None else recover
        for group in self.md_groups():
            hp = MDHyperParams.from_group(group)
            keep = recover and _can_recover(hp)
            if keep:
                hp = dataclasses.replace(hp, preserve_init=True)
            for p in group["params"]:
                before = None if keep else p.detach().clone()
                self.state[p].clear()
                try:
                    self._init_param(p, hp, project=True)
                except ValueError:  # a fused QKV whose per-block column norms one gain cannot hold
                    self.state[p].clear()
                    before = p.detach().clone()
                    self._init_param(p, dataclasses.replace(hp, preserve_init=False), project=True)
                role = str(group.get("md_role", "matrices"))
                change = 0.0 if before is None else relative_change(before, p)
                moved[role] = max(moved.get(role, 0.0), change)
        return moved

    def phase(self, name: str):
        return timed(self.timers, name)

    def prepare_group(self, group: dict) -> None:
        # Gains follow the matrix group's schedule coefficient (docs/optimizers.md §1.7).
        max_lr = group.get("max_lr") or 0.0
        group["gains_lr"] = group["gains_max_lr"] * (group["lr"] / max_lr if max_lr > 0 else 1.0)

    def orthogonalize_all(self, requests: list[tuple]) -> list[list[torch.Tensor]]:
        """All blocks in one engine run (one owner per matrix in its TP group, batched by shape), or every TP
        rank on every gathered block with ``--muon-tp-mode duplicated``."""
        if self.ns["tp_mode"] == "duplicated":
            return super().orthogonalize_all(requests)
        tickets = []
        for p, hp, blocks in requests:
            r, kernel = self.reducer_for(p), self.msign_kernel(hp)
            tickets.append([self.ortho_engine.submit([U], r.group, r.dim, kernel) for U, _ in blocks])
        self.ortho_engine.run()
        return [[t.out_sharded[0] for t in ts] for ts in tickets]

    def drop_unowned_state(self) -> None:
        """Forget state of matrices no longer in ``param_groups`` (another DP rank owns them)."""
        owned = {id(p) for g in self.param_groups for p in g["params"]}
        for p in [p for p in self.state if id(p) not in owned]:
            del self.state[p]
            self._blocks.pop(p, None)

    def state_dict(self):
        # megatron checkpoints optimizer state that has its parameter's shape; the gain vectors
        # travel separately (mcore/md_checkpoint.py).
        self.drop_unowned_state()
        sd, side = super().state_dict(), side_keys()
        sd["state"] = {i: {k: v for k, v in s.items() if k not in side} for i, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict):
        side = side_keys()
        kept = {p: {k: v for k, v in s.items() if k in side} for p, s in self.state.items()}
        super().load_state_dict(state_dict)
        for p, gains in kept.items():
            self.state[p].update(gains)
        # megatron hands every parameter the optimizer's common Adam step on load; only a base with a step
        # (Adam, SOAP) keeps one (else it would be saved, and the checkpoint's keys would change across a resume).
        for group in self.param_groups:
            if not self.base_for(MDHyperParams.from_group(group)).has_step:
                for p in group["params"]:
                    self.state.get(p, {}).pop("step", None)


def refuse_packed_experts(model_chunks, optimizer: str) -> None:
    """MD keeps state per expert matrix: refuse a layout that packs a layer's experts into one parameter
    (megatron's legacy GroupedMLP, TE's single grouped weight), before training starts."""
    packed = naming.packed_experts(n for chunk in model_chunks or () for n, _ in chunk.named_parameters())
    if packed:
        raise ValueError(naming.packed_experts_error(optimizer, packed))


def _config_to_kwargs(config, model_chunks, pg_collection):
    refuse_packed_experts(model_chunks, f"{config.md_base}_md")
    return {"config": config, "pg_collection": pg_collection}


def register(name: str, config: MDOptimizerConfig | None = None) -> None:
    """Add the MD optimizer the run builds (its ``--optimizer`` name) to megatron-core's optimizer registry
    (idempotent). Only what is built is registered: the family that names it calls this."""
    config = config or MDOptimizerConfig()
    routed = ParamKey(predicate=ParamPredicate(name="md_adamw", fn=routes_to_adamw(config)))
    compat.register_optimizer(name, MegatronMD, _config_to_kwargs, {routed: {"optimizer": "adam"}})


def _can_recover(hp: MDHyperParams) -> bool:
    """Whether the group's gains can hold a loaded matrix's norms (``preserve_init``'s conditions)."""
    if hp.sphere_kind == "orthogonal":
        return False
    return hp.gains_mode in gains_holding_norms(hp.sphere_mode)


def relative_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """``|after - before| / |before|`` (Frobenius, this rank's shard)."""
    den = before.float().norm()
    return float((after.float() - before.float()).norm() / den) if den > 0 else 0.0
