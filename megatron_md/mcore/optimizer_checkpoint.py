"""Around a torch_dist save and load: what megatron-core 0.19's optimizers need that they do not do themselves.

megatron-core 0.19's ``DistributedOptimizer`` builds its loading state dict from the inner optimizer's
own ``state_dict()``. Without Apex or Transformer Engine (any CPU run, and GPU installs without
either) the inner optimizer is ``torch.optim.AdamW``, whose state is empty until its first step, so
``state_dict`` fails at ``assert len(steps) == 1``: a resumed run could not load an Adam checkpoint
with ``--use-distributed-optimizer``. ``prepare_for_load`` gives such optimizers the state layout a
step would have made (zeros and step 0); the load then overwrites every value but one: megatron's
per-parameter state copy also copies the in-memory ``step`` over the restored one (into a tensor
shared by every parameter), so the resumed AdamW restarted its bias correction at step 1 and drifted
from the straight run at its second step. ``after_load`` sets each parameter's own ``step`` from the
loaded param group, where megatron keeps the saved value.
"""

from __future__ import annotations

from typing import Iterator

import torch
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
from megatron.core.optimizer import distrib_optimizer as _distrib
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

from megatron_md.mcore import compat


def children(o) -> list:
    """The optimizers directly inside a megatron chained / wrapped optimizer."""
    chained = getattr(o, "chained_optimizers", None)
    if chained:  # ChainedOptimizer.optimizer asserts when it holds several
        return list(chained)
    inner = o.__dict__.get("optimizer")
    return [inner] if inner is not None and inner is not o else []


def walk(optimizer) -> Iterator:
    """Every optimizer object inside megatron's chained / wrapped / layer-wise optimizers."""
    stack = [optimizer]
    while stack:
        o = stack.pop()
        yield o
        stack += children(o)


def byte_sharded_optimizers(optimizer) -> int:
    """How many of megatron's byte-sharded DistributedOptimizers hold part of this optimizer's state."""
    return sum(isinstance(o, _distrib.DistributedOptimizer) for o in walk(optimizer))


def has_byte_sharded_state(optimizer) -> bool:
    return byte_sharded_optimizers(optimizer) > 0


def prepare_for_load(optimizer) -> int:
    """Allocate torch-AdamW state in megatron's distributed optimizers that have not stepped yet.

    Returns how many inner optimizers were prepared. A no-op where Apex or TE provide the Adam kernel
    (megatron reads the step from the param groups there) or where the state already exists.
    """
    if compat.get("HAVE_APEX_OR_TE"):
        return 0
    prepared = 0
    for o in walk(optimizer):
        if not isinstance(o, _distrib.DistributedOptimizer):
            continue
        inner = o.optimizer
        if len(inner.state) > 0 or not any(g["params"] for g in inner.param_groups):
            continue
        o.init_state_fn(inner, o.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))
        prepared += 1
    for o in walk(optimizer):
        if isinstance(o, _distrib.DistributedOptimizer) and not getattr(o, "md_step_tolerant", False):
            _tolerate_missing_step(o)
    return prepared


def _tolerate_missing_step(o) -> None:
    """The 'fully_reshardable' load hands megatron's per-parameter copy no ``step`` (it keeps the step in
    the param groups) while torch AdamW's state has one, so the copy raised ``KeyError: 'step'``; mark it
    absent (megatron skips non-tensors) and let ``after_load`` restore it."""
    def tolerant(copy_states):
        def set_states(model_param, tensors):
            return copy_states(model_param, tensors if "step" in tensors else {**tensors, "step": None})
        return set_states

    compat.wrap_set_main_param_and_optimizer_states(o, tolerant)
    o.md_step_tolerant = True


def after_load(optimizer) -> None:
    """Each parameter of megatron's torch-AdamW distributed optimizer gets its own, restored ``step``."""
    if compat.get("HAVE_APEX_OR_TE"):
        return
    for o in walk(optimizer):
        if not isinstance(o, _distrib.DistributedOptimizer):
            continue
        for group in o.optimizer.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in o.optimizer.state.get(p, {}):
                    o.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))


def layer_wise_groups_from_config(optimizer, sharded: dict) -> dict:
    """Keep the layer-wise optimizer's param groups out of the checkpoint (in place; returns ``sharded``).

    megatron groups expert matrices apart only when EP > 1, so the number of groups, saved in the
    checkpoint's common state, depended on the layout, and loading an EP2 checkpoint at EP1 failed in
    dist_checkpointing's merge ("Cannot merge two lists with different lengths"). Everything in those
    groups comes from the run's config and the LR schedule (restored with the scheduler), and the
    per-matrix state is saved by parameter name, so the current groups serve at any layout.
    """

    def strip(child_sd: dict) -> None:
        groups = child_sd.get("optimizer", {}).get("param_groups")
        if isinstance(groups, list):
            child_sd["optimizer"]["param_groups"] = LocalNonpersistentObject([
                {**g, "params": g["params"].unwrap() if isinstance(g["params"], LocalNonpersistentObject) else g["params"]}
                for g in groups
            ])

    def visit(o, sd) -> None:
        chained = getattr(o, "chained_optimizers", None)
        if chained is None:
            return
        children = [sd] if len(chained) == 1 else [sd[i] for i in range(len(chained))]
        for child, child_sd in zip(chained, children):
            if isinstance(o, LayerWiseDistributedOptimizer):
                strip(child_sd)
            else:
                visit(child, child_sd)

    visit(optimizer, sharded)
    return sharded
