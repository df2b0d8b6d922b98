"""MuonMD / AdamMD inside megatron-core: registry entries, parameter routing, TP/EP hooks.

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
from dataclasses import dataclass, field
from typing import Optional

import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

from megatron_md.mcore import compat, naming
from megatron_md.mcore.family_configs import AdEMAMixConfig, LionConfig, MDConfig, SoapConfig, gains_holding_norms
from megatron_md.optim import adam
from megatron_md.optim.bases import BASES
from megatron_md.optim.gains import GAIN_AXES, LOWRANK_AXES
from megatron_md.optim.md import MDHyperParams
from megatron_md.optim.muon_md import MDOptimizer
from megatron_md.mcore.timing import timed
from megatron_md.parallel.orthogonalize import OrthogonalizationEngine, msign_kernel
from megatron_md.parallel.tp import ShardedReducer, duplicated_orthogonalizer

GAIN_KEYS = (*(f"{k}_{a}" for a in GAIN_AXES + LOWRANK_AXES for k in ("rho", "exp_avg", "exp_avg_sq")), "gain_step")
# state that does not have its parameter's shape: megatron's checkpoint cannot hold it (md_checkpoint.py does)
SIDE_KEYS = GAIN_KEYS + tuple(k for b in BASES.values() for k in b.side_state)



@dataclass
class MDOptimizerConfig(OptimizerConfig):
    """megatron-core's OptimizerConfig plus MD's typed sections, handed on whole (flags: mcore/family_configs.py)."""

    md_base: str = "muon"  # the family's base update of hidden matrices
    md_num_layers: int = 1  # for the 1/sqrt(2L) out-projection radius
    md: MDConfig = field(default_factory=MDConfig)
    lion: LionConfig = field(default_factory=LionConfig)
    soap: SoapConfig = field(default_factory=SoapConfig)
    ademamix: AdEMAMixConfig = field(default_factory=AdEMAMixConfig)


NS_TP_MODES = ("layer_sharded", "duplicated")


def ns_settings(config: OptimizerConfig) -> dict:
    """Newton-Schulz options of MD and Manifold Muon from megatron's Muon flags.

    ``muon_fp32_matmul_prec`` (already resolved from ``auto``): "medium" runs NS in bf16 (megatron's Muon on
    GPUs), "high" in fp32 with TF32 matmuls, "highest" in plain fp32. ``muon_tp_mode``: "layer_sharded"
    (one owner per matrix, the engine) or "duplicated" (every TP rank runs every NS); megatron's other modes
    change the update with the TP size and are refused.
    """
    prec = config.muon_fp32_matmul_prec
    if prec not in ("medium", "high", "highest"):
        raise ValueError(f"--muon-fp32-matmul-prec {prec!r}: MD and Manifold Muon take medium, high or highest")
    if config.muon_tp_mode not in NS_TP_MODES:
        raise ValueError(
            f"--muon-tp-mode {config.muon_tp_mode!r} is megatron Muon's; MD and Manifold Muon orthogonalise "
            f"whole matrices: use one of {NS_TP_MODES} (layer_sharded: one owner per matrix, the default)"
        )
    return {"dtype": torch.bfloat16 if prec == "medium" else torch.float32,
            "matmul_precision": "high" if prec == "high" else None,
            "tp_mode": config.muon_tp_mode}


def group_defaults(config: MDOptimizerConfig) -> dict:
    """MDHyperParams of every MD group from the run's typed sections (groups override per role)."""
    md, a, betas = config.md, config.ademamix, (config.adam_beta1, config.adam_beta2)
    gains_betas = (betas[0] if md.md_gains_beta1 is None else md.md_gains_beta1,
                   betas[1] if md.md_gains_beta2 is None else md.md_gains_beta2)
    return dict(
        lr=config.lr, gains_lr=md.gains_lr, gains_max_lr=md.gains_lr,
        momentum=config.muon_momentum, nesterov=config.muon_nesterov,
        ns_steps=config.muon_num_ns_steps, ns_coefficients=md.md_ns_coefficients,
        scale_mode=md.md_scale_mode, sphere=md.md_sphere, gains=md.md_gains,
        gain_param=md.md_gain_param, weight_decay=config.weight_decay,
        gains_betas=gains_betas, gains_eps=config.adam_eps if md.md_gains_eps is None else md.md_gains_eps,
        gains_weight_decay=md.md_gains_weight_decay, gains_bias_correction=md.md_gains_bias_correction,
        gains_min=md.md_gains_min, gains_no_clamp=md.md_gains_no_clamp, gains_rank=md.md_gains_rank,
        gains_lowrank_init_std=md.md_gains_lowrank_init_std, gains_lowrank_min=md.md_gains_lowrank_min,
        gains_lowrank_seed=md.md_gains_lowrank_seed, sphere_iters=md.md_sphere_iters, ball=md.md_ball,
        betas=betas, eps=config.adam_eps,
        md_base=config.md_base, lion_betas=(config.lion.lion_beta1, config.lion.lion_beta2),
        soap_shampoo_beta=config.soap.soap_shampoo_beta, tangent_grad=md.md_tangent_grad,
        normalize_update=md.md_normalize_update,
        ademamix_beta3=a.ademamix_beta3, ademamix_alpha=a.ademamix_alpha,
        ademamix_beta3_warmup=a.ademamix_beta3_warmup, ademamix_alpha_warmup=a.ademamix_alpha_warmup,
    )


def hidden_only(config: MDOptimizerConfig) -> dict:
    """Options of hidden matrices only (the router, embedding and head keep their row spheres, whole)."""
    md = config.md
    return {"sphere_kind": md.md_sphere_kind, "split_heads": md.md_split_heads,
            "split_heads_update": md.md_split_heads_update, "split_qkv_gains": md.md_split_qkv_gains}


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
        self._bases = {name: cls() for name, cls in BASES.items()}
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
        sd = super().state_dict()
        sd["state"] = {i: {k: v for k, v in s.items() if k not in SIDE_KEYS} for i, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict):
        kept = {p: {k: v for k, v in s.items() if k in SIDE_KEYS} for p, s in self.state.items()}
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


def routes_to_adamw(config: MDOptimizerConfig):
    """Which params MD leaves to AdamW: 1-D ones, learned positions, unconstrained embedding/head."""
    plain = ["position_embeddings.weight"]
    if config.md.md_embedding_sphere == "none":
        plain.append("word_embeddings.weight")
    if config.md.md_output_sphere == "none":
        plain.append("output_layer.weight")

    def routed(p: torch.Tensor) -> bool:
        key = getattr(p, "md_key", None) or ""
        return p.ndim != 2 or any(key.endswith(s) for s in plain)

    return routed


def register(name: str, config: MDOptimizerConfig | None = None) -> None:
    """Add the MD optimizer the run builds (its ``--optimizer`` name) to megatron-core's optimizer registry
    (idempotent). Only what is built is registered: the family that names it calls this."""
    config = config or MDOptimizerConfig()
    routed = ParamKey(predicate=ParamPredicate(name="md_adamw", fn=routes_to_adamw(config)))
    compat.register_optimizer(name, MegatronMD, _config_to_kwargs, {routed: {"optimizer": "adam"}})


def md_param_overrides(config: MDOptimizerConfig) -> dict:
    """Per-module MD groups: sphere, gains, base update and LR band (merged with megatron's)."""
    lr, min_ratio = config.lr, (config.min_lr / config.lr if config.lr else 0.0)
    md = config.md

    def band(max_lr: float, role: str = "") -> dict:
        # megatron matches saved and current param groups on load by a fixed tuple of keys that
        # does not include ours (sphere, gains, base); without a distinguishing entry the
        # embedding and LM-head groups collide. ``is_decoupled_lr`` is in that tuple and unused
        # by megatron-core's scheduler, so it carries the MD role.
        tag = {"is_decoupled_lr": f"md:{role}"} if role else {}
        floor = config.min_lr if md.min_lr_mode == "absolute" else max_lr * min_ratio
        return {"max_lr": max_lr, "min_lr": floor, **tag}

    matrix_lr = config.md.matrix_lr if config.md.matrix_lr is not None else lr
    embedding_lr = config.md.embedding_lr if config.md.embedding_lr is not None else lr
    output_lr = md.output_lr if md.output_lr is not None else lr
    # out-projections get their own group when something differs for them: the 1/sqrt(2L) radius, or "embed"
    out_proj = config.md.md_out_proj_radius or "embed" in (config.md.md_sphere, config.md.md_gains)
    hidden = ParamKey(predicate=ParamPredicate(
        name=f"md_hidden{'_no_out' if out_proj else ''}", fn=lambda p: _is_hidden_matrix(p) and not (out_proj and _is_out_proj(p))
    ))
    keep = {"preserve_init": True} if config.md.md_preserve_init else {}  # hidden matrices only: they have gains
    keep.update(hidden_only(config))
    router = ParamKey(name="*router.weight")
    embedding = ParamKey(name="*word_embeddings.weight")
    output = ParamKey(name="*output_layer.weight")
    out = {
        hidden: {**band(matrix_lr, "hidden"), "md_role": "hidden", **keep},
        router: {**band(matrix_lr, "router"), "md_role": "router", "sphere": config.md.md_router_sphere,
                 "scale_mode": "shape_scaling", "md_base": md.md_router_base},
    }
    if out_proj:
        # Paper option: out-projections live on a sphere of radius sqrt(max(m,n))/sqrt(2L) and
        # their Muon update shrinks by the same factor (docs/optimizers.md §1.2).
        key = ParamKey(predicate=ParamPredicate(name="md_out_proj", fn=lambda p: _is_hidden_matrix(p) and _is_out_proj(p)))
        radius = {"radius_scale": 1.0 / (2 * config.md_num_layers) ** 0.5} if config.md.md_out_proj_radius else {}
        out[key] = {**band(matrix_lr, "out_proj"), "md_role": "hidden", "out_proj": True, **radius, **keep}
    if config.md.md_embedding_sphere != "none":
        out[embedding] = {**band(embedding_lr, "embedding"), "md_role": "embedding", "sphere": config.md.md_embedding_sphere,
                          "gains": md.md_embedding_gains, "md_base": md.md_embeddings_base}
    else:
        out[embedding] = band(embedding_lr)
    if config.md.md_output_sphere != "none":
        out[output] = {**band(output_lr, "output"), "md_role": "output", "sphere": config.md.md_output_sphere,
                       "gains": config.md.md_output_gains, "md_base": md.md_embeddings_base}
    elif md.output_lr is not None:  # the LM head under plain AdamW, in a band of its own
        out[output] = band(output_lr)
    return out


def _is_hidden_matrix(p: torch.Tensor) -> bool:
    key = getattr(p, "md_key", None) or ""
    return p.ndim == 2 and "decoder.layers." in key and not key.endswith("router.weight")


def _is_out_proj(p: torch.Tensor) -> bool:
    key = getattr(p, "md_key", None) or ""
    return key.endswith("linear_proj.weight") or key.endswith("linear_fc2.weight")


def _can_recover(hp: MDHyperParams) -> bool:
    """Whether the group's gains can hold a loaded matrix's norms (``preserve_init``'s conditions)."""
    if hp.sphere_kind == "orthogonal":
        return False
    return hp.gains_mode in gains_holding_norms(hp.sphere_mode)


def relative_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """``|after - before| / |before|`` (Frobenius, this rank's shard)."""
    den = before.float().norm()
    return float((after.float() - before.float()).norm() / den) if den > 0 else 0.0
