"""Layout-independent names for megatron-core parameters: one key per matrix, whatever the layout.

Pure strings: no megatron import, no process groups (callers pass the EP rank and the local
expert count), so mcore/, training/ and convert/ all use it.

megatron-core 0.19 names a routed expert's matrices in two ways:

- ``SequentialMLP`` (local spec, or TE without ``--moe-grouped-gemm``):
  ``decoder.layers.{l}.mlp.experts.local_experts.{n}.linear_fc{1,2}.weight``;
- ``TEGroupedMLP`` (TE with ``--moe-grouped-gemm``): one 2-D parameter per local expert,
  ``decoder.layers.{l}.mlp.experts.linear_fc{1,2}.weight{n}`` (biases ``bias{n}``).

Both become ``decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc{1,2}.weight`` with the
global layer ``L`` and the global expert ``E = ep_rank * num_local_experts + n`` (what
megatron's own checkpoints use: TEGroupedMLP's sharded state dict is SequentialMLP's).

Packed layouts hold every local expert in one parameter: megatron's legacy ``GroupedMLP``
(``mlp.experts.weight1`` / ``weight2``; gone from megatron-core 0.19, whose local spec builds
``SequentialMLP`` whatever ``moe_grouped_gemm`` says) and TE's single grouped weight
(``moe_single_grouped_weight``: ``mlp.experts.linear_fc1.weight`` without an index). A
per-expert matrix there is a view into the packed one, which MD's per-matrix state (gains,
sphere, checkpoint keys) cannot follow; ``packed_experts`` finds them so MD can refuse them.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, NamedTuple

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
# The dot before "experts" keeps shared experts (``mlp.shared_experts.linear_fc1``) out.
_SEQUENTIAL = re.compile(r"(?:^|\.)experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_GROUPED = re.compile(r"(?:^|\.)experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_PACKED = re.compile(r"(?:^|\.)experts\.(?:weight[12]|linear_fc[12]\.(?:weight|bias))$")

GROUPED_GEMM_FIX = (
    "install Transformer Engine so --moe-grouped-gemm builds TEGroupedMLP (one weightN per expert), "
    "or pass --no-moe-grouped-gemm (SequentialMLP)"
)


class ExpertParam(NamedTuple):
    """A routed expert's parameter: its expert index (local or global), fc1/fc2, weight/bias."""

    expert: int
    fc: str  # "linear_fc1" | "linear_fc2"
    kind: str  # "weight" | "bias"
    grouped: bool  # TEGroupedMLP's ``weight{n}`` naming


def expert_param(name: str) -> ExpertParam | None:
    """The expert parameter named ``name`` (either naming), None for anything else."""
    m = _SEQUENTIAL.search(name)
    if m:
        return ExpertParam(int(m.group(1)), m.group(2), m.group(3), False)
    m = _GROUPED.search(name)
    if m:
        return ExpertParam(int(m.group(3)), m.group(1), m.group(2), True)
    return None


def is_packed_expert(name: str) -> bool:
    """A parameter holding every local expert at once (legacy GroupedMLP, TE single grouped weight)."""
    return bool(_PACKED.search(name))


def packed_experts(names: Iterable[str]) -> list[str]:
    return [n for n in names if is_packed_expert(n)]


def packed_experts_error(optimizer: str, names: list[str]) -> str:
    return (
        f"--optimizer {optimizer}: {names[0]}"
        f"{f' (and {len(names) - 1} more)' if len(names) > 1 else ''} packs every local expert into one "
        "parameter (megatron's legacy GroupedMLP or TE's single grouped weight); MD keeps gains, sphere "
        "and checkpoint state per expert matrix and cannot follow views into a packed one. "
        f"Fix: {GROUPED_GEMM_FIX}."
    )


def canonical_name(
    name: str,
    *,
    global_layer: Callable[[int], int] | None = None,
    ep_rank: int = 0,
    num_local_experts: int | None = None,
) -> str:
    """``name`` with the global layer and, for a routed expert, ``local_experts.{global expert}``.

    ``global_layer`` maps this stage's layer index to the global one (identity if None);
    the global expert is ``ep_rank * num_local_experts + local`` (the local index if
    ``num_local_experts`` is None). Names outside layers and experts are returned as they are.
    """
    key = name
    m = _LAYER.search(key)
    if m and global_layer is not None:
        key = key[: m.start()] + f"decoder.layers.{global_layer(int(m.group(1)))}." + key[m.end():]
    e = expert_param(key)
    if e is not None:
        index = e.expert + (ep_rank * num_local_experts if num_local_experts is not None else 0)
        m = _SEQUENTIAL.search(key) or _GROUPED.search(key)
        lead = "." if key[m.start()] == "." else ""
        key = key[: m.start()] + f"{lead}experts.local_experts.{index}.{e.fc}.{e.kind}"
    return key


def is_swiglu_fc1(canonical: str, gated_linear_unit: bool) -> bool:
    """Whether a matrix's rows are SwiGLU's (gate, up) halves: fc1 weights (dense, shared or routed experts)."""
    return bool(gated_linear_unit) and canonical.endswith("linear_fc1.weight") and not is_packed_expert(canonical)


def expert_names(layer_prefix: str, expert: int, fc: str, kind: str = "weight") -> tuple[str, str]:
    """(SequentialMLP name, TEGroupedMLP name) of one expert matrix under ``layer_prefix`` (``...layers.3.``)."""
    return (f"{layer_prefix}mlp.experts.local_experts.{expert}.{fc}.{kind}",
            f"{layer_prefix}mlp.experts.{fc}.{kind}{expert}")
