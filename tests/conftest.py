"""Shared fixtures: a single-process megatron-core world on the CPU runtime."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


@pytest.fixture
def mcore_world():
    """Yield after init of a world-1 gloo group, model-parallel state and seeds; tear down after."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_md.runtime import activate, cpu, select_runtime
    from megatron_md.runtime.distributed import destroy_distributed, init_distributed

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(k, None)
    rt = select_runtime("cpu")
    activate(rt)
    init_distributed(rt)
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    try:
        yield rt
    finally:
        ps.destroy_model_parallel()
        destroy_distributed()
        cpu.uninstall()
