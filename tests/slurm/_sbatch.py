"""What the slurm/ tests share: the scripts' paths; running one in a bare environment; reading its commands."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "slurm"
PRETRAIN = SLURM / "pretrain.sbatch"
SWEEP = SLURM / "lr_sweep.sbatch"
EXAMPLE_GRID = SLURM / "grids" / "example_lr_sweep.tsv"
EXAMPLE_CONFIG = REPO / "examples" / "md_paper" / "dense-181m_muon_md.yaml"
BASH = shutil.which("bash") or "/bin/bash"
SCRIPTS = sorted(SLURM.glob("*.sbatch")) + sorted(SLURM.glob("*.sh"))


def run(script, args=(), env=None, bin_dir=None, cwd=None):
    """Run a script with only `env` set and PATH = bin_dir, so no real SLURM command is found."""
    full = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": str(bin_dir or "/nonexistent")}
    full.update(env or {})
    return subprocess.run(
        [BASH, str(script), *args], env=full, cwd=cwd, capture_output=True, text=True, timeout=30
    )


def lines(proc):
    """The printed commands, without the leading `export ...` line of the environment."""
    assert proc.returncode == 0, proc.stderr
    out = [shlex.split(line) for line in proc.stdout.splitlines()]
    return [c for c in out if c[:1] != ["export"]]


def exported(proc) -> dict:
    """The `export K=V ...` line a dry run prints first."""
    assert proc.returncode == 0, proc.stderr
    first = shlex.split(proc.stdout.splitlines()[0])
    assert first[0] == "export", proc.stdout
    return dict(w.split("=", 1) for w in first[1:])


def runs(cmds):
    """Drop the smoke step's commands (they run slurm/smoke.py)."""
    return [c for c in cmds if not any(w.endswith("slurm/smoke.py") or w == "--smoke" for w in c)]


def value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def split_torchrun(cmd):
    """(torchrun args, train args) of `[wrapper ...] python -m torch.distributed.run ... -m megatron_md.cli train ...`."""
    t = cmd.index("torch.distributed.run")
    assert cmd[t - 1] == "-m", cmd
    i = cmd.index("megatron_md.cli")
    assert cmd[i - 1] == "-m" and cmd[i + 1] == "train", cmd
    return cmd[t + 1:i - 1], cmd[i + 2:]
