"""Count the payload bytes this process hands to torch.distributed collectives (benchmarks only).

Patches the collective functions of ``torch.distributed`` and every alias of them that loaded modules keep
(megatron binds ``dist_all_gather_func`` / ``dist_reduce_scatter_func`` at import), for the ``with`` block.
Payload = bytes of the tensor(s) a rank contributes: the input of all_reduce, all_gather(_into_tensor),
reduce_scatter(_tensor), broadcast (source only); for all_to_all_single the input less the part it keeps.
That is the quantity a rank must put on the wire at least once, the same measure for every optimizer.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
import torch.distributed as dist

_NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
          "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single", "all_to_all", "broadcast")


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(t) for t in x)
    return 0


def _payload(name: str, args: tuple, kwargs: dict) -> int:
    group = kwargs.get("group")
    if name == "all_to_all_single":
        inp = args[1]
        splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        if splits:
            per_row = inp.numel() // max(1, inp.shape[0]) if inp.ndim > 1 else 1
            return (sum(splits) - splits[rank]) * per_row * inp.element_size()
        return _bytes(inp) * (size - 1) // size
    if name == "broadcast":
        src = args[1] if len(args) > 1 else kwargs.get("src")
        return _bytes(args[0]) if dist.get_rank() == src else 0
    if name in ("all_reduce",):
        return _bytes(args[0])
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        return _bytes(args[1] if len(args) > 1 else kwargs.get("input_tensor") or kwargs.get("input_list"))
    # all_gather_into_tensor / reduce_scatter_tensor and their _base forms: (output, input)
    return _bytes(args[1] if len(args) > 1 else kwargs.get("input") or kwargs.get("input_tensor"))


class CommCounter:
    """``with CommCounter() as c: ...``; then ``c.summary()`` = {"bytes", "calls", "by_op": {op: [calls, bytes]}}."""

    def __init__(self):
        self.by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._undo: list[tuple] = []

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            entry = self.by_op[name]
            entry[0] += 1
            entry[1] += _payload(name, args, kwargs)
            return fn(*args, **kwargs)

        counted.__wrapped__ = fn
        return counted

    def __enter__(self) -> "CommCounter":
        originals = {name: getattr(dist, name) for name in _NAMES if hasattr(dist, name)}
        wrappers = {id(fn): self._wrap(name, fn) for name, fn in originals.items()}
        for mod in list(sys.modules.values()):
            if mod is None or not (getattr(mod, "__name__", "").startswith(("megatron", "torch.distributed"))
                                   or mod is dist):
                continue
            for attr, value in list(vars(mod).items()):
                if callable(value) and id(value) in wrappers:
                    self._undo.append((mod, attr, value))
                    setattr(mod, attr, wrappers[id(value)])
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            mod, attr, value = self._undo.pop()
            setattr(mod, attr, value)

    def summary(self) -> dict:
        return {"bytes": sum(b for _, b in self.by_op.values()), "calls": sum(c for c, _ in self.by_op.values()),
                "by_op": {k: list(v) for k, v in sorted(self.by_op.items())}}
