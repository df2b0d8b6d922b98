"""megatron-core's ``Timers`` for a run: the timers Megatron-LM users read, and ours beside them.

``--timing-log-level`` 0|1|2 and ``--timing-log-option`` max|minmax|all mean what they mean in Megatron-LM: one
``megatron.core.timers.Timers`` is handed to the model config (the schedules' ``forward-compute``,
``backward-compute``, the pipeline's send/recv, ``all-grads-sync``, ...) and to the OptimizerConfig
(``optimizer-inner-step``, ``optimizer-clip-main-grad``, ``params-all-gather``, ...). A timer above the level is
megatron-core's dummy: no clock, no synchronisation, so level 0 adds nothing to a step. A real timer synchronises
the device at start and stop (megatron-core's), as it does in Megatron-LM.

Ours, at the level of the megatron-core phase they sit in (NAMES): the MD step's three phases, the
orthogonalisation engine's waits for its all-to-alls, Manifold Muon's solve, QK-clip.
"""

from __future__ import annotations

import contextlib
from typing import Optional

# (name, level), in the order they are logged: megatron-core 0.19's (the levels it starts them at; the schedules
# time forward-backward themselves), Megatron-LM's batch-generator and optimizer (the trainer starts them), ours.
NAMES: tuple[tuple[str, int], ...] = (
    ("forward-backward", 1), ("forward-compute", 2), ("backward-compute", 2), ("batch-generator", 2),
    ("forward-recv", 2), ("forward-send", 2), ("backward-recv", 2), ("backward-send", 2),
    ("forward-send-forward-recv", 2), ("forward-send-backward-recv", 2), ("backward-send-forward-recv", 2),
    ("backward-send-backward-recv", 2), ("forward-backward-send-forward-backward-recv", 2),
    ("non-tensor-parallel-grads-all-reduce", 1), ("embedding-grads-all-reduce", 1), ("all-grads-sync", 1),
    ("params-all-gather", 1), ("optimizer-copy-to-main-grad", 1), ("optimizer-unscale-and-check-inf", 1),
    ("optimizer-clip-main-grad", 1), ("optimizer-count-zeros", 1), ("optimizer-inner-step", 1),
    ("optimizer-copy-main-to-model-params", 1), ("optimizer", 1),
    ("md-prepare", 2), ("md-orthogonalize", 2), ("md-finish", 2), ("ns-engine-comm-wait", 2),
    ("manifold-solve", 2), ("qk-clip", 1),
)
LEVEL = dict(NAMES)


def make_timers(level: int, option: str):
    """megatron-core's Timers at ``--timing-log-level`` / ``--timing-log-option``."""
    from megatron.core.timers import Timers

    return Timers(level, option)


@contextlib.contextmanager
def _span(timer):
    timer.start()
    try:
        yield
    finally:
        timer.stop()


def timed(timers, name: str):
    """``with timed(timers, name):`` times the block with megatron-core's timer ``name`` at its level (NAMES);
    above the run's level megatron-core hands back its dummy timer (no clock, no synchronisation)."""
    if timers is None:
        return contextlib.nullcontext()
    return _span(timers(name, log_level=LEVEL[name]))


def interval_report(timers, level: int, iterations: int) -> tuple[Optional[str], dict[str, float]]:
    """(megatron-core's timers text for the log, {'time/NAME': ms per iteration, the slowest rank}) over the last
    ``iterations`` steps, the timers reset; ``level``: the run's --timing-log-level. A collective: every rank calls
    it at the same iterations. Nothing (and no collective) at level 0."""
    if timers is None or level == 0:
        return None, {}
    names = [n for n, lv in NAMES if lv <= level]  # the same list on every rank (a timer never started reads 0)
    text = timers.get_all_timers_string(names, normalizer=max(iterations, 1), reset=False)
    import torch
    import torch.distributed as dist

    # each timer's time on this rank, reset, then the slowest rank's (one reduction); a name this rank never
    # started reads 0 (megatron-core's write() would do the same, but only into a SummaryWriter or wandb)
    mine = torch.tensor([timers(n, log_level=LEVEL[n]).elapsed(reset=True) for n in names], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return text, {f"time/{n}": 1000.0 * v / max(iterations, 1) for n, v in zip(names, mine.tolist()) if v > 0}
