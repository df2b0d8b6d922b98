"""Baselines computed once per pytest run: a straight run, a seed checkpoint, a checkpoint several cases resume from.

``shared_dir(key, make)`` calls ``make(path)`` the first time a key is asked for in this run and returns the same
directory to every later caller; the key holds the exact arguments and a digest of megatron_md's code, so a changed
argument or a changed line of the package never serves an old result. The key leaves out how the commands ran (the
pooled worlds or the real CLI, which tests/harness/test_pool.py shows give the same bits): a case marked e2e runs its
own commands through the CLI and may start from a baseline the pool made. The directory lives in
the run's temp dir and is made read-only once ``make`` returns: a case that wants to write into a shared
checkpoint (a resume that saves into its --load directory) must take ``writable_copy`` of it, and one that forgets
fails loudly instead of changing another case's baseline.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
ROOT: Path | None = None  # set by tests/conftest.py to <pytest's basetemp>/shared
_code: str | None = None
made: dict[str, float] = {}  # key -> seconds spent making it (reported at the end of the run)
hits: dict[str, int] = {}


def code_digest() -> str:
    """sha256 of every file of the package (cached for the run)."""
    global _code
    if _code is None:
        h = hashlib.sha256()
        for f in sorted((REPO / "megatron_md").rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(f.relative_to(REPO).as_posix().encode())
                h.update(f.read_bytes())
        _code = h.hexdigest()
    return _code


def _root() -> Path:
    global ROOT
    if ROOT is None:
        ROOT = Path(tempfile.mkdtemp(prefix="mdshared-"))
    return ROOT


def shared_dir(key: list, make: Callable[[Path], None], *, name: str = "") -> Path:
    """The directory ``make`` filled for ``key`` in this run (made now if it is the first ask)."""
    import time

    digest = hashlib.sha256(json.dumps([key, code_digest()], default=str).encode()).hexdigest()[:16]
    path = _root() / f"{name + '-' if name else ''}{digest}"
    if (path / ".done").exists():
        hits[path.name] = hits.get(path.name, 0) + 1
        return path
    if path.exists():  # a make that failed earlier in the run: start over
        _make_writable(path)
        shutil.rmtree(path)
    path.mkdir(parents=True)
    t0 = time.perf_counter()
    make(path)
    made[path.name] = time.perf_counter() - t0
    (path / ".done").write_text(json.dumps(key, default=str))
    _make_read_only(path)
    return path


def writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".done"))
    _make_writable(dst)
    return dst


def _make_read_only(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True) + [path]:
        mode = p.stat().st_mode
        p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _make_writable(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)


def summary() -> str:
    if not made:
        return ""
    saved = sum(hits.values())
    return (f"shared baselines: {len(made)} made in {sum(made.values()):.0f} s, reused {saved} time(s) "
            f"({ROOT})")


__all__ = ["shared_dir", "writable_copy", "code_digest", "summary"]
