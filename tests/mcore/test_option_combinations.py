"""Every MD option combination is right: refused before launch, or reaching the groups it is meant for.

A covering walk: every pair of the options below runs once, with the MD optimizers taken in turn, so every pair
of options and every (optimizer, option) pair is built at least once. For each combination either
``validate_config`` refuses it (the one-line refusal before any process starts), or the optimizer builds
(tiny-moe, in this process) and each option's value is in the param groups of the roles it is meant for. A
combination that passes validation and then fails to build, or builds without the option in its groups, fails.
"""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_md.training.config import resolve

MD_NAMES = ("muon_md", "adam_md", "lion_md", "soap_md", "ademamix_md", "norm_md")
HIDDEN, ALL = ("hidden",), ("hidden", "router", "embedding", "output")
# flag field -> (value, group key, expected group value (None: the value itself), roles it must reach)
OPTIONS = {
    "md_sphere": ("row", "sphere", None, HIDDEN),
    "md_gains": ("row", "gains", None, HIDDEN),
    "md_gain_param": ("offset", "gain_param", None, ALL),
    "md_tangent_grad": (True, "tangent_grad", None, ALL),
    "md_normalize_update": (True, "normalize_update", None, ALL),
    "md_sphere_kind": ("spectral", "sphere_kind", None, HIDDEN),
    "md_ball": (True, "ball", None, ALL),
    "md_preserve_init": (True, "preserve_init", None, HIDDEN),
    "md_gains_no_clamp": (True, "gains_no_clamp", None, ALL),
    "md_gains_min": (0.1, "gains_min", None, ALL),
    "md_split_qkv_gains": (True, "split_qkv_gains", None, HIDDEN),
    "md_embedding_gains": ("row", "gains", None, ("embedding",)),
    "md_router_base": ("adam", "md_base", None, ("router",)),
    "md_out_proj_radius": (True, "radius_scale", 1.0 / math.sqrt(2 * 2), ("out_proj",)),
}


def _walk():
    """Every pair of options once, each with the optimizer that meets the most (optimizer, option) pairs not yet
    met (greedy, deterministic): every optimizer meets every option."""
    seen, out = set(), []
    for a, b in itertools.combinations(OPTIONS, 2):
        name = max(MD_NAMES, key=lambda n: ((n, a) not in seen) + ((n, b) not in seen))
        seen |= {(name, a), (name, b)}
        out.append((name, a, b))
    return out


def test_the_walk_covers_every_optimizer_with_every_option():
    seen = {(name, o) for name, a, b in _walk() for o in (a, b)}
    assert seen == {(name, o) for name in MD_NAMES for o in OPTIONS}


def _groups(optimizer) -> dict[str, list[dict]]:
    from megatron_md.mcore.md_locate import md_optimizers

    out: dict[str, list[dict]] = {}
    for opt in md_optimizers(optimizer):
        for group in opt.param_groups:
            if not group["params"]:
                continue
            out.setdefault(group.get("md_role", "?"), []).append(group)
            if group.get("out_proj"):
                out.setdefault("out_proj", []).append(group)
    return out


@pytest.mark.parametrize("name,first,second", _walk(), ids=[f"{n}-{a}-{b}" for n, a, b in _walk()])
def test_option_pair_is_refused_up_front_or_reaches_its_groups(mcore_world, name, first, second):
    from megatron_md.training.build import build_optimizer, build_wrapped_model
    from megatron_md.training.validate import ConfigError, validate_config

    flags = {k: OPTIONS[k][0] for k in (first, second)}
    cfg = resolve("tiny-moe", None, {"optimizer": name, "mock_data": True, **flags})
    try:
        validate_config(cfg, 1)
    except ConfigError:
        return  # refused before any work, in one line: a right answer for a combination that cannot hold
    model, _ = build_wrapped_model(cfg, cfg.model.vocab_size, cpu=True)
    optimizer, _ = build_optimizer(cfg, model)  # must build: validation let it through
    groups = _groups(optimizer)
    for k in (first, second):
        value, key, want, roles = OPTIONS[k]
        want = value if want is None else want
        for role in roles:
            assert groups.get(role), f"{k}: no {role} group"
            for g in groups[role]:
                got = g.get(key)
                same = math.isclose(got, want) if isinstance(want, float) else got == want
                assert same, f"--{k.replace('_', '-')} {value}: {role} group has {key}={got!r}, not {want!r}"
