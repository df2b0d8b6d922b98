"""Optimizer families: everything the trainer needs to know about an ``--optimizer``, in one place.

The trainer, the build, validation, checkpointing, the coordinate check and the planner ask the family of
the run's ``--optimizer`` (``family_of(cfg)``); none of them names an optimizer. A family owns:

- its names and one-line descriptions (the ``--optimizer`` choices and their ``--help``);
- its recipe (defaults applied unless the user set them, e.g. MD's no weight decay, no warmup);
- validation: refusals of flags that do not apply or combinations that cannot hold;
- building the megatron optimizer: the config class, registry entry, param-group overrides and the
  layer-wise routing (which matrices it steps whole, sharded over DP by megatron's layer-wise optimizer);
- what happens after the weights are built or loaded (weights kept on spheres/manifolds are synced to the
  model), and the run hooks (``run_hooks.py``: state saved beside megatron's, fresh state from loaded weights,
  the log's matrix LR and gains, geometry-policy log lines, auto-switches and their checkpointed state);
- how the planner counts each role's optimizer state and Newton-Schulz work.

Importing this module imports neither megatron-core nor torch: ``--help`` and ``megatron-md plan`` stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megatron_md.mcore.run_hooks import MDHooks, PolicyHooks, RunHooks


@dataclass(frozen=True)
class Assignment:
    """How a family steps one matrix role (for the planner): ``kind`` is "base" (a plain base update),
    "md" (gains x direction with ``base``) or "manifold" (Manifold Muon's step with duals)."""

    kind: str
    base: str  # adam, muon, lion, soap
    gains: str = "none"


@dataclass(frozen=True)
class SweepRecipe:
    """How ``megatron-md lr-sweep`` sweeps one ``--optimizer``: the swept LR's field, the default centre k of
    ``--lrs N`` on the ladder ``1e-3 * 2^(k/2)``, the warmup (a fraction of the steps), the weight decay, and
    settings applied where the base config leaves them unset."""

    lr_field: str
    k_center: int
    warmup_frac: float
    weight_decay: float
    fixed: dict


# The settings the baseline records were measured with (cosine decay, beta2 0.95), where the defaults are now
# Megatron-LM's (linear decay, beta2 0.999).
_BASELINE = {"lr_decay_style": "cosine", "adam_beta2": 0.95}
# MD's other LRs in a sweep (the matrix LR is swept).
_MD_FIXED = {"lr": 1e-3, "embedding_lr": 3e-3}


class OptimizerFamily:
    names: dict[str, str] = {}  # --optimizer name -> one-line description
    steps_matrices = True  # steps whole matrices: layer-wise distributed optimizer, not byte-sharded Adam
    keeps_weights_on_manifolds = False  # the optimizer moves weights at build/load: sync them to the model
    holds_md_groups = False  # may hold MD groups (the --md-* options apply)
    takes_decoupled_lr = False  # megatron-core's --decoupled-lr reaches its param groups
    # the Megatron-LM --optimizer whose saved state this family's optimizer loads (None: none is read)
    reads_megatron_lm_state: Optional[str] = None
    default_ns_tp_mode = "layer_sharded"
    recipe: dict = {}

    def recipe_for(self, geometry: str) -> dict:
        """The defaults this family applies unless set explicitly (``geometry``: the run's --geometry)."""
        return self.recipe

    def sweep_recipe(self, name: str) -> SweepRecipe:
        """How an LR sweep treats ``--optimizer name`` (sweep/grid.py's ladder and centres)."""
        raise NotImplementedError(f"{type(self).__name__} gives no sweep recipe for {name}")

    def validate(self, cfg, need: Callable[[bool, str], None]) -> None:
        name = cfg.optimizer.optimizer
        o = cfg.optimizer
        if o.qk_clip and self.holds_md_groups and not cfg.model.qk_layernorm:
            need(o.md.md_gains in ("rowcol", "row", "embed"),
                 f"--qk-clip without --qk-layernorm scales MD's row gains of the query and key rows, and --md-gains "
                 f"{o.md.md_gains} has none: use --md-gains rowcol or row, or drop --qk-clip")
        if not self.holds_md_groups:
            for flag in ("md_preserve_init", "md_tangent_grad", "md_normalize_update"):
                need(not getattr(o.md, flag), f"--{flag.replace('_', '-')} is an MD option; it needs --optimizer "
                     f"{', '.join(MDFamily.names)} (or manifold_muon with MD groups), not {name}")

    def routing(self, cfg) -> Callable:
        """``p -> bool``: whether the matrix (layer-wise) optimizer steps ``p``."""
        from megatron.core.optimizer.layer_wise_optimizer import is_managed_by_layer_wise_optimizer

        return is_managed_by_layer_wise_optimizer

    def build(self, cfg, common: dict, ddp_model):
        """megatron's optimizer for ``common`` (OptimizerConfig fields the trainer resolved) and the run hooks."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        return get_megatron_optimizer(OptimizerConfig(**common), [ddp_model]), RunHooks()

    def after_build(self, optimizer) -> None:
        """After the optimizer is built (and before the first forward): weights it projected reach the model."""
        if self.keeps_weights_on_manifolds:
            from megatron_md.mcore.md_locate import sync_model_params

            sync_model_params(optimizer)

    def assign(self, cfg, role: str) -> Assignment:
        """How this family steps a matrix of ``role`` (attention.qkv, mlp.fc1, experts.fc2, router,
        embedding, head, ...); 1-D parameters and positions are always AdamW."""
        return Assignment("base", "adam")

    def ns_work(self, cfg, role: str) -> Optional[tuple[int, int, bool]]:
        """Newton-Schulz work on ``role`` per step: (msign calls, NS steps per call, fused QKV), or None."""
        return None


class AdamFamily(OptimizerFamily):
    names = {"adam": "megatron-core's AdamW on every parameter (byte-sharded under --use-distributed-optimizer)"}
    steps_matrices = False
    takes_decoupled_lr = True
    reads_megatron_lm_state = "adam"  # megatron-core's Adam on both sides: the same sharded state
    default_ns_tp_mode = "duplicated"  # unused by Adam; a value megatron's OptimizerConfig knows

    def sweep_recipe(self, name: str) -> SweepRecipe:
        # measured at CPU scale (tiny-dense family, d 64-256): 3e-3..1e-2, k 5 (5.66e-3); warmup and decay as AdamW
        return SweepRecipe("lr", 5, 0.1, 0.1, _BASELINE)


class MuonFamily(OptimizerFamily):
    names = {"muon": "megatron-core's Muon on hidden matrices, AdamW on the rest"}
    default_ns_tp_mode = "duplicated"  # megatron Muon's TP-size-independent mode

    def sweep_recipe(self, name: str) -> SweepRecipe:
        # measured at CPU scale: ~0.02, k 9 (2.26e-2); the records' momentum 0.95 with Nesterov
        return SweepRecipe("lr", 9, 0.1, 0.1, {**_BASELINE, "muon_momentum": 0.95, "muon_nesterov": True})

    def validate(self, cfg, need) -> None:
        super().validate(cfg, need)
        need(cfg.optimizer.muon.muon_tp_mode != "layer_sharded",
             "--muon-tp-mode layer_sharded is MD's and Manifold Muon's engine; megatron-core 0.19's muon takes "
             "duplicated, distributed or blockwise")

    def assign(self, cfg, role: str) -> Assignment:
        return Assignment("base", "adam" if role in ("embedding", "head") else "muon")

    def ns_work(self, cfg, role: str):
        if role in ("embedding", "head"):
            return None
        return 1, cfg.optimizer.muon.muon_num_ns_steps, True  # megatron's Muon: the fused QKV matrix


class _EngineFamily(OptimizerFamily):
    """Families on our orthogonalisation engine (MD, Manifold Muon): shared flags and refusals."""

    keeps_weights_on_manifolds = True
    holds_md_groups = True
    sections = ("md", "lion", "soap", "ademamix")  # OptimConfig sections the megatron config carries (family_configs.py)
    base_sections: tuple[str, ...] = ()  # sections of registered bases (plugins): handed on in base_options

    def validate(self, cfg, need) -> None:
        super().validate(cfg, need)
        o, name = cfg.optimizer, cfg.optimizer.optimizer
        need(o.muon.muon_scale_mode == "spectral",
             f"--muon-scale-mode is megatron Muon's; {name} scales its update with --md-scale-mode")
        need(o.muon.muon_extra_scale_factor == 1.0,
             f"--muon-extra-scale-factor is megatron Muon's; {name} has no extra update scale (its LR sets "
             "the step: --matrix-lr)")
        if o.md.md_preserve_init:
            from megatron_md.mcore.family_configs import gains_holding_norms

            holds = gains_holding_norms(o.md.md_sphere)
            need(o.md.md_gains in holds, f"--md-preserve-init keeps the initial norms in the gains, and on the "
                 f"{o.md.md_sphere} sphere that needs --md-gains {' or '.join(holds)} (got {o.md.md_gains})")
        md, p = o.md, cfg.parallel
        # (found by the walk over option pairs: both passed here and then failed at build, on every rank)
        need(not md.md_split_qkv_gains or md.md_gains in ("rowcol", "col"),
             f"--md-split-qkv-gains gives each Q/K/V block its own column gains, so it needs column gains: "
             f"--md-gains rowcol or col (got {md.md_gains})")
        sinkhorn = md.md_sphere in ("rowcol", "invrowcol", "equi")
        need(not md.md_tangent_grad or (md.md_sphere_kind == "l2" and not sinkhorn),
             f"--md-tangent-grad removes the radial part on the l2 flat, row and column spheres only; --md-sphere "
             f"{md.md_sphere} with --md-sphere-kind {md.md_sphere_kind} has no tangent projection")
        tp = max(p.tensor_model_parallel_size, p.expert_tensor_parallel_size or p.tensor_model_parallel_size)
        need(md.md_sphere_kind == "l2" or md.md_sphere == "flat",
             f"--md-sphere-kind {md.md_sphere_kind} fixes a norm of the whole matrix: it needs --md-sphere flat "
             f"(got {md.md_sphere})")
        need(md.md_sphere_kind != "orthogonal" or tp == 1,
             "--md-sphere-kind orthogonal takes the polar factor of whole matrices, which tensor-parallel shards are "
             f"not (TP {tp}); use --tensor-model-parallel-size 1 (and --expert-tensor-parallel-size 1) or another kind")
        need(md.md_gains != "lowrank" or tp == 1,
             f"--md-gains lowrank keeps factors of whole matrices and does not run on tensor-parallel shards (TP {tp}); "
             "use --tensor-model-parallel-size 1 (and --expert-tensor-parallel-size 1) or other gains")
        need(not md.md_split_heads_update or p.tensor_model_parallel_size == 1,
             "--md-split-heads-update orthogonalises each head on the rank that holds it, which the Newton-Schulz "
             "engine does not do across tensor-parallel ranks yet; use --tensor-model-parallel-size 1")

    def _tp_mode_check(self, cfg, need) -> None:
        o = cfg.optimizer
        need(o.muon.muon_tp_mode in ("auto", "layer_sharded", "duplicated"),
             f"--muon-tp-mode {o.muon.muon_tp_mode} is megatron Muon's; {o.optimizer} orthogonalises whole matrices: "
             "use layer_sharded (default) or duplicated")

    def routing(self, cfg) -> Callable:
        to_adamw = self._routes_to_adamw(cfg)
        return lambda p: not to_adamw(p)

    def _routes_to_adamw(self, cfg) -> Callable:
        raise NotImplementedError

    def _sections(self, cfg) -> dict:
        """The family's typed config sections, handed on whole (the run's MD section becomes the megatron config's, the same object)."""
        return {**{name: getattr(cfg.optimizer, name) for name in self.sections},
                "base_options": {name: getattr(cfg.optimizer, name) for name in self.base_sections}}

    def _md_assignment(self, cfg, role: str, base: str) -> Assignment:
        o = cfg.optimizer
        if role == "embedding":
            return (Assignment("md", o.md.md_embeddings_base, o.md.md_embedding_gains)
                    if o.md.md_embedding_sphere != "none" else Assignment("base", "adam"))
        if role == "head":
            return (Assignment("md", o.md.md_embeddings_base, o.md.md_output_gains) if o.md.md_output_sphere != "none"
                    else Assignment("base", "adam"))
        if role == "router":
            return Assignment("md", o.md.md_router_base, o.md.md_gains)
        return Assignment("md", base, o.md.md_gains)


class MDFamily(_EngineFamily):
    names = {
        "muon_md": "MD decoupling: gains x direction on a sphere, Muon steps the direction, Adam the gains",
        "adam_md": "MD decoupling with an Adam base update on the direction",
        "lion_md": "MD decoupling with a Lion base update on the direction",
        "soap_md": "MD decoupling with a SOAP base update on the direction",
        "ademamix_md": "MD decoupling with an AdEMAMix base update (a fast and a slow EMA) on the direction",
        "norm_md": "MD decoupling with the momentum normalised onto the sphere as the update (no Newton-Schulz)",
    }
    BASES = {"muon_md": "muon", "adam_md": "adam", "lion_md": "lion", "soap_md": "soap", "ademamix_md": "ademamix",
             "norm_md": "norm"}
    # The MD paper's recipe, unless set explicitly: no weight decay, no warmup, linear decay, Muon's momentum
    # 0.95 with Nesterov, AdamW's beta2 0.95 (Megatron-LM's defaults are 0.9 without Nesterov, and 0.999).
    recipe = {"weight_decay": 0.0, "lr_warmup_iters": 0, "lr_decay_style": "linear", "clip_grad": 1.0,
              "muon_momentum": 0.95, "muon_nesterov": True, "adam_beta2": 0.95}

    # Sweep centres: muon_md measured at CPU scale (0.05-0.1, k 12); adam_md the paper's 2e-3 (k 2); the bases
    # scaled to Muon's relative step (lion, norm) take muon_md's, the unscaled Adam-like ones (soap, ademamix)
    # adam_md's. MD needs neither warmup nor weight decay.
    SWEEP_K = {"muon": 12, "adam": 2, "lion": 12, "soap": 2, "ademamix": 2, "norm": 12}

    def base(self, cfg) -> str:
        return self.BASES[cfg.optimizer.optimizer]

    def sweep_recipe(self, name: str) -> SweepRecipe:
        return SweepRecipe("matrix_lr", self.SWEEP_K[self.BASES[name]], 0.0, 0.0, _MD_FIXED)

    def validate(self, cfg, need) -> None:
        super().validate(cfg, need)
        self._tp_mode_check(cfg, need)  # every MD optimizer builds the engine's NS settings, not muon_md alone
        if self.base(cfg) == "soap":
            p = cfg.parallel
            tp, etp = p.tensor_model_parallel_size, p.expert_tensor_parallel_size or p.tensor_model_parallel_size
            need(tp == 1 and etp == 1, "soap_md keeps Kronecker factors of whole matrices, so it does not run on "
                 f"tensor-parallel shards (TP {tp}, expert TP {etp}); use --tensor-model-parallel-size 1 and "
                 "--expert-tensor-parallel-size 1, or another MD base (muon_md, adam_md, lion_md)")

    def _config(self, cfg, common: dict):
        from megatron_md.mcore.md_config import MDOptimizerConfig

        return MDOptimizerConfig(**common, **self._sections(cfg), md_base=self.base(cfg),
                                 md_num_layers=cfg.model.num_layers)

    def _routes_to_adamw(self, cfg) -> Callable:
        from megatron_md.mcore.md_config import MDOptimizerConfig
        from megatron_md.mcore.md_param_groups import routes_to_adamw

        return routes_to_adamw(MDOptimizerConfig(**self._sections(cfg), md_base=self.base(cfg)))

    def build(self, cfg, common: dict, ddp_model):
        from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides

        from megatron_md.mcore.md_optimizer import register
        from megatron_md.mcore.md_param_groups import md_param_overrides

        ocfg = self._config(cfg, common)
        register(cfg.optimizer.optimizer, ocfg)
        overrides = {**get_standard_config_overrides(ocfg), **md_param_overrides(ocfg)}
        return get_megatron_optimizer(ocfg, [ddp_model], config_overrides=overrides), MDHooks()

    def assign(self, cfg, role: str) -> Assignment:
        return self._md_assignment(cfg, role, self.base(cfg))

    def ns_work(self, cfg, role: str):
        a = self.assign(cfg, role)
        if a.base != "muon":
            return None
        return 1, cfg.optimizer.muon.muon_num_ns_steps, False  # Q, K and V blocks apart


class ManifoldFamily(_EngineFamily):
    names = {"manifold_muon": "module-wise Manifold Muon: each module's weights on the manifold --geometry gives it"}
    # The settings its tests and records were made with, unless set explicitly (Megatron-LM's defaults are linear
    # decay, momentum 0.9 without Nesterov, beta2 0.999).
    recipe = {"lr_decay_style": "cosine", "muon_momentum": 0.95, "muon_nesterov": True, "adam_beta2": 0.95}
    sections = ("md", "lion", "soap", "ademamix", "manifold")

    def sweep_recipe(self, name: str) -> SweepRecipe:
        # the paper's 0.02 (k 9), its warmup and weight decay; the AdamW LR of the rest fixed
        return SweepRecipe("matrix_lr", 9, 0.02, 0.1, {"lr": 6e-4})

    def recipe_for(self, geometry: str) -> dict:
        # --geometry md puts every matrix under MD: the run is MD's, so it takes MD's recipe (no weight decay, no
        # warmup); mixed geometries keep the Manifold Muon recipe their records were made with.
        return MDFamily.recipe if geometry.strip().lower() == "md" else self.recipe

    def validate(self, cfg, need) -> None:
        super().validate(cfg, need)
        o = cfg.optimizer
        self._tp_mode_check(cfg, need)
        spec = o.manifold.geometry
        auto = spec == "auto" or spec.startswith("auto:")
        need(not auto or o.manifold.geometry_auto_sigma_max is not None or o.manifold.geometry_auto_logit is not None,
             f"--geometry {spec} switches modules on thresholds: set --geometry-auto-sigma-max and/or "
             "--geometry-auto-logit")
        try:  # the preset or rules parse here, before any process starts (the build parses them again)
            policy = self._policy(cfg)
        except ValueError as e:
            need(False, f"{e} (in --geometry {spec})")
        else:
            if auto:
                from megatron_md.optim.policy import AutoPolicy

                need(bool(AutoPolicy(policy).switchable_roles()),
                     f"--geometry {spec}: no module could switch (the switches move Muon-based modules that are "
                     "neither Stiefel nor MD onto Stiefel); use a geometry with unconstrained or DGram modules, "
                     "e.g. auto:hetero or auto:all-dgram")
        need(o.md.md_ns_coefficients == "quintic" or "md" in o.manifold.geometry,
             "--md-ns-coefficients applies to MD groups only and --geometry "
             f"{o.manifold.geometry} has none; Manifold Muon uses Polar Express (--manifold-msign-steps, "
             "--manifold-fast-msign-steps)")
        need(o.muon.muon_num_ns_steps == 5 or "md" in o.manifold.geometry,
             "--muon-num-ns-steps applies to MD groups only and --geometry "
             f"{o.manifold.geometry} has none; set --manifold-msign-steps / --manifold-fast-msign-steps instead")
        need("embed" not in (o.md.md_sphere, o.md.md_gains) and not o.md.md_out_proj_radius,
             "manifold_muon groups matrices by role, so out-projections cannot differ from the other hidden "
             "matrices: drop --md-sphere/--md-gains embed and --md-out-proj-radius, or use an MD optimizer")

    def _config(self, cfg, common: Optional[dict] = None):
        from megatron_md.mcore import manifold_optimizer as mm

        extra = {"md_num_layers": cfg.model.num_layers} if common is not None else {}
        return mm.ManifoldOptimizerConfig(**(common or {}), **self._sections(cfg), md_base="muon", **extra)

    def _routes_to_adamw(self, cfg) -> Callable:
        from megatron_md.mcore import manifold_optimizer as mm

        return mm.routes_to_adamw(mm.build_policy(self._config(cfg)))

    def build(self, cfg, common: dict, ddp_model):
        from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides

        from megatron_md.mcore import manifold_optimizer as mm

        ocfg = self._config(cfg, common)
        policy = mm.register(ocfg)
        overrides = {**get_standard_config_overrides(ocfg), **mm.manifold_param_overrides(ocfg, policy)}
        return get_megatron_optimizer(ocfg, [ddp_model], config_overrides=overrides), PolicyHooks(policy)

    def _policy(self, cfg):
        """The geometry policy ``--geometry`` names (for ``auto:SPEC``, SPEC's: the switches come later)."""
        from megatron_md.optim.policy import make_policy

        spec = cfg.optimizer.manifold.geometry
        if spec == "auto" or spec.startswith("auto:"):
            spec = spec.partition(":")[2] or "hetero"
        return make_policy(spec)

    def assign(self, cfg, role: str) -> Assignment:
        from megatron_md.optim.policy import MANIFOLD_GEOMETRIES

        o, a = cfg.optimizer, self._policy(cfg).assign(role)
        if a.geometry == "md":
            return Assignment("md", a.base, {"embedding": "none", "head": o.md.md_output_gains}.get(role, o.md.md_gains))
        if a.geometry in MANIFOLD_GEOMETRIES:
            return Assignment("manifold", "muon")
        return Assignment("base", a.base)

    def ns_work(self, cfg, role: str):
        from megatron_md.optim.policy import MANIFOLD_GEOMETRIES

        o, a = cfg.optimizer, self._policy(cfg).assign(role)
        if a.geometry in MANIFOLD_GEOMETRIES:
            fast = o.manifold.manifold_mode == "fast"
            steps = o.manifold.manifold_fast_msign_steps if fast else o.manifold.manifold_msign_steps
            calls = (o.manifold.manifold_fast_dual_steps if fast else o.manifold.manifold_dual_steps) + 1
            return calls, steps, not o.manifold.manifold_split_qkv
        if a.base == "muon":
            return 1, o.muon.muon_num_ns_steps, False
        return None


FAMILIES: dict[str, OptimizerFamily] = {}
for _family in (AdamFamily(), MuonFamily(), MDFamily(), ManifoldFamily()):
    for _name in _family.names:
        FAMILIES[_name] = _family

MD_OPTIMIZERS = tuple(MDFamily.names)  # the one list of MD optimizers


def descriptions() -> dict[str, str]:
    """``--optimizer`` name -> its one-line description, for ``--help``."""
    return {n: d for f in dict.fromkeys(FAMILIES.values()) for n, d in f.names.items()}


def family_of(cfg) -> OptimizerFamily:
    name = cfg.optimizer.optimizer
    if name not in FAMILIES:
        raise ValueError(f"--optimizer {name!r}: not one of {', '.join(FAMILIES)}")
    return FAMILIES[name]
