"""Every shipped example config resolves and passes validation for a plausible world size."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_md.training.config import resolve
from megatron_md.training.validate import validate_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path, tmp_path):
    cfg = resolve(None, str(path), {"mock_data": True, "save": str(tmp_path / "ck")})
    p = cfg.parallel
    world = cfg.training.nproc_per_node
    world = max(world, p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.expert_model_parallel_size)
    validate_config(cfg, world)


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert "tiny_moe_cpu_demo.yaml" in names
    assert {f"{n}_muon_md.yaml" for n in ("dense-181m", "dense-307m", "dense-457m", "dense-827m", "dense-1.29b")} <= names
