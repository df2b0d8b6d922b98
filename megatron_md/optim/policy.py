"""Geometry policy: which module gets which weight geometry and which base update (docs/optimizers.md §1.8, §2.8).

A parameter name maps to a *role* (``attention.qkv``, ``mlp.fc2``, ``experts.fc1``, ``router``, ...); a
``GeometryPolicy`` maps a role to ``Assignment(geometry, base)`` with geometry ∈ GEOMETRIES and base ∈
{"muon", "adam"}. Policies come from presets (the paper's five, ``md``, ``hetero-md``) or from rule
strings such as ``--geometry "hetero,router=md"`` or ``"attention=stiefel,mlp=dgram,experts=md"``.
``AutoPolicy`` starts from a preset and moves modules to Stiefel once their σ_max, or their layer's max
attention logit, grows past a threshold (the paper's DGram-attention failure: σ growth → logit
inflation → softmax saturation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

GEOMETRIES = ("stiefel", "dgram", "oblique", "sphere", "md", "none")
MANIFOLD_GEOMETRIES = ("stiefel", "dgram", "oblique", "sphere")  # Manifold Muon: base must be muon
BASES = ("muon", "adam")
ATTENTION_ROLES = ("attention.qkv", "attention.proj")
HIDDEN_ROLES = ATTENTION_ROLES + ("mlp.fc1", "mlp.fc2", "experts.fc1", "experts.fc2", "router")
ROLES = HIDDEN_ROLES + ("embedding", "position_embedding", "head", "norm", "bias", "other")
_VECTOR_ROLES = ("norm", "bias")  # 1-D parameters: AdamW only
_MD_ADAM_ROLES = ("embedding", "position_embedding", "head")  # MD routing: Adam base on the row sphere


@dataclass(frozen=True)
class Assignment:
    geometry: str
    base: str

    def __str__(self) -> str:
        return f"{self.geometry}:{self.base}"


# ----------------------------------------------------------------------------------------------------
# Parameter names -> roles (megatron-core GPTModel names; nanoGPT names for the CPU reproductions)

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
_QKV = ("linear_qkv", "linear_q_proj", "linear_kv_proj", "linear_q_down_proj", "linear_q_up_proj",
        "linear_kv_down_proj", "linear_kv_up_proj", "attn.c_attn")


def role_of(name: str) -> str:
    """Role of a parameter name, e.g. ``decoder.layers.3.self_attention.linear_qkv.weight`` -> attention.qkv."""
    n = name
    for prefix in ("module.", "_orig_mod."):
        while n.startswith(prefix):
            n = n[len(prefix):]
    last = n.rsplit(".", 1)[-1]
    if "norm" in last or re.search(r"(?:^|\.)(?:\w*layernorm|\w*_norm|norm|ln_\w+|ln_f)\.", n + "."):
        return "norm"
    if last == "bias" or last.startswith("bias"):
        return "bias"
    if "word_embeddings" in n or re.search(r"(?:^|\.)wte\.", n):
        return "embedding"
    if "position_embeddings" in n or re.search(r"(?:^|\.)wpe\.", n):
        return "position_embedding"
    if "output_layer" in n or "lm_head" in n:
        return "head"
    if "router" in n:
        return "router"
    if "experts" in n:
        # Routed and shared experts: SequentialMLP ``local_experts.{e}.linear_fc1.weight``, TEGroupedMLP
        # ``experts.linear_fc1.weight{e}``, megatron's legacy GroupedMLP ``experts.weight1`` / ``weight2``.
        if "linear_fc1" in n or (last == "weight1" and "linear_fc" not in n):
            return "experts.fc1"
        if "linear_fc2" in n or (last == "weight2" and "linear_fc" not in n):
            return "experts.fc2"
    if any(k in n for k in _QKV):
        return "attention.qkv"
    if ("attention" in n and "linear_proj" in n) or "attn.c_proj" in n:
        return "attention.proj"
    if "linear_fc1" in n or "mlp.c_fc" in n:
        return "mlp.fc1"
    if "linear_fc2" in n or "mlp.c_proj" in n:
        return "mlp.fc2"
    return "other"


def layer_of(name: str) -> int | None:
    """Transformer layer index in a parameter name (``layers.N.`` or nanoGPT ``h.N.``), None outside layers."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------------------------------
# Rules and policies


def _covers(prefix: str, role: str) -> bool:
    """Dot-component prefix matching: ``mlp`` covers ``mlp.fc1``; ``ml`` covers nothing."""
    return role == prefix or role.startswith(prefix + ".")


def default_base(role: str, geometry: str) -> str:
    """The base update a role gets when a rule names only the geometry."""
    if geometry in MANIFOLD_GEOMETRIES:
        return "muon"
    if role in _VECTOR_ROLES or role == "other":
        return "adam"
    if role in _MD_ADAM_ROLES:
        return "adam"  # AdamW for 'none'; MD routing gives embeddings/head an Adam base
    return "muon"


def _check(role: str, a: Assignment, where: str) -> None:
    if a.geometry in MANIFOLD_GEOMETRIES and a.base != "muon":
        raise ValueError(f"--geometry: {where}: the {a.geometry} manifold is a Manifold Muon geometry; "
                         f"its base must be muon, got {a.base!r}")
    if role in _VECTOR_ROLES and a.geometry != "none":
        raise ValueError(f"--geometry: {where}: {role} parameters are vectors; only 'none' (AdamW) applies")


@dataclass(frozen=True)
class Rule:
    prefix: str
    geometry: str
    base: str | None = None  # None: default_base(role, geometry)

    def resolve(self, role: str) -> Assignment:
        return Assignment(self.geometry, self.base or default_base(role, self.geometry))


def _rules(pairs: Iterable[tuple[str, str]]) -> tuple[Rule, ...]:
    return tuple(Rule(p, g) for p, g in pairs)


PRESETS: dict[str, tuple[Rule, ...]] = {
    # The Manifold Muon paper's five (docs/optimizers.md §2.8); the MoE router stays on plain Muon there.
    "unconstrained": (),
    "all-stiefel": _rules([("attention", "stiefel"), ("mlp", "stiefel"), ("experts", "stiefel")]),
    "all-dgram": _rules([("attention", "dgram"), ("mlp", "dgram"), ("experts", "dgram")]),
    "hetero": _rules([("attention", "stiefel"), ("mlp", "dgram"), ("experts", "dgram")]),
    "hetero-inv": _rules([("attention", "dgram"), ("mlp", "stiefel"), ("experts", "stiefel")]),
    # MD everywhere with the MD routing (md_optimizer.py): hidden + router Muon base, embedding/head Adam.
    "md": _rules([("attention", "md"), ("mlp", "md"), ("experts", "md"), ("router", "md"),
                  ("embedding", "md"), ("head", "md")]),
    "hetero-md": _rules([("attention", "stiefel"), ("mlp", "md"), ("experts", "md"), ("router", "md"),
                         ("embedding", "md"), ("head", "md")]),
}


def _preset_name(token: str) -> str | None:
    key = token.strip().lower().replace("_", "-")
    return key if key in PRESETS else None


class GeometryPolicy:
    """Ordered rules over roles; the last rule covering a role wins, roles no rule covers are unconstrained
    (hidden matrices: plain Muon; embeddings, head, norms, biases: AdamW)."""

    def __init__(self, rules: Sequence[Rule] = (), name: str = "custom"):
        self.rules = tuple(rules)
        self.name = name
        for r in self.rules:
            covered = [role for role in ROLES if _covers(r.prefix, role)]
            if not covered:
                raise ValueError(f"--geometry: unknown role {r.prefix!r}; known roles: {', '.join(ROLES)}")
            if r.geometry not in GEOMETRIES:
                raise ValueError(f"--geometry: unknown geometry {r.geometry!r} for {r.prefix!r}; "
                                 f"choose one of {', '.join(GEOMETRIES)}")
            if r.base is not None and r.base not in BASES:
                raise ValueError(f"--geometry: unknown base {r.base!r} for {r.prefix!r}; choose muon or adam")
            for role in covered:
                _check(role, r.resolve(role), f"{r.prefix}={r.geometry}")

    @classmethod
    def preset(cls, name: str) -> "GeometryPolicy":
        key = _preset_name(name)
        if key is None:
            raise ValueError(f"--geometry: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(PRESETS[key], key)

    @classmethod
    def parse(cls, spec: str) -> "GeometryPolicy":
        """``"hetero"``, ``"attention.qkv=stiefel,mlp=dgram,experts=md,router=md"`` or ``"md,mlp=none:adam"``.

        A bare token names a preset whose rules are appended; ``role=geometry[:base]`` appends one rule.
        Later rules override earlier ones; a spec without a preset starts from ``unconstrained``.
        """
        rules: list[Rule] = []
        names: list[str] = []
        tokens = [t.strip() for t in spec.split(",")]
        if not spec.strip() or any(not t for t in tokens):
            raise ValueError(f"--geometry: empty entry in {spec!r}")
        for tok in tokens:
            if "=" not in tok:
                key = _preset_name(tok)
                if key is None:
                    raise ValueError(f"--geometry: {tok!r} is neither a preset ({', '.join(PRESETS)}) "
                                     f"nor a role=geometry rule")
                rules.extend(PRESETS[key])
                names.append(key)
                continue
            role, _, value = (s.strip() for s in tok.partition("="))
            geometry, _, base = (s.strip().lower() for s in value.partition(":"))
            rules.append(Rule(role.lower(), geometry, base or None))
            names.append(tok)
        return cls(rules, ",".join(names))

    def assign(self, role: str) -> Assignment:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; known roles: {', '.join(ROLES)}")
        out = Assignment("none", default_base(role, "none"))
        for r in self.rules:
            if _covers(r.prefix, role):
                out = r.resolve(role)
        return out

    def assign_param(self, name: str) -> Assignment:
        return self.assign(role_of(name))

    def explicit_base(self, role: str) -> str | None:
        """The base the last rule covering ``role`` names with ``:base`` (None: that rule names none, so the
        role keeps its family's default, e.g. --md-router-base for an MD router)."""
        last = [r for r in self.rules if _covers(r.prefix, role)]
        return last[-1].base if last else None

    def table(self) -> dict[str, Assignment]:
        return {role: self.assign(role) for role in ROLES}

    def describe(self) -> str:
        """One line for the run log: ``geometry policy hetero: attention.qkv=stiefel:muon, ...``."""
        body = ", ".join(f"{r}={a}" for r, a in self.table().items())
        return f"geometry policy {self.name}: {body}"


def make_policy(spec: "str | GeometryPolicy") -> GeometryPolicy:
    return spec if isinstance(spec, GeometryPolicy) else GeometryPolicy.parse(spec)


# ----------------------------------------------------------------------------------------------------
# Auto policy


class AutoPolicy(GeometryPolicy):
    """A preset (or rule string) plus sticky switches to Stiefel driven by observed σ_max / attention logits.

    ``observe(key, sigma_max=..., max_logit=...)`` with ``key`` a parameter name, a role, a layer-scoped
    role (``"layers.3.attention.qkv"``) or a layer (``3`` / ``"layers.3"``, for logits). σ_max past its
    threshold switches the observed module; a max logit past its threshold switches that layer's attention
    (QKV and out-proj). Only Muon-based modules that are neither on the target nor MD switch; a switch is never
    undone. Returns
    the log lines of the switches made by this call.
    """

    def __init__(self, preset: "str | GeometryPolicy" = "hetero", sigma_max_threshold: float | None = None,
                 logit_threshold: float | None = None, target: str = "stiefel"):
        base = make_policy(preset)
        super().__init__(base.rules, f"auto({base.name})")
        if target not in MANIFOLD_GEOMETRIES:
            raise ValueError(f"AutoPolicy target must be a manifold geometry, got {target!r}")
        self.sigma_max_threshold = sigma_max_threshold
        self.logit_threshold = logit_threshold
        self.target = target
        self.switched: dict[tuple[int | None, str], str] = {}  # (layer or None = all layers, role) -> reason
        self.log: list[str] = []

    def assign(self, role: str, layer: int | None = None) -> Assignment:  # type: ignore[override]
        if (None, role) in self.switched or (layer is not None and (layer, role) in self.switched):
            return Assignment(self.target, "muon")
        return super().assign(role)

    def assign_param(self, name: str) -> Assignment:
        return self.assign(role_of(name), layer_of(name))

    @staticmethod
    def _scope(key: "int | str") -> tuple[int | None, list[str]]:
        """(layer, roles) named by an observation key."""
        if isinstance(key, int):
            return key, []
        m = re.fullmatch(r"(?:.*\.)?(?:layers|h)\.(\d+)(?:\.(.+))?", key)
        if m and (m.group(2) is None or any(_covers(m.group(2), r) for r in ROLES)):
            rest = m.group(2)
            return int(m.group(1)), [] if rest is None else [r for r in ROLES if _covers(rest, r)]
        roles = [r for r in ROLES if _covers(key, r)]
        if roles:
            return None, roles
        role = role_of(key)
        if role == "other":
            raise ValueError(f"AutoPolicy.observe: cannot tell the module of {key!r}")
        return layer_of(key), [role]

    def _switchable(self, a: Assignment, role: str) -> bool:
        # MD modules never switch: they live in MD groups with gains and a sphere, which a manifold's state does
        # not replace mid-run (a switch was logged for them and then not applied).
        return a.base == "muon" and a.geometry not in (self.target, "md") and role in HIDDEN_ROLES

    def switchable_roles(self) -> list[str]:
        """The hidden roles a switch can move (Muon-based, neither the target nor MD)."""
        return [r for r in HIDDEN_ROLES if self._switchable(GeometryPolicy.assign(self, r), r)]

    def _switch(self, layer: int | None, role: str, why: str) -> str | None:
        if (None, role) in self.switched or (layer, role) in self.switched:
            return None
        current = self.assign(role, layer)
        if not self._switchable(current, role):
            return None
        self.switched[(layer, role)] = why
        where = f"layer {layer} {role}" if layer is not None else f"{role} (all layers)"
        line = f"auto-geometry: {where}: {current.geometry} -> {self.target} ({why})"
        self.log.append(line)
        return line

    def observe(self, key: "int | str", sigma_max: float | None = None, max_logit: float | None = None) -> list[str]:
        layer, roles = self._scope(key)
        lines: list[str] = []
        if sigma_max is not None and self.sigma_max_threshold is not None and sigma_max > self.sigma_max_threshold:
            if not roles:
                raise ValueError(f"AutoPolicy.observe: sigma_max needs a module, got the layer key {key!r}")
            why = f"sigma_max {sigma_max:.4g} > {self.sigma_max_threshold:.4g}"
            lines += [ln for r in roles if (ln := self._switch(layer, r, why))]
        if max_logit is not None and self.logit_threshold is not None and max_logit > self.logit_threshold:
            why = f"max attention logit {max_logit:.4g} > {self.logit_threshold:.4g}"
            lines += [ln for r in ATTENTION_ROLES if (ln := self._switch(layer, r, why))]
        return lines

    def state_dict(self) -> dict:
        return {"switched": [[layer, role, why] for (layer, role), why in self.switched.items()], "log": list(self.log)}

    def load_state_dict(self, state: dict) -> None:
        self.switched = {(layer, role): why for layer, role, why in state.get("switched", [])}
        self.log = list(state.get("log", []))
