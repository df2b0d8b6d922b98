"""The sweep grid: the sqrt(2) LR ladder, per-optimizer recipes and the cells' ``train`` flags.

LR ladder (the MD paper's): ``lr_k = 1e-3 * 2^(k/2)``. Which flag carries the swept LR:

| sweep name      | --optimizer     | swept flag     | fixed (recipe) LRs, unless the base config sets them |
| adamw           | adam            | --lr           | - (cosine decay, --adam-beta2 0.95)                   |
| muon            | muon            | --lr           | - (as adamw, and --muon-momentum 0.95 with Nesterov; megatron-core's Muon: --lr drives the Muon matrices *and* the Adam part) |
| muon_md/adam_md | muon_md/adam_md | --matrix-lr    | --lr 1e-3, --embedding-lr 3e-3 (paper)                |
| lion_md/soap_md | lion_md/soap_md | --matrix-lr    | --lr 1e-3, --embedding-lr 3e-3 (as MD's)              |
| manifold_muon   | manifold_muon   | --matrix-lr    | --lr 6e-4 (paper B's AdamW LR)                        |
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from megatron_md.training.config import setting

BASE_LR = 1e-3


def lr_of_k(k: float) -> float:
    return BASE_LR * 2.0 ** (k / 2.0)


def k_of_lr(lr: float) -> float:
    return 2.0 * math.log2(lr / BASE_LR)


def k_label(lr: float) -> Optional[int]:
    """The integer k of an LR on the ladder, else None."""
    k = k_of_lr(lr)
    return int(round(k)) if abs(k - round(k)) < 1e-6 else None


@dataclass(frozen=True)
class Recipe:
    optimizer: str  # the value of `train --optimizer`
    lr_field: str  # config field of the swept LR
    k_center: int  # default centre of --lrs N
    warmup_frac: float  # --lr-warmup-iters = round(frac * steps)
    weight_decay: float
    fixed: dict = field(default_factory=dict)  # other LRs and settings, applied when the base config leaves them unset


# Every --optimizer is sweepable: its family says how (mcore/families.py, sweep_recipe: the swept LR, the fallback
# centre used when the base config does not set that LR (see config_centers), warmup, weight decay, fixed
# settings). A GPU recipe carries its own LR (the md_paper recipes: --matrix-lr 1.13e-2, k 7), which is where a
# sweep of it should look. The project's `adam` is AdamW (decoupled weight decay): the sweep calls it adamw.
SWEEP_NAMES = {"adam": "adamw"}


def _recipes() -> dict[str, Recipe]:
    from megatron_md.mcore.families import FAMILIES

    out = {}
    for name, family in FAMILIES.items():
        r = family.sweep_recipe(name)
        out[SWEEP_NAMES.get(name, name)] = Recipe(name, r.lr_field, r.k_center, r.warmup_frac, r.weight_decay,
                                                  dict(r.fixed))
    return out


RECIPES: dict[str, Recipe] = _recipes()
ALIASES = {"adam": "adamw"}  # the project's `adam` is AdamW (decoupled weight decay)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class GridError(ValueError):
    """A bad sweep setting; the message names the flag."""


# ----------------------------------------------------------------------------- parsing


def parse_list(text: str, what: str, conv) -> list:
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    if not items:
        raise GridError(f"{what}: empty list")
    out = []
    for t in items:
        try:
            out.append(conv(t))
        except ValueError:
            raise GridError(f"{what}: cannot read {t!r}") from None
    return out


def parse_widths(text: str) -> list[int]:
    widths = parse_list(text, "--widths", int)
    bad = [w for w in widths if w <= 0]
    if bad:
        raise GridError(f"--widths: {bad[0]} is not a positive integer")
    return sorted(set(widths))


def parse_optimizers(text: str) -> list[str]:
    names = parse_list(text, "--optimizers", str)
    out = []
    for n in names:
        n = ALIASES.get(n, n)
        if n not in RECIPES:
            raise GridError(f"--optimizers: unknown optimizer {n!r}; choose from {', '.join(RECIPES)}")
        if n not in out:
            out.append(n)
    return out


def parse_seeds(text: str) -> list[int]:
    seeds = parse_list(text, "--seeds", int)
    if any(s < 0 for s in seeds):
        raise GridError("--seeds: seeds must be >= 0")
    return list(dict.fromkeys(seeds))


def parse_lrs(text: str):
    """``N`` (an integer: N ladder points around each optimizer's centre) or explicit LRs."""
    text = (text or "").strip()
    if re.fullmatch(r"\d+", text):
        n = int(text)
        if n < 1:
            raise GridError("--lrs: the number of LRs must be >= 1")
        return n
    lrs = parse_list(text, "--lrs", float)
    bad = [x for x in lrs if not (x > 0 and math.isfinite(x))]
    if bad:
        raise GridError(f"--lrs: {bad[0]} is not a positive learning rate")
    return sorted(set(lrs))


def _per_optimizer(items: list[str], what: str, conv) -> dict:
    out = {}
    for item in items or []:
        for part in item.split(","):
            if not part.strip():
                continue
            name, sep, value = part.partition("=")
            name = ALIASES.get(name.strip(), name.strip())
            if not sep or name not in RECIPES:
                raise GridError(f"{what}: expected OPT=VALUE with OPT one of {', '.join(RECIPES)}, got {part!r}")
            try:
                out[name] = conv(value.strip())
            except ValueError:
                raise GridError(f"{what}: cannot read {value!r} in {part!r}") from None
    return out


def parse_k_centers(items: list[str]) -> dict[str, int]:
    return _per_optimizer(items, "--k-center", int)


def parse_k_ranges(items: list[str]) -> dict[str, tuple[int, int]]:
    def conv(v: str):
        m = re.fullmatch(r"(-?\d+):(-?\d+)", v)
        if not m or int(m.group(1)) > int(m.group(2)):
            raise ValueError(v)
        return int(m.group(1)), int(m.group(2))

    return _per_optimizer(items, "--k-range (LO:HI integers, LO <= HI)", conv)


def parse_warmups(text: Optional[str]) -> Optional[list]:
    """Iterations (``10``) or fractions of the steps (``10%``)."""
    if text is None:
        return None

    def conv(t: str):
        if t.endswith("%"):
            v = float(t[:-1]) / 100.0
            if not 0 <= v <= 1:
                raise ValueError(t)
            return ("frac", v)
        v = int(t)
        if v < 0:
            raise ValueError(t)
        return ("iters", v)

    return parse_list(text, "--warmups", conv)


def parse_weight_decays(text: Optional[str]) -> Optional[list[float]]:
    if text is None:
        return None
    wds = parse_list(text, "--weight-decays", float)
    if any(w < 0 or not math.isfinite(w) for w in wds):
        raise GridError("--weight-decays: values must be >= 0")
    return wds


def config_centers(optimizers: list[str], cfg, explicit: set) -> dict[str, tuple[int, float]]:
    """Ladder centres from the base config's own LRs: optimizer -> (k, the config's LR).

    An optimizer gets one when the config trains with it (``optimizer:`` resolves to the recipe's
    ``--optimizer``) and sets its swept LR itself (``matrix_lr`` for the MD and manifold optimizers, ``lr``
    for adamw and muon): the centre is that LR's nearest ladder point. A config for another optimizer says
    nothing about this one's LR (an MD recipe's ``lr`` is its LM-head LR, not an AdamW LR), so that
    optimizer keeps its fallback ``Recipe.k_center``.
    """
    out = {}
    for opt in optimizers:
        r = RECIPES[opt]
        value = setting(cfg, r.lr_field)
        if cfg.optimizer.optimizer != r.optimizer or r.lr_field not in explicit or not value or value <= 0:
            continue
        out[opt] = (int(round(k_of_lr(value))), float(value))
    return out


def lr_grid(optimizer: str, lrs, centers: dict, ranges: dict, k_step: int = 1) -> list[float]:
    """The LRs of one optimizer: --k-range wins, then explicit --lrs, then N points on the ladder; ladder points
    ``k_step`` apart (2: factors of 2 in LR)."""
    if optimizer in ranges:
        lo, hi = ranges[optimizer]
        return [lr_of_k(k) for k in range(lo, hi + 1, k_step)]
    if isinstance(lrs, list):
        return list(lrs)
    c = centers.get(optimizer, RECIPES[optimizer].k_center)
    lo = c - ((lrs - 1) // 2) * k_step  # even N: one more point above the centre than below
    return [lr_of_k(lo + i * k_step) for i in range(lrs)]


# ----------------------------------------------------------------------------- cells


@dataclass
class Cell:
    optimizer: str
    width: int
    lr: float
    seed: int
    warmup: int
    weight_decay: float
    steps: int

    @property
    def k(self) -> Optional[int]:
        return k_label(self.lr)

    @property
    def name(self) -> str:
        k = self.k
        lr = f"k{k}" if k is not None else f"lr{self.lr:.6g}"
        return f"{self.optimizer}-w{self.width}-{lr}-s{self.seed}-wu{self.warmup}-wd{self.weight_decay:g}"

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.optimizer]


def _fmt(x: float) -> str:
    return repr(float(x))


@dataclass
class SweepSpec:
    """Everything that fixes the cells' commands."""

    base: list[str]  # ["--config", F] or ["--model", P]
    widths: list[int]
    optimizers: list[str]
    lrs: object  # int N or list of LRs
    seeds: list[int]
    steps: int
    k_centers: dict = field(default_factory=dict)  # --k-center, then the base config's LRs (config_centers)
    k_ranges: dict = field(default_factory=dict)
    k_step: int = 1
    warmups: Optional[list] = None
    weight_decays: Optional[list[float]] = None
    log_interval: Optional[int] = None
    extra: list[str] = field(default_factory=list)
    base_explicit: set = field(default_factory=set)  # config fields the base YAML sets
    notes: list = field(default_factory=list)  # said once before the sweep starts
    added: list = field(default_factory=list)  # cells beyond the grid's edges (--extend-edges)

    def cells(self) -> list[Cell]:
        out = []
        for opt in self.optimizers:
            r = RECIPES[opt]
            warmups = [_warmup_iters(w, self.steps) for w in self.warmups] if self.warmups else [
                int(round(r.warmup_frac * self.steps))]
            wds = self.weight_decays if self.weight_decays is not None else [r.weight_decay]
            for wu in dict.fromkeys(warmups):
                for wd in wds:
                    for width in self.widths:
                        for lr in lr_grid(opt, self.lrs, self.k_centers, self.k_ranges, self.k_step):
                            for seed in self.seeds:
                                out.append(Cell(opt, width, lr, seed, wu, wd, self.steps))
        names = {c.name for c in out}
        return out + [c for c in self.added if c.name not in names]

    def extend_edges(self, curves: dict) -> list[Cell]:
        """One more ladder point beyond each curve whose best LR (seed mean) is its lowest or highest.

        ``curves``: (optimizer, width, warmup, wd) -> [(lr, mean, ...)] of this sweep's own cells, points every
        seed ran (``results.sweep_curves``), so a rerun re-derives the same added cells (and skips them,
        finished) whatever else the directory holds. The new cells (every seed) are added to :meth:`cells`
        and returned; an empty list means every optimum is inside. A curve whose every LR diverged is left
        alone (no direction to go).
        """
        mine = {c.name for c in self.cells()}
        new = []
        for key, pts in sorted(curves.items()):
            best = min(range(len(pts)), key=lambda i: pts[i][1])
            if not math.isfinite(pts[best][1]):
                continue
            steps = ([-1] if best == 0 else []) + ([1] if best == len(pts) - 1 else [])
            k = k_label(pts[best][0])
            if k is None:
                continue  # an explicit LR off the ladder: nowhere defined to step to
            opt, width, wu, wd = key
            new += [Cell(opt, width, lr_of_k(k + s * self.k_step), seed, wu, wd, self.steps)
                    for s in steps for seed in self.seeds]
        new = [c for c in new if c.name not in mine]
        self.added += new
        return new

    def log_every(self) -> int:
        # ~50 records per run, so "the last 10% of logged losses" averages several points.
        return self.log_interval or max(1, self.steps // 50)

    def optimizer_flags(self, cell: Cell) -> list[str]:
        """--optimizer, the recipe's fixed LRs, the swept LR, warmup and weight decay."""
        r = cell.recipe
        out = ["--optimizer", r.optimizer]
        for name, value in r.fixed.items():
            if name not in self.base_explicit:
                out += ([flag(name) if value else flag("no_" + name)] if isinstance(value, bool)
                        else [flag(name), value if isinstance(value, str) else _fmt(value)])
        out += [flag(r.lr_field), _fmt(cell.lr), "--lr-warmup-iters", str(cell.warmup),
                "--weight-decay", _fmt(cell.weight_decay)]
        return out

    def train_args(self, cell: Cell, run_dir: Optional[Path] = None) -> list[str]:
        """The cell's `megatron-md train` flags (extra flags after ours: the later flag wins)."""
        args = [*self.base, *self.optimizer_flags(cell), "--hidden-size", str(cell.width),
                "--seed", str(cell.seed), "--train-iters", str(cell.steps),
                "--log-interval", str(self.log_every()), "--wandb-mode", "disabled", "--no-progress-bar",
                *self.extra]
        if run_dir is not None:
            args += ["--run-dir", str(run_dir)]
        return args


def _warmup_iters(w, steps: int) -> int:
    kind, v = w
    return int(round(v * steps)) if kind == "frac" else int(v)


# Flags the sweep sets per cell: a copy among the extra train flags would silently win over the grid.
OWNED = {
    "--hidden-size": "--widths", "--seed": "--seeds", "--train-iters": "--steps", "--run-dir": "--out",
    "--optimizer": "--optimizers", "--lr-warmup-iters": "--warmups", "--weight-decay": "--weight-decays",
    "--config": "--config (before --)", "--model": "--model (before --)",
}


def check_extra(extra: list[str], optimizers: list[str]) -> None:
    swept = {flag(RECIPES[o].lr_field): o for o in optimizers}
    for a in extra:
        name = a.split("=", 1)[0]
        if name in OWNED:
            raise GridError(f"{name} after '--': the sweep sets it per cell; use lr-sweep {OWNED[name]}")
        if name in swept:
            raise GridError(
                f"{name} after '--': it carries the swept LR of {swept[name]}; use --lrs/--k-range/--k-center")
