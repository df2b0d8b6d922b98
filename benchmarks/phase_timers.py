"""Per-phase timers for benchmarks/optimizer_step.py: where an optimizer step spends its time.

The timers wrap the inner optimizers' steps, msign and (muon_md) each MD phase by patching the
functions for the duration of the measurement only.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict


def inner_optimizers(optimizer) -> list:
    """(megatron wrapper, torch optimizer) for every optimizer inside a ChainedOptimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    wrappers = list(chained) if chained else [optimizer]
    return [(w, w.optimizer) for w in wrappers]


# ----------------------------------------------------------------------------- phase timers

class PhaseTimers:
    """Inclusive wall time per name, accumulated over calls; patches are undone on exit."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list = []

    def wrap(self, fn, name):
        totals, calls = self.totals, self.calls

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[name] += time.perf_counter() - t0
                calls[name] += 1

        return timed

    def patch(self, owner, attr: str, name: str) -> None:
        orig = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        had_own = isinstance(owner, type) or attr in getattr(owner, "__dict__", {})
        setattr(owner, attr, self.wrap(getattr(owner, attr), name))
        self._undo.append((owner, attr, orig, had_own))

    def undo(self) -> None:
        while self._undo:
            owner, attr, orig, had_own = self._undo.pop()
            if had_own:
                setattr(owner, attr, orig)
            else:
                delattr(owner, attr)


# (label, attribute of megatron_md.optim.md) timed inside md_prepare / md_finish_; they do not nest in
# each other (msign runs in the engine, between the two phases).
MD_PHASES = (
    ("current_gains (phi)", "current_gains"),
    ("gain_grads_fused", "gain_grads_fused"),
    ("direction_grad", "direction_grad"),
    ("recover_direction", "recover_direction"),
    ("blocks_sphere_scale (sphere norms)", "blocks_sphere_scale"),
    ("adam_ (gains)", "adam_"),
)
# (label, attribute of megatron_md.optim.md_batched): the same phases on stacks of same-shape matrices (the
# default path; md.py's functions above then run only for configurations it leaves to them).
BATCHED_PHASES = (
    ("sphere norms (stacked)", "sphere_scale_stacked"),
    ("gains' Adam (foreach, all stacks)", "update_gains_"),
)
# (label, class of megatron_md.optim.bases, method) timed inside the same two phases.
BASE_PHASES = (("MuonBase.direction (momentum)", "MuonBase", "direction"),
               ("MuonBase.descend_ (scaled step)", "MuonBase", "descend_"),
               ("AdamBase.direction (moments)", "AdamBase", "direction"),
               ("AdamBase.descend_ (step)", "AdamBase", "descend_"))


def _md_role(p) -> str:
    key = getattr(p, "md_key", "") or ""
    if "word_embeddings" in key:
        return "embedding"
    if "output_layer" in key:
        return "output"
    if "router" in key:
        return "router"
    return "hidden"


@contextlib.contextmanager
def phase_timers(subject):
    """Patch timers around the inner optimizers' steps, msign, and (muon_md) the MD phases."""
    t = PhaseTimers()
    try:
        for _, inner in inner_optimizers(subject.optimizer):
            t.patch(inner, "step", f"inner step: {type(inner).__name__}")
        if subject.name == "muon_md":
            import megatron_md.optim.bases as bases
            import megatron_md.optim.md as md
            import megatron_md.optim.md_batched as md_batched
            import megatron_md.optim.md_optimizer as mdo
            from megatron_md.parallel.orthogonalize import OrthogonalizationEngine

            for fn in ("md_prepare", "md_finish_"):
                orig = getattr(mdo, fn)

                def by_role(p, *a, _orig=orig, _fn=fn, **k):
                    return t.wrap(_orig, f"{_fn} [{_md_role(p)}]")(p, *a, **k)

                setattr(mdo, fn, by_role)
                t._undo.append((mdo, fn, orig, True))
            for fn, label, role_of in (("prepare", "md_prepare", lambda a: a[0][0]),
                                       ("descend_", "md_finish_", lambda a: a[1].params[0]),
                                       ("write_", "md_finish_", lambda a: a[0][0])):
                orig = getattr(md_batched, fn)

                def by_role_stacked(*a, _orig=orig, _label=label, _role=role_of, **k):
                    return t.wrap(_orig, f"{_label} [{_md_role(_role(a))}]")(*a, **k)

                setattr(md_batched, fn, by_role_stacked)
                t._undo.append((md_batched, fn, orig, True))
            for label, attr in MD_PHASES:
                t.patch(md, attr, label)
            for label, attr in BATCHED_PHASES:
                t.patch(md_batched, attr, label)
            for label, cls, attr in BASE_PHASES:
                t.patch(getattr(bases, cls), attr, label)
            t.patch(OrthogonalizationEngine, "run", "engine.run (gather, msign, scatter)")
            t.patch(OrthogonalizationEngine, "_compute", "msign")
        elif subject.name == "muon":
            import megatron.core.optimizer.emerging_optimizers as eo

            t.patch(eo, "newton_schulz_tp", "msign")
        yield t
    finally:
        t.undo()


def phase_breakdown(subject, steps: int) -> dict:
    """Per-step seconds of each phase (mean over ``steps`` extra steps) and derived remainders."""
    with phase_timers(subject) as t:
        totals = [subject.timed_step() for _ in range(steps)]
    per = {k: v / steps for k, v in t.totals.items()}
    calls = {k: v // steps for k, v in t.calls.items()}
    step_s = statistics.fmean(totals)
    rows = []

    def add(name, seconds, derived=False):
        rows.append({"name": name, "seconds": seconds, "share": seconds / step_s if step_s else 0.0,
                     "calls": calls.get(name), "derived": derived})

    inner = {k: v for k, v in per.items() if k.startswith("inner step: ")}
    for k, v in inner.items():
        add(k, v)
    add("megatron wrapper (grad norm, clipping)", step_s - sum(inner.values()), derived=True)
    if "msign" in per:
        add("msign", per["msign"])
    if subject.name == "muon_md":
        md_total = 0.0
        for k in sorted(per):
            if k.startswith(("md_prepare [", "md_finish_ [")):
                add(k, per[k])
                md_total += per[k]
        children = 0.0
        for label in [m[0] for m in MD_PHASES + BATCHED_PHASES] + [b[0] for b in BASE_PHASES]:
            if label in per:
                add(label, per[label])
                children += per[label]
        engine = per.get("engine.run (gather, msign, scatter)", 0.0)
        add("engine.run (gather, msign, scatter)", engine)
        add("md phases rest (casts, weight write, dispatch)", md_total - children, derived=True)
        add("MegatronMD.step outside the phases and engine (group loop, hp parsing)",
            inner.get("inner step: MegatronMD", 0.0) - md_total - engine, derived=True)
        add("MD overhead (MD step minus msign)", inner.get("inner step: MegatronMD", 0.0) - per.get("msign", 0.0),
            derived=True)
    elif subject.name == "muon":
        muon = inner.get("inner step: TensorParallelMuon", 0.0)
        add("TensorParallelMuon.step minus msign (momentum, split, scale, update)", muon - per.get("msign", 0.0),
            derived=True)
    return {"steps": steps, "step_s": step_s, "phases": rows}


