"""Fixtures of the slurm/ tests: a fake two-node SLURM job (`job`)."""

from __future__ import annotations

import pytest


@pytest.fixture
def job(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("preset: tiny-dense\n")
    env = {
        "CONFIG": str(config),
        "SLURM_JOB_NODELIST": "node[07-08]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "dense-test",
        "PYTHON": "/opt/venv/bin/python",
    }
    return env, tmp_path
