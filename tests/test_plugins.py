"""--plugin: an optimizer variant in the user's own file (a sign-of-momentum MD base, written here) trains, plans,
sweeps and resumes bit for bit under the distributed optimizer in bf16 at DP2, trains at TP2 as at TP1 and takes
the batched step, without a change to the package."""

from __future__ import annotations

import os

import pytest

from mdtest import QUIET, md_seed, run_cli, train_records

PLUGIN = '''
import os
from dataclasses import dataclass

import torch

from megatron_md.fields import opt
from megatron_md.optim.bases import BaseUpdate, sign_scale
from megatron_md.optim.blocks import add_block_, get_block
from megatron_md.plugins import register_md_base


@dataclass
class SignConfig:
    sign_beta: float = opt(0.9, "sign_md: EMA factor of the momentum whose sign is the step.", valid="[0,1)")


class SignBase(BaseUpdate):
    """The sign of an EMA momentum of the direction gradient, scaled like Lion's."""

    state_layout = (0, 1, False)
    section, section_name = SignConfig, "sign"  # its own flag, --sign-beta
    stacks = True  # elementwise and per block: the batched engine may run it on stacks of same-shape matrices

    def __init__(self, options=None):
        super().__init__(options)
        if os.environ.get("SIGN_PLUGIN_SAYS"):  # the test reads which value reached the optimizer
            with open(os.environ["SIGN_PLUGIN_SAYS"], "a") as f:
                f.write(f"{self.options.sign_beta}\\n")

    def init_state(self, p, state):
        state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def direction(self, g_hat, state, hp, scratch=None):
        buf = state["momentum_buffer"]
        buf.lerp_(g_hat, 1.0 - self.options.sign_beta)
        return torch.sign(buf)

    def descend_(self, W_hat, direction, state, hp, blocks, orthogonalized, reducer=None):
        for blk in blocks:
            add_block_(W_hat, blk, get_block(direction, blk), -hp.lr * sign_scale(blk.shape) * hp.radius_scale)


register_md_base("sign_md", SignBase, "MD with the sign of the momentum as the step")
'''


@pytest.fixture
def plugin_env(tmp_path):
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "sign_plugin.py").write_text(PLUGIN)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "plug"), os.environ.get("PYTHONPATH")]))}


@pytest.mark.multirank
@pytest.mark.e2e
def test_a_plugin_base_trains_and_resumes_bit_for_bit(tmp_path, plugin_env):
    """(e2e: the real CLI and torchrun: each rank imports the plugin from the same flags.)"""
    base = ["train", "--plugin", "sign_plugin", "--optimizer", "sign_md", "--model", "tiny-dense", "--mock-data",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
            "--log-interval", "1", "--eval-iters", "0", "--nproc-per-node", "2", "--use-distributed-optimizer",
            "--bf16", "--matrix-lr", "0.02", *QUIET]

    def losses(name, *extra):
        run_cli([*base, *extra, "--run-dir", str(tmp_path / name)], via="cli", env=plugin_env)
        return [r["lm_loss"] for r in train_records(tmp_path / name)]

    straight = losses("straight")
    assert len(straight) == 4 and straight[-1] < straight[0]
    ck = tmp_path / "ck"
    first = losses("first", "--exit-interval", "2", "--save", str(ck))
    assert first + losses("second", "--load", str(ck), "--save", str(ck)) == straight


def test_a_plugin_is_an_optimizer_choice_everywhere(tmp_path, plugin_env):
    help_text = run_cli(["train", "--plugin", "sign_plugin", "--help"], via="cli", env=plugin_env).stdout
    assert "sign_md: MD with the sign of the momentum as the step" in help_text
    assert "--sign-beta SIGN_BETA" in help_text  # the base's own section made its flag
    out_of_range = run_cli(["train", "--plugin", "sign_plugin", "--optimizer", "sign_md", "--model", "tiny-dense",
                            "--mock-data", "--sign-beta", "1.5"], via="cli", env=plugin_env, check=False)
    assert out_of_range.returncode == 2 and "--sign-beta must be in [0, 1), got 1.5" in out_of_range.stderr
    plan = run_cli(["plan", "--plugin", "sign_plugin", "--optimizer", "sign_md", "--model", "tiny-dense"], via="cli",
                   env=plugin_env).stdout
    assert "optimizer:" in plan
    sweep = run_cli(["lr-sweep", "--model", "tiny-dense", "--widths", "32", "--optimizers", "sign_md", "--lrs", "1",
                     "--out", str(tmp_path / "o"), "--dry-run", "--", "--plugin", "sign_plugin", "--mock-data"],
                    via="cli", env=plugin_env).stdout
    assert "--optimizer sign_md " in sweep and "--matrix-lr 0.064" in sweep and "--plugin sign_plugin" in sweep
    bad = run_cli(["train", "--plugin", "no_such_plugin", "--model", "tiny-dense"], via="cli", check=False)
    assert bad.returncode == 2 and "--plugin no_such_plugin: cannot import it" in bad.stderr
    unknown = run_cli(["train", "--optimizer", "sign_md", "--model", "tiny-dense", "--mock-data"], via="cli",
                      check=False)  # without the plugin the name is unknown, said by argparse
    assert unknown.returncode == 2 and "invalid choice: 'sign_md'" in unknown.stderr


@pytest.mark.multirank
def test_a_plugin_base_trains_at_tp2_as_at_tp1(tmp_path, plugin_env):
    """From the layout tests' seed (same weights at every layout), the plugin's losses at TP2 equal TP1's to
    rel 1e-5: its blocks' global shapes and the sphere's sums reach it through the package's TP glue. Its own flag
    (--sign-beta 0.8) reaches the optimizer on every rank."""
    seed = md_seed("tiny-dense")
    base = ["train", "--plugin", "sign_plugin", "--optimizer", "sign_md", "--model", "tiny-dense", "--mock-data",
            "--pretrained-checkpoint", str(seed), "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0",
            "--matrix-lr", "0.02", "--sign-beta", "0.8", *QUIET]

    def losses(name, *extra):
        says = tmp_path / f"{name}.says"
        run_cli([*base, *extra, "--run-dir", str(tmp_path / name)], via="cli",
                env={**plugin_env, "SIGN_PLUGIN_SAYS": str(says)})
        assert says.read_text().split() == ["0.8"] * (2 if extra else 1)  # one optimizer per rank
        return [r["lm_loss"] for r in train_records(tmp_path / name)]

    tp1 = losses("tp1")
    tp2 = losses("tp2", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2")
    assert len(tp1) == 3 and tp1[-1] < tp1[0]
    assert tp2 == pytest.approx(tp1, rel=1e-5)


def test_a_plugin_base_takes_the_batched_step(monkeypatch):
    """``stacks = True`` is all the plugin says: the engine stacks its same-shape matrices and calls its own update,
    equal to its per-matrix step (to fp32 rounding)."""
    import torch

    import megatron_md.plugins
    from megatron_md.optim.md_optimizer import MDOptimizer, md_options

    registered = {}
    monkeypatch.setattr(megatron_md.plugins, "register_md_base", lambda name, base, _: registered.update({name: base}))
    exec(PLUGIN, {})  # the plugin's class, without touching the process's registries
    cls = registered["sign_md"]
    base = lambda: cls(cls.section(sign_beta=0.8))  # noqa: E731 (the API takes the section object)

    def run(per_matrix):
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(32, 16, generator=gen)) for _ in range(3)]
        ps.append(torch.nn.Parameter(torch.randn(48, 16, generator=gen)))
        ps[-1].qkv_split_shapes = (16, 16, 16)  # a fused QKV matrix: the blocks' helpers on a stack
        opt = MDOptimizer(ps, dict(lr=0.02, gains_lr=0.05, **md_options({})), base())
        opt.per_matrix = per_matrix
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return ps, opt

    out, opt = run(False)
    ref, ref_opt = run(True)
    assert opt._slabs and not ref_opt._slabs
    for p, q in zip(out, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])
