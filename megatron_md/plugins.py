"""``--plugin MODULE``: a researcher's optimizer variant in a file of their own, without forking.

Every ``megatron-md`` command imports the modules named by ``--plugin`` (on the command line, or ``plugin:`` in the
``--config`` YAML, flat or under ``training:``) before it reads any other flag, so what they register is an
``--optimizer`` choice everywhere: ``--help``, ``train`` (each launched rank imports them again from the same
flags), ``plan``, ``lr-sweep``, checkpoints. A module registers a base update with :func:`register_md_base`::

    # sign_md.py, on PYTHONPATH
    from megatron_md.optim.bases import BaseUpdate
    from megatron_md.plugins import register_md_base

    class SignBase(BaseUpdate): ...          # init_state, direction, descend_, state_layout
    register_md_base("sign_md", SignBase, "MD with the sign of the momentum as the step")

    megatron-md train --plugin sign_md --optimizer sign_md ...

A plugin base takes MD's per-matrix step (the batched engine batches only the shipped Muon, Lion and Adam bases).
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
    from megatron_md.training.config import load_yaml

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
    Muon's, 2 for unscaled Adam-like ones)."""
    from megatron_md.mcore.families import FAMILIES, MDFamily
    from megatron_md.optim.bases import BASES, BaseUpdate

    if not (isinstance(base, type) and issubclass(base, BaseUpdate)):
        raise PluginError(f"register_md_base({name!r}): {base!r} is not a BaseUpdate subclass")
    if not name.endswith("_md") or not name[:-3]:
        raise PluginError(f"register_md_base({name!r}): an MD optimizer's name ends in _md (e.g. sign_md)")
    key = name[:-3]
    if name in FAMILIES and MDFamily.BASES.get(name) != key or (key in BASES and BASES[key] is not base):
        raise PluginError(f"register_md_base({name!r}): {name} (or its base {key!r}) is already taken")
    BASES[key] = base
    MDFamily.names[name] = description
    MDFamily.BASES[name] = key
    MDFamily.SWEEP_K[key] = sweep_k
    FAMILIES[name] = FAMILIES["muon_md"]
