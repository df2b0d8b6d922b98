"""Config fields: a default, its flag's help text, choices, and for numbers the valid range.

Shared by the run config (training/config.py) and the optimizer families' sections (mcore/family_configs.py),
so each knob is declared once, as one dataclass field that becomes one flag.
"""

from __future__ import annotations

from dataclasses import field
from typing import Optional

RANGES = {">=1": (lambda v: v >= 1, "must be >= 1"), ">=0": (lambda v: v >= 0, "must be >= 0"),
          ">0": (lambda v: v > 0, "must be > 0"), "[0,1)": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
          "(0,1]": (lambda v: 0 < v <= 1, "must be in (0, 1]"), "[0,1]": (lambda v: 0 <= v <= 1, "must be in [0, 1]")}


def opt(default, help: str, choices=None, nargs=None, valid: Optional[str] = None):
    """A config field: its default, help text, choices, and for numbers its valid range (``valid``: one of
    ``RANGES``), checked before any work starts with the flag named."""
    if valid is not None and valid not in RANGES:
        raise ValueError(f"unknown range {valid!r}; one of {list(RANGES)}")
    return field(default=default, metadata={"help": help, "choices": choices, "nargs": nargs, "valid": valid})
