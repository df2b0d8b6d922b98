"""Fixtures of the CPU-runtime tests: the bridges installed, a world of one process."""

from __future__ import annotations

import pytest

from megatron_md.runtime import cpu, select_runtime
from megatron_md.runtime.distributed import destroy_distributed, init_distributed


@pytest.fixture
def shim():
    cpu.install()
    try:
        yield
    finally:
        cpu.uninstall()


@pytest.fixture
def single_process(monkeypatch):
    """No launcher env: init_distributed takes its world-size-1 path even under torchrun."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def mp_world(shim, single_process):
    """World size 1 over gloo (via init_distributed) plus megatron's model-parallel state."""
    from megatron.core import parallel_state as ps

    init_distributed(select_runtime("cpu"), timeout_s=60)
    ps.initialize_model_parallel()
    try:
        yield ps
    finally:
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(force_reset=True)  # drop an inference tracker left by a test
        destroy_distributed()
