"""Every parameter tagged with its layout-independent name (``md_key``: global layer, global expert), which
checkpointed optimizer state, routing and the diagnostics key on whatever the TP/PP/EP layout (``naming.py``)."""

from __future__ import annotations

from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model

from megatron_md.mcore import compat, naming


def tag_params(model) -> None:
    """Give every parameter a layout-independent ``md_key`` (global layer, global expert).

    SequentialMLP's ``local_experts.{n}`` and TEGroupedMLP's ``linear_fc{1,2}.weight{n}`` both
    become ``local_experts.{ep_rank * local + n}.linear_fc{1,2}.weight`` (``mcore/naming.py``).
    """
    compat.install()  # so that megatron's bf16 master params keep these tags
    gpt = unwrap_model(model)
    layers = getattr(getattr(gpt, "decoder", None), "layers", [])
    ep_rank = ps.get_expert_model_parallel_rank()
    experts = getattr(gpt.config, "num_moe_experts", None)
    local = experts // ps.get_expert_model_parallel_world_size() if experts else None
    for name, p in gpt.named_parameters():
        p.md_key = naming.canonical_name(
            name, global_layer=lambda i: layers[i].layer_number - 1, ep_rank=ep_rank, num_local_experts=local
        )
        p.md_swiglu = naming.is_swiglu_fc1(p.md_key, gpt.config.gated_linear_unit)
