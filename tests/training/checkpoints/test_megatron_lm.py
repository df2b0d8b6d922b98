"""Megatron-LM's own torch_dist checkpoints load: weights, iteration, and Adam's state bit for bit.

The checkpoint is written by the test: a 4-step run of ours (tiny-dense, distributed Adam, fp32) saves at step 2,
and ``_megatron_lm_writer.py`` re-saves that state in the layout of Megatron-LM's ``generate_state_dict`` and
``save_checkpoint``
(https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/megatron/training/checkpointing.py):
its ``args`` Namespace, ``checkpoint_version`` 3.0, ``iteration``,
``num_floating_point_operations_so_far``, ``opt_param_scheduler``, ``model.*``, ``optimizer.*`` and its
``rng_state`` object, the content metadata and ``latest_checkpointed_iteration.txt`` (the writer's docstring lists
what it leaves out). Then:

- ``--pretrained-checkpoint`` of it gives the same first loss as our own checkpoint of the same weights, another
  than a fresh model's, and the same within rel 1e-5 at TP2 (torch_dist reshards; TP changes the arithmetic);
- ``--load`` of it continues the straight run bit for bit (steps 3 and 4: the Adam moments and the LR schedule
  were read), and with ``--no-load-optim`` step 3 is still equal but step 4 is not;
- a run of another architecture is refused before it starts (exit 2), naming each field with both values, and
  Adam's state is refused for a run whose optimizer holds it in another form;
- ``megatron-md convert megatron-lm`` writes our checkpoint with a run_config.yaml from the saved args, which
  loads as the original does.
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from mdtest import QUIET, run_cli, run_tool, train_records

pytestmark = pytest.mark.multirank

MODEL = ["--model", "tiny-dense", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "1", *QUIET]
ADAM = [*MODEL, "--optimizer", "adam", "--use-distributed-optimizer", "--lr-warmup-iters", "1",
        "--lr-decay-style", "cosine", "--train-iters", "4"]
ONE_STEP = [*MODEL, "--lr-decay-style", "constant", "--train-iters", "1"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{straight: run dir of 4 steps, ours: our checkpoint of step 2 alone, mlm: Megatron-LM's of step 2}."""
    d = tmp_path_factory.mktemp("megatron_lm")
    run_cli(["train", *ADAM, "--save", str(d / "src"), "--save-interval", "2", "--run-dir", str(d / "straight")])
    run_tool("tests/training/checkpoints/_megatron_lm_writer.py",
             [json.dumps({"src": str(d / "src"), "iteration": 2, "out": str(d / "mlm")})])
    (d / "ours").mkdir()
    shutil.copytree(d / "src" / "iter_0000002", d / "ours" / "iter_0000002")
    (d / "ours" / "latest_checkpointed_iteration.txt").write_text("2\n")
    return {k: d / k for k in ("straight", "ours", "mlm")} | {"root": d}


def _losses(run_dir):
    return {r["iteration"]: r["lm_loss"] for r in train_records(run_dir)}


def test_pretrained_weights_load_at_tp1_and_tp2(ckpts, tmp_path):
    runs = {"mlm": ["--pretrained-checkpoint", str(ckpts["mlm"])],
            "ours": ["--pretrained-checkpoint", str(ckpts["ours"])],
            "fresh": [],
            "mlm_tp2": ["--pretrained-checkpoint", str(ckpts["mlm"]), "--nproc-per-node", "2",
                        "--tensor-model-parallel-size", "2"]}
    loss = {}
    for name, extra in runs.items():
        run_cli(["train", *ONE_STEP, *extra, "--run-dir", str(tmp_path / name)])
        loss[name] = _losses(tmp_path / name)[1]
    assert loss["mlm"] == loss["ours"] != loss["fresh"]
    assert loss["mlm_tp2"] == pytest.approx(loss["mlm"], rel=1e-5)
    log = (tmp_path / "mlm" / "train.log").read_text()
    assert "(Megatron-LM, weights only)" in log
    assert "a Megatron-LM checkpoint (iter_0000002" in log and "nothing was verified" in log


def test_load_continues_with_adam_state_bit_for_bit(ckpts, tmp_path):
    straight = train_records(ckpts["straight"])
    run_cli(["train", *ADAM, "--load", str(ckpts["mlm"]), "--run-dir", str(tmp_path / "resumed")])
    resumed = train_records(tmp_path / "resumed")
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in straight[2:]]  # bit-identical floats
    assert [r["lr"] for r in resumed] == [r["lr"] for r in straight[2:]]  # the scheduler's state was read
    assert resumed[0]["consumed_samples"] == straight[2]["consumed_samples"]
    run_cli(["train", *ADAM, "--load", str(ckpts["mlm"]), "--no-load-optim", "--run-dir", str(tmp_path / "fresh")])
    fresh = _losses(tmp_path / "fresh")
    assert fresh[3] == straight[2]["lm_loss"]  # the weights alone decide step 3's loss
    assert fresh[4] != straight[3]["lm_loss"]  # step 3's update needed the Adam moments


@pytest.mark.e2e
def test_another_architecture_or_optimizer_is_refused_by_name(ckpts, tmp_path):
    out = run_cli(["train", *ONE_STEP, "--pretrained-checkpoint", str(ckpts["mlm"]), "--hidden-size", "128",
                   "--num-query-groups", "4", "--no-qk-layernorm", "--run-dir", str(tmp_path / "a")], check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr
    assert "the Megatron-LM checkpoint iter_0000002 holds another model than this run builds" in err
    for field in ("hidden_size: checkpoint 64, this run 128 (--hidden-size)",
                  "num_query_groups: checkpoint 2, this run 4 (--num-query-groups",
                  "qk_layernorm: checkpoint True, this run False (--qk-layernorm)",
                  "ffn_hidden_size: checkpoint 256, this run 512 (--ffn-hidden-size)"):
        assert field in err, err[-3000:]
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    plain = [a for a in ADAM if a != "--use-distributed-optimizer"]
    out = run_cli(["train", *plain, "--load", str(ckpts["mlm"]), "--run-dir", str(tmp_path / "b")], check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "--use-distributed-optimizer: checkpoint True, this run False" in out.stderr
    assert "pass --no-load-optim (or use --pretrained-checkpoint)" in out.stderr


def test_convert_writes_our_checkpoint_and_run_config(ckpts, tmp_path):
    out = run_cli(["convert", "megatron-lm", "--load", str(ckpts["mlm"]), "--output", str(tmp_path / "conv")])
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["iteration"] == 2 and report["consumed_samples"] == 8
    cfg = yaml.safe_load((tmp_path / "conv" / "iter_0000002" / "run_config.yaml").read_text())
    m = cfg["model"]
    assert (m["num_layers"], m["hidden_size"], m["num_query_groups"], m["ffn_hidden_size"], m["swiglu"],
            m["normalization"], m["qk_layernorm"], m["disable_bias_linear"]) == (2, 64, 2, 256, True, "RMSNorm", True,
                                                                                True)
    assert cfg["parallel"]["use_distributed_optimizer"] is True and cfg["optimizer"]["lr"] == 1e-2
    assert (tmp_path / "conv" / "iter_0000002" / "checksums.json").exists()
    for name, src in (("conv", tmp_path / "conv"), ("ours", ckpts["ours"])):
        run_cli(["train", *ONE_STEP, "--pretrained-checkpoint", str(src), "--run-dir", str(tmp_path / name)])
    assert _losses(tmp_path / "conv") == _losses(tmp_path / "ours")


def test_a_megatron_bridge_checkpoint_is_refused_by_name(tmp_path):
    """Megatron-Bridge's checkpoints carry a run_config.yaml of their own (Hydra ``_target_`` entries): named, not
    read as ours."""
    from megatron_md.training.checkpoints.megatron_lm import NotMegatronLM, find

    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "iter_0000005" / "run_config.yaml").write_text("model:\n  _target_: megatron.bridge.GPTModelProvider\n")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(NotMegatronLM, match="is a Megatron-Bridge checkpoint"):
        find(tmp_path)
    assert find(tmp_path / "missing") is None
