"""``--plugin MODULE``: a researcher's optimizer variant in a file of their own, without forking.

Every ``megatron-md`` command imports the modules named by ``--plugin`` (on the command line, or ``plugin:`` in the
``--config`` YAML, flat or under ``training:``) before it reads any other flag, so what they register is an
``--optimizer`` choice everywhere: ``--help``, ``train`` (each launched rank imports them again from the same
flags), ``plan``, ``lr-sweep``, checkpoints. A module registers a base update with :func:`register_md_base`::

    # sign_md.py, on PYTHONPATH
    from megatron_md.optim.bases import BaseUpdate
    from megatron_md.plugins import register_md_base

    @dataclass
    class SignConfig:                         # its own flags: --sign-beta
        sign_beta: float = opt(0.9, "sign_md: EMA factor of the momentum.", valid="[0,1)")

    class SignBase(BaseUpdate): ...          # init_state, direction, descend_, state_layout; self.options.sign_beta
        section, section_name, stacks = SignConfig, "sign", True

    register_md_base("sign_md", SignBase, "MD with the sign of the momentum as the step")

    megatron-md train --plugin sign_md --optimizer sign_md --sign-beta 0.8 ...

``stacks = True`` (for a base whose arithmetic is elementwise or per block) lets the batched engine run it on
stacks of same-shape matrices; without it the base takes MD's per-matrix step.
"""

from __future__ import annotations

import importlib
import sys


class PluginError(ValueError):
    """A --plugin module that cannot be imported or registers something invalid."""


def plugin_names(argv: list[str]) -> list[str]:
    """The modules ``--plugin`` names in ``argv`` (``--plugin a b``, ``--plugin=a``, repeated), then those of the
    ``--config`` YAML's ``plugin`` setting."""
    names: list[str] = []
    config = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break  # lr-sweep's cell flags follow: scanned too (a cell imports them again), below
        if arg.startswith("--plugin="):
            names.append(arg.split("=", 1)[1])
        elif arg == "--plugin":
            while i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                i += 1
                names.append(argv[i])
        elif arg == "--config" and i + 1 < len(argv):
            config = argv[i + 1]
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        i += 1
    if "--" in argv:
        names += plugin_names(argv[argv.index("--") + 1:])
    if config:
        names += _yaml_plugins(config)
    return list(dict.fromkeys(n for n in names if n))


def _yaml_plugins(path: str) -> list[str]:
    from megatron_md.config_files import load_yaml

    try:
        data = load_yaml(path)
    except ValueError:
        return []  # the command's own parsing says what is wrong with the file
    value = data.get("plugin", (data.get("training") or {}).get("plugin") if isinstance(data.get("training"), dict)
                     else None)
    return [value] if isinstance(value, str) else list(value or [])


def load_plugins(names: list[str]) -> None:
    """Import each module once; a missing one is a PluginError naming the flag and the fix."""
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise PluginError(f"--plugin {name}: cannot import it ({e}); put the directory that holds {name}.py on "
                              "PYTHONPATH, or install it") from None


def register_md_base(name: str, base: type, description: str, sweep_k: int = 12) -> None:
    """Make ``--optimizer name`` MD decoupling around ``base`` (a ``BaseUpdate`` subclass): its help line, its
    family (the MD family's flags, validation, checkpointing, routing), the planner's count (``state_layout``) and
    the LR sweep's fallback centre ``sweep_k`` (k on the ladder 1e-3 * 2^(k/2); 12 for steps scaled like
    Muon's, 2 for unscaled Adam-like ones).

    A base with a ``section`` (a dataclass of ``megatron_md.fields.opt`` fields) gets its flags, their ranges
    checked before launch, its place in the run's YAML (``optimizer: {section_name: ...}``) and the run's values
    as ``self.options``; it must be registered before the config classes are built, which ``--plugin`` does."""
    from megatron_md.mcore.families import FAMILIES, MDFamily
    from megatron_md.optim.bases import BASES, BaseUpdate

    if not (isinstance(base, type) and issubclass(base, BaseUpdate)):
        raise PluginError(f"register_md_base({name!r}): {base!r} is not a BaseUpdate subclass")
    if not name.endswith("_md") or not name[:-3]:
        raise PluginError(f"register_md_base({name!r}): an MD optimizer's name ends in _md (e.g. sign_md)")
    key = name[:-3]
    if name in FAMILIES and MDFamily.BASES.get(name) != key or (key in BASES and BASES[key] is not base):
        raise PluginError(f"register_md_base({name!r}): {name} (or its base {key!r}) is already taken")
    if base.section is not None:
        _register_section(name, base)
    BASES[key] = base
    MDFamily.names[name] = description
    MDFamily.BASES[name] = key
    MDFamily.SWEEP_K[key] = sweep_k
    FAMILIES[name] = FAMILIES["muon_md"]


def _register_section(name: str, base: type) -> None:
    import dataclasses

    from megatron_md.mcore.families import MDFamily
    from megatron_md.mcore.family_configs import SECTIONS

    section, where = base.section, base.section_name
    if not dataclasses.is_dataclass(section) or not where or not where.isidentifier():
        raise PluginError(f"register_md_base({name!r}): {base.__name__}.section must be a dataclass of opt() fields "
                          "and section_name the identifier it takes in the run's optimizer config")
    if SECTIONS.get(where, section) is not section:
        raise PluginError(f"register_md_base({name!r}): the config section {where!r} is already taken")
    if "megatron_md.training.config" in sys.modules and where not in SECTIONS:
        raise PluginError(f"register_md_base({name!r}): its config section comes too late, the config classes are "
                          "built already; load the module with --plugin (or before importing megatron_md.training)")
    SECTIONS[where] = section
    if where not in MDFamily.base_sections:
        MDFamily.base_sections = (*MDFamily.base_sections, where)
