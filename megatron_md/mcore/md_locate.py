"""Where MD's optimizers sit inside megatron's optimizer objects, and their weights' way back to the model.

The MD optimizers (``MegatronMD`` and Manifold Muon's subclass) are found inside megatron's chained, wrapped and
layer-wise optimizers; weights they project outside a step reach the model's params.
"""

from __future__ import annotations

import torch

from megatron_md.mcore import compat
from megatron_md.mcore.md_optimizer import MegatronMD
from megatron_md.mcore.optimizer_checkpoint import children


def md_wrappers(optimizer) -> list:
    """(megatron wrapper, MegatronMD) pairs inside chained / wrapped / layer-wise optimizers."""
    found, stack = [], [optimizer]
    while stack:
        o = stack.pop()
        for child in children(o):
            if isinstance(child, MegatronMD):
                found.append((o, child))
            else:
                stack.append(child)
    return found


def md_optimizers(optimizer) -> list[MegatronMD]:
    """Every MegatronMD inside megatron's optimizer objects."""
    if isinstance(optimizer, MegatronMD):
        return [optimizer]
    return [md for _, md in md_wrappers(optimizer)]


def sync_model_params(optimizer) -> None:
    """Push the optimizers' (projected) main params into the model params the forward uses.

    Needed whenever MD / Manifold Muon project weights outside a step (construction, weights-only loads):
    bf16 runs keep separate fp32 main params, and under the layer-wise distributed optimizer each DP rank
    projects only the matrices it owns, so the others must be broadcast (found by a layout test).
    """
    for o, _ in md_wrappers(optimizer):
        compat.copy_main_params_to_model_params(o)
    stack = [optimizer]
    while stack:
        o = stack.pop()
        if getattr(o, "dp_cp_params_list", None) is not None and hasattr(o, "broadcast_params"):
            o.broadcast_params()
        stack += children(o)


def md_state_bytes(optimizer) -> dict[str, int]:
    """Bytes of optimizer state this rank holds for MD / Manifold-Muon managed matrices.

    ``state``: every tensor in the MD optimizers' state (momentum or Adam moments, gains and their
    moments, manifold duals); ``matrices``: how many matrices that state belongs to.
    """
    total = count = 0
    for opt in md_optimizers(optimizer):
        for state in opt.state.values():
            tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
            if tensors:
                count += 1
                total += sum(t.numel() * t.element_size() for t in tensors)
    return {"state": total, "matrices": count}


def has_md(optimizer) -> bool:
    return bool(md_optimizers(optimizer))
