"""``--config`` files: the path a user gives, or the shipped recipe it names, read as a YAML mapping.

Imports neither torch nor the config classes: ``--plugin`` reads a YAML's ``plugin:`` with it before the config
classes are built (training/config.py, which re-exports these).
"""

from __future__ import annotations

from pathlib import Path

import yaml

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"  # shipped in the wheel


def find_config(path: str) -> Path:
    """``path`` itself, or else the shipped recipe it names (``examples/md_paper/x.yaml`` or ``md_paper/x.yaml``).

    A wheel install has no source tree, so the recipes travel inside the package; a file of the same
    name in the working directory always wins.
    """
    p = Path(path)
    if p.is_file() or p.is_absolute():
        return p
    rel = p.parts[1:] if p.parts[:1] == ("examples",) else p.parts
    shipped = EXAMPLES_DIR.joinpath(*rel) if rel else None
    return shipped if shipped is not None and shipped.is_file() else p


def load_yaml(path: str) -> dict:
    p = find_config(path)
    if not p.is_file():
        raise ValueError(
            f"--config {path}: file not found (nor among the shipped recipes in {EXAMPLES_DIR}; "
            "`megatron-md recipes` lists them)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings at the top level")
    return data
