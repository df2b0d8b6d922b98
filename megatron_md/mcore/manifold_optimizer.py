"""``--optimizer manifold_muon --geometry PRESET|RULES`` inside megatron-core.

One registry entry drives every geometry policy: each role (attention.qkv, attention.proj,
mlp.fc1/fc2, experts, router, embedding, head) becomes a param group carrying its geometry:
Stiefel / DGram / Oblique / sphere groups take the Manifold Muon step (gathered over TP,
``parallel/manifold.py``), ``md`` groups the MD step of ``MegatronMD`` (so ``hetero-md`` mixes
both in one optimizer), ``none`` groups with a Muon base plain Muon, the rest AdamW.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

from megatron_md.mcore import compat
from megatron_md.mcore.family_configs import ManifoldConfig
from megatron_md.mcore.md_config import MDOptimizerConfig, ns_settings
from megatron_md.mcore.md_optimizer import MegatronMD, refuse_packed_experts, relative_change
from megatron_md.mcore.md_param_groups import md_param_overrides
from megatron_md.optim.manifold_muon import ManifoldHyperParams, init_state
from megatron_md.optim.policy import (
    MANIFOLD_GEOMETRIES,
    AutoPolicy,
    GeometryPolicy,
    layer_of,
    make_policy,
    role_of,
)
from megatron_md.parallel.manifold import (
    finish_manifold_steps,
    manifold_steps_sharded_,
    project_sharded_,
    submit_manifold_steps,
)

MM_STATE_KEYS = ("dual", "dual_q", "dual_k", "dual_v", "dual_violation", "dual_iters")


@dataclass
class ManifoldOptimizerConfig(MDOptimizerConfig):
    """MD's config (MD groups of a geometry) plus the manifold section."""

    manifold: ManifoldConfig = field(default_factory=ManifoldConfig)


def _is_manifold_group(group: dict) -> bool:
    return group.get("manifold", "md") != "md"


class MegatronManifoldMuon(MegatronMD):
    """MegatronMD plus Manifold Muon groups; geometry per group, each matrix solved once by its owner in the
    TP group (``parallel/manifold.py``)."""

    def __init__(self, params, config: ManifoldOptimizerConfig, pg_collection=None):
        self.mm_defaults = dict(
            manifold="none", mode=config.manifold.manifold_mode, dual_steps=config.manifold.manifold_dual_steps,
            dual_lr=config.manifold.manifold_dual_lr, tol=1e-6, msign_steps=config.manifold.manifold_msign_steps,
            fast_dual_steps=config.manifold.manifold_fast_dual_steps, fast_dual_lr=config.manifold.manifold_fast_dual_lr,
            fast_msign_steps=config.manifold.manifold_fast_msign_steps,
            split_qkv=config.manifold.manifold_split_qkv, retraction=config.manifold.manifold_retraction,
            msign_dtype="bf16" if ns_settings(config)["dtype"] == torch.bfloat16 else "fp32",
        )
        self.geometry_override: dict[str, str] = {}  # md_key -> geometry (auto policy switches)
        super().__init__(params, config, pg_collection)

    def _init_mm_state(self, p: torch.Tensor, hp: ManifoldHyperParams) -> None:
        r = self.reducer_for(p)
        shape = list(p.shape)
        if r.dim is not None:
            shape[r.dim] *= r.size
        init_state(p, self.state[p], hp, tuple(shape))

    def switch_geometry(self, matches, geometry: str) -> list[str]:
        """Move manifold-group params for which ``matches(md_key)`` holds to ``geometry``."""
        moved = []
        for group in self.param_groups:
            if not _is_manifold_group(group):
                continue
            for p in group["params"]:
                key = getattr(p, "md_key", None) or ""
                if matches(key) and self.geometry_override.get(key) != geometry:
                    self.geometry_override[key] = geometry
                    moved.append(key)
        return moved

    def add_param_group(self, param_group: dict) -> None:
        if not _is_manifold_group(param_group):
            return super().add_param_group(param_group)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        torch.optim.Optimizer.add_param_group(self, {**self.mm_defaults, **param_group, "params": params})
        group = self.param_groups[-1]
        hp = ManifoldHyperParams.from_group(group)
        hp.validate()
        with torch.no_grad():
            for p in group["params"]:
                r = self.reducer_for(p)
                project_sharded_(p, hp, r.group, r.dim)
                if not self.lazy_state:
                    self._init_mm_state(p, hp)

    def md_groups(self) -> list[dict]:
        """MD's step and reset run on the MD and AdamW-base groups; the manifold groups are stepped below."""
        return [g for g in self.param_groups if not _is_manifold_group(g)]

    @torch.no_grad()
    def reset_from_weights(self, recover: bool | None = None) -> dict[str, float]:
        """The MD groups as MuonMD's; the manifold groups' matrices are projected onto their manifolds (they
        have no gains to hold what the projection removes): the change is measured, as ``manifold``."""
        moved = super().reset_from_weights(recover)
        for group in self.param_groups:
            if _is_manifold_group(group):
                hp = ManifoldHyperParams.from_group(group)
                for p in group["params"]:
                    r = self.reducer_for(p)
                    before = p.detach().clone()
                    project_sharded_(p, hp, r.group, r.dim)
                    moved["manifold"] = max(moved.get("manifold", 0.0), relative_change(before, p))
                    self.state[p].clear()
                    self._init_mm_state(p, hp)
        return moved

    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        if not _is_manifold_group(group):
            return super()._init_group(group, skip_non_grad_params)
        hp = ManifoldHyperParams.from_group(group)
        for p in group["params"]:
            if not self.state[p]:
                self._init_mm_state(p, hp)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)  # the MD and AdamW-base groups (md_groups)
        with self.phase("manifold-solve"):
            self._manifold_step()
        return loss

    def _manifold_step(self) -> None:
        duplicated, pending = self.ns["tp_mode"] == "duplicated", []
        for group in self.param_groups:
            if not _is_manifold_group(group):
                continue
            hp = ManifoldHyperParams.from_group(group)
            by_geometry: dict[str, list[tuple]] = {}  # auto-policy overrides split a group
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self._init_mm_state(p, hp)
                geometry = self.geometry_override.get(getattr(p, "md_key", None) or "", hp.manifold)
                r = self.reducer_for(p)
                by_geometry.setdefault(geometry, []).append((p, p.grad, self.state[p], r.group, r.dim))
            for geometry, items in by_geometry.items():
                geo_hp = dataclasses.replace(hp, manifold=geometry)
                if duplicated:
                    manifold_steps_sharded_(items, geo_hp, self.ortho_engine, duplicated=True)
                else:
                    pending += submit_manifold_steps(items, geo_hp, self.ortho_engine)
        self.ortho_engine.run()  # every manifold group's matrices in one run
        finish_manifold_steps(pending)

    def _manifold_group_of(self, p: torch.Tensor) -> dict | None:
        for group in self.param_groups:
            if _is_manifold_group(group) and any(q is p for q in group["params"]):
                return group
        return None

    def _geometry_of(self, p: torch.Tensor, group: dict) -> str:
        return self.geometry_override.get(getattr(p, "md_key", None) or "", group["manifold"])

    def check_scale_rows(self, p: torch.Tensor) -> str:
        group = self._manifold_group_of(p)
        if group is None:
            return super().check_scale_rows(p)
        geometry = self._geometry_of(p, group)
        if geometry == "stiefel":
            return ("Stiefel: left alone (every singular value is pinned at 1, and the retraction would undo a row "
                    "factor)")
        if geometry == "none":
            return "unconstrained: the rows scaled"
        return f"{geometry}: the rows scaled, then retracted onto the manifold"

    @torch.no_grad()
    def scale_rows_(self, p: torch.Tensor, factors: torch.Tensor) -> None:
        """QK-clip on a manifold matrix: the row factors, then the retraction (a per-head row factor does not
        keep DGram's columns orthogonal); Stiefel matrices are left alone (σ = 1 already bounds their logits
        by the inputs' norms, and the retraction would return the same scale)."""
        group = self._manifold_group_of(p)
        if group is None:
            return super().scale_rows_(p, factors)
        geometry = self._geometry_of(p, group)
        if geometry == "stiefel":
            return
        p.mul_(factors.unsqueeze(1).to(p.dtype))
        r = self.reducer_for(p)
        project_sharded_(p, dataclasses.replace(ManifoldHyperParams.from_group(group), manifold=geometry),
                         r.group, r.dim)

    def state_dict(self):
        sd = super().state_dict()
        sd["state"] = {i: {k: v for k, v in s.items() if k not in MM_STATE_KEYS} for i, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict):
        kept = {p: {k: v for k, v in s.items() if k in MM_STATE_KEYS} for p, s in self.state.items()}
        super().load_state_dict(state_dict)
        for p, extra in kept.items():
            self.state[p].update(extra)


def routes_to_adamw(policy: GeometryPolicy):
    """Which params the policy leaves to AdamW: 1-D ones and unconstrained Adam-base matrices."""

    def to_adamw(p: torch.Tensor) -> bool:
        if p.ndim != 2:
            return True
        a = policy.assign(role_of(getattr(p, "md_key", None) or ""))
        return a.geometry == "none" and a.base == "adam"

    return to_adamw


def build_policy(config: ManifoldOptimizerConfig) -> GeometryPolicy:
    """``--geometry PRESET|RULES``, or ``auto:PRESET|RULES`` with the auto-switch thresholds."""
    spec = config.manifold.geometry
    if spec.startswith("auto:") or spec == "auto":
        base = spec.partition(":")[2] or "hetero"
        if config.manifold.geometry_auto_sigma_max is None and config.manifold.geometry_auto_logit is None:
            raise ValueError("--geometry auto needs --geometry-auto-sigma-max and/or --geometry-auto-logit")
        return AutoPolicy(base, config.manifold.geometry_auto_sigma_max, config.manifold.geometry_auto_logit)
    return make_policy(spec)


_DIAG = re.compile(r"^diag/L(\d+)\.(attention\.qkv|attention\.proj|mlp\.fc1|mlp\.fc2)/sigma_max$")
_LOGIT = re.compile(r"^diag/L(\d+)\.max_logit$")


def auto_observe(policy: GeometryPolicy, optimizer, diagnostics: dict) -> list[str]:
    """Feed one round of diagnostics to an AutoPolicy; apply its switches to every manifold optimizer.

    Every rank calls this with the same (all-gathered) diagnostics, so the switches agree.
    """
    if not isinstance(policy, AutoPolicy):
        return []
    lines = []
    for key, value in diagnostics.items():
        m = _DIAG.match(key)
        if m:
            lines += policy.observe(f"layers.{m.group(1)}.{m.group(2)}", sigma_max=value)
        m = _LOGIT.match(key)
        if m:
            lines += policy.observe(int(m.group(1)), max_logit=value)
    if lines:
        apply_switches(policy, optimizer)
    return lines


def apply_switches(policy: AutoPolicy, optimizer) -> None:
    """Make every manifold optimizer follow the policy's recorded switches (also after a resume)."""
    from megatron_md.mcore.md_locate import md_optimizers

    for opt in md_optimizers(optimizer):
        if isinstance(opt, MegatronManifoldMuon):
            for (layer, role) in policy.switched:
                opt.switch_geometry(
                    lambda k, layer=layer, role=role: role_of(k) == role and (layer is None or layer_of(k) == layer),
                    policy.target,
                )


def _config_to_kwargs(config, model_chunks, pg_collection):
    refuse_packed_experts(model_chunks, "manifold_muon")
    return {"config": config, "pg_collection": pg_collection}


def register(config: ManifoldOptimizerConfig) -> GeometryPolicy:
    policy = build_policy(config)
    to_adamw = routes_to_adamw(policy)
    compat.register_optimizer("manifold_muon", MegatronManifoldMuon, _config_to_kwargs,
                              {ParamKey(predicate=ParamPredicate(name="mm_adamw", fn=to_adamw)): {"optimizer": "adam"}})
    return policy


def manifold_param_overrides(config: ManifoldOptimizerConfig, policy: GeometryPolicy) -> dict:
    """One group per role, tagged with its geometry (MD roles reuse the MD routing's settings)."""
    md = {}
    for key, value in md_param_overrides(config).items():
        if not value.get("out_proj"):  # groups here are per role; validate.py refuses out-projection options
            md[value.get("md_role", "embedding")] = value
    lr, min_ratio = config.lr, (config.min_lr / config.lr if config.lr else 0.0)
    matrix_lr = config.md.matrix_lr if config.md.matrix_lr is not None else lr
    out = {}
    for role in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2", "experts.fc1", "experts.fc2",
                 "router", "embedding", "head"):
        a = policy.assign(role)
        key = ParamKey(predicate=ParamPredicate(
            name=f"mm_{role}", fn=lambda p, role=role: p.ndim == 2 and role_of(getattr(p, "md_key", "") or "") == role
        ))
        if a.geometry == "md":
            base = {"hidden": md.get("hidden"), "router": md.get("router"),
                    "embedding": md.get("embedding"), "head": md.get("output")}
            src = base["router" if role == "router" else role if role in ("embedding", "head") else "hidden"]
            out[key] = {**src, "is_decoupled_lr": f"md:{role}"}
            if named := policy.explicit_base(role):  # `role=md:adam`: that role's MD base (it was ignored)
                out[key]["md_base"] = named
        elif a.geometry in MANIFOLD_GEOMETRIES or (a.geometry == "none" and a.base == "muon"):
            out[key] = {"max_lr": matrix_lr, "min_lr": matrix_lr * min_ratio, "manifold": a.geometry,
                        "md_role": "manifold", "is_decoupled_lr": f"mm:{role}"}
    return out
