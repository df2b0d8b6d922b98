"""Invalid settings fail before any work, with a message naming the flag and the fix."""

from __future__ import annotations

import pytest

from megatron_md.cli import main

MOCK = ["--mock-data", "--wandb-mode", "disabled"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "tiny-dense", "--nproc-per-node", "3", "--tensor-model-parallel-size", "3"],
         "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
        (["--model", "tiny-moe", "--nproc-per-node", "3", "--expert-model-parallel-size", "3"],
         "--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
        (["--model", "tiny-dense", "--nproc-per-node", "3", "--pipeline-model-parallel-size", "3"],
         "--num-layers 2 is not divisible by --pipeline-model-parallel-size 3"),
        (["--model", "tiny-dense", "--nproc-per-node", "2", "--micro-batch-size", "2",
          "--global-batch-size", "6"],
         "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2"),
        (["--model", "tiny-dense", "--nproc-per-node", "3", "--tensor-model-parallel-size", "2"],
         "world size 3 is not divisible by --tensor-model-parallel-size 2"),
        (["--model", "tiny-moe", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
         "requires --sequence-parallel"),
        (["--model", "tiny-dense", "--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        (["--model", "tiny-dense", "--optimizer", "muon", "--use-distributed-optimizer"], "add --bf16"),
        (["--model", "tiny-dense", "--optimizer", "muon_md", "--muon-tp-mode", "blockwise"],
         "--muon-tp-mode blockwise is megatron Muon's; muon_md orthogonalises whole matrices"),
        (["--model", "tiny-dense", "--optimizer", "manifold_muon", "--muon-tp-mode", "distributed"],
         "use layer_sharded (default) or duplicated"),
        (["--model", "tiny-dense", "--optimizer", "muon", "--muon-tp-mode", "layer_sharded"],
         "--muon-tp-mode layer_sharded is MD's and Manifold Muon's engine"),
        (["--model", "tiny-dense", "--optimizer", "manifold_muon", "--muon-num-ns-steps", "7"],
         "--muon-num-ns-steps applies to MD groups only and --geometry hetero has none"),
        (["--model", "tiny-dense", "--optimizer", "manifold_muon", "--md-ns-coefficients", "simple"],
         "--md-ns-coefficients applies to MD groups only"),
        (["--model", "tiny-dense", "--optimizer", "muon_md", "--muon-scale-mode", "unit_rms_norm"],
         "muon_md scales its update with --md-scale-mode"),
        (["--model", "tiny-dense", "--optimizer", "adam_md", "--muon-extra-scale-factor", "2"],
         "--muon-extra-scale-factor is megatron Muon's"),
        # MD options of the authors' code
        (["--model", "tiny-dense", "--optimizer", "adam", "--md-tangent-grad"],
         "--md-tangent-grad is an MD option"),
        (["--model", "tiny-dense", "--optimizer", "muon_md", "--md-preserve-init", "--md-gains", "none"],
         "--md-preserve-init keeps the initial norms in the gains"),
        (["--model", "tiny-dense", "--optimizer", "lion_md", "--md-preserve-init", "--md-sphere", "col",
          "--md-gains", "row"], "needs --md-gains rowcol or col"),
        (["--model", "tiny-dense", "--optimizer", "lion_md", "--lion-beta2", "1.0"], "--lion-beta2 must be in [0, 1)"),
        (["--model", "tiny-dense", "--optimizer", "soap_md", "--nproc-per-node", "2", "--tensor-model-parallel-size",
          "2"], "soap_md keeps Kronecker factors of whole matrices"),
        (["--model", "tiny-dense", "--optimizer", "manifold_muon", "--md-gains", "embed"],
         "manifold_muon groups matrices by role"),
    ],
)
def test_invalid_layouts_and_batches(capsys, args, needle):
    assert main(["train", *args, *MOCK]) == 2
    assert needle in capsys.readouterr().err


def test_unknown_preset(capsys):
    assert main(["train", "--model", "dense-9000b", *MOCK]) == 2
    assert "--model 'dense-9000b' is not a known preset" in capsys.readouterr().err


def test_missing_data(capsys, tmp_path):
    assert main(["train", "--model", "tiny-dense", "--wandb-mode", "disabled"]) == 2
    assert "--data-path" in capsys.readouterr().err
    tok = tmp_path / "m.model"
    tok.write_bytes(b"x")
    assert main(["train", "--model", "tiny-dense", "--data-path", str(tmp_path / "nope"),
                 "--tokenizer-model", str(tok)]) == 2
    err = capsys.readouterr().err
    assert "--data-path" in err and "nope" in err


def test_bad_yaml_key(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  hidden_sise: 64\n")
    assert main(["train", "--config", str(cfg), *MOCK]) == 2
    assert "unknown setting 'hidden_sise'" in capsys.readouterr().err


def test_save_dir_with_checkpoints_is_not_overwritten(capsys, tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10\n")
    assert main(["train", "--model", "tiny-dense", "--save", str(tmp_path), *MOCK]) == 2
    assert f"--save {tmp_path} already holds checkpoints" in capsys.readouterr().err


def test_cuda_requested_without_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from megatron_md.runtime import select_runtime

    with pytest.raises(ValueError, match="--device"):
        select_runtime("cuda")
