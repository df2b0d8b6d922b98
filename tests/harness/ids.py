"""Nothing dropped: every test id of the suite as it was before it was made faster (baseline_ids.txt) must still be
collected, under its name or under the new name RENAMED gives it.

tests/conftest.py calls ``missing()`` when a run collects the whole suite (no paths or ids named), before markers
deselect anything, and stops the run with the list when it is not empty.
"""

from __future__ import annotations

from pathlib import Path

BASELINE = Path(__file__).resolve().parent / "baseline_ids.txt"

# old id -> new id, for a test renamed or moved since the baseline (its assertions kept)
RENAMED: dict[str, str] = {}


def baseline() -> list[str]:
    return [ln.strip() for ln in BASELINE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def missing(collected: set[str]) -> list[str]:
    return [old for old in baseline() if RENAMED.get(old, old) not in collected]
