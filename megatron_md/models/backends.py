"""Which layer implementation and attention kernel a run builds, decided from its config alone.

Kept apart from the model builder, which imports megatron-core: ``megatron-md train`` checks these in the launching
process, before any rank starts, and that process then needs neither megatron-core nor a model (a multi-rank
launch starts about 3 s sooner on 2 CPU cores).
"""

from __future__ import annotations

import warnings


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE raises more than ImportError when its CUDA libraries are missing
        return False
    return True


def use_transformer_engine(impl: str, cpu: bool) -> bool:
    if impl == "local" or cpu:
        if impl == "transformer_engine" and cpu:
            raise ValueError(
                "--transformer-impl transformer_engine needs CUDA; use --transformer-impl local "
                "(or auto) with --device cpu"
            )
        return False
    if impl == "transformer_engine":
        if not transformer_engine_available():
            raise ValueError(
                "--transformer-impl transformer_engine: transformer_engine does not import; "
                "install the 'gpu' extra (pip install 'megatron-md[gpu]') or use --transformer-impl local"
            )
        return True
    return transformer_engine_available()


def resolved_attention_backend(model_cfg, *, cpu: bool, use_te: bool) -> str:
    """--attention-backend as the run builds it, auto resolved: TE's choice ("auto") under TE layers, "sdpa"
    with the local spec. Refuses a backend the layer spec cannot build, before any layer is built."""
    name = model_cfg.attention_backend
    if name in ("flash", "fused") and (cpu or not use_te):
        raise ValueError(
            f"--attention-backend {name} is a Transformer Engine kernel and needs CUDA with TE layers; "
            "use --attention-backend sdpa (torch's fused attention), local (megatron-core's own) or auto"
        )
    if name in ("local", "sdpa") and use_te:
        raise ValueError(
            f"--attention-backend {name} plugs into megatron-core's local layer spec, which Transformer Engine "
            "layers replace; add --transformer-impl local, or pick flash, fused, unfused or auto for TE"
        )
    if name == "auto":
        return "auto" if use_te else "sdpa"
    return name


def moe_grouped_gemm(model_cfg, use_te: bool, warn: bool = True) -> bool:
    """Whether routed experts use grouped GEMM: unset means on exactly when TE builds the layers.

    In megatron-core 0.19 grouped GEMM means TE's ``TEGroupedMLP`` (one ``weight{n}`` per local
    expert); the legacy non-TE ``GroupedMLP`` is gone and the local spec builds ``SequentialMLP``
    either way, so ``--moe-grouped-gemm`` without TE is turned off, with a warning.
    """
    m = model_cfg
    if not m.num_experts or m.moe_grouped_gemm is False:
        return False
    if not use_te:
        if m.moe_grouped_gemm and warn:
            warnings.warn(
                "--moe-grouped-gemm needs Transformer Engine (TEGroupedMLP); without it megatron-core builds "
                "SequentialMLP experts, so grouped GEMM is off. Install the 'gpu' extra, or pass "
                "--no-moe-grouped-gemm to silence this.",
                stacklevel=2,
            )
        return False
    return True
