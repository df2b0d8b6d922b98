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
        # the options that need whole matrices, refused before launch on tensor-parallel shards
        (["--model", "tiny-dense", "--optimizer", "muon_md", "--md-sphere-kind", "orthogonal", "--nproc-per-node",
          "2", "--tensor-model-parallel-size", "2"], "--md-sphere-kind orthogonal takes the polar factor"),
        (["--model", "tiny-dense", "--optimizer", "adam_md", "--md-gains", "lowrank", "--nproc-per-node", "2",
          "--tensor-model-parallel-size", "2"], "--md-gains lowrank keeps factors of whole matrices"),
        (["--model", "tiny-dense", "--optimizer", "muon_md", "--md-split-heads-update", "--nproc-per-node", "2",
          "--tensor-model-parallel-size", "2"], "--md-split-heads-update orthogonalises each head"),
        (["--model", "tiny-dense", "--optimizer", "muon_md", "--md-sphere-kind", "spectral", "--md-sphere", "row"],
         "--md-sphere-kind spectral fixes a norm of the whole matrix: it needs --md-sphere flat"),
        (["--model", "tiny-dense", "--optimizer", "norm_md", "--md-preserve-init", "--md-sphere", "rowcol",
          "--md-gains", "row"], "needs --md-gains rowcol"),
        # a mistyped geometry, rule or missing auto threshold: one line before launch, not a traceback per rank
        (["--model", "tiny-dense", "--optimizer", "manifold_muon", "--geometry", "spherical", "--nproc-per-node", "2"],
         "--geometry: 'spherical' is neither a preset"),
        (["--model", "tiny-dense", "--optimizer", "manifold_muon", "--geometry", "mlp=dgarm"],
         "unknown geometry 'dgarm' for 'mlp'"),
        (["--model", "tiny-dense", "--optimizer", "manifold_muon", "--geometry", "auto:hetero"],
         "--geometry auto:hetero switches modules on thresholds"),
        (["--model", "tiny-dense", "--optimizer", "manifold_muon", "--geometry", "auto:hetero-md",
          "--geometry-auto-sigma-max", "2"], "--geometry auto:hetero-md: no module could switch"),
        # every MD optimizer builds the engine's Newton-Schulz settings: megatron Muon's TP modes refused up front
        (["--model", "tiny-dense", "--optimizer", "adam_md", "--muon-tp-mode", "blockwise"],
         "--muon-tp-mode blockwise is megatron Muon's; adam_md orthogonalises whole matrices"),
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


def _out_of_range(f) -> str:
    """A value just outside the field's declared range."""
    from megatron_md.training.config import _base_type

    bad = {">=1": 0, ">=0": -1, ">0": 0, "[0,1)": 1, "(0,1]": 0, "[0,1]": 1.5}[f.metadata["valid"]]
    return str(bad if _base_type(f.type) is int else float(bad))


def _numeric_fields():
    from megatron_md.training.config import FIELDS, _base_type

    return [(n, f) for n, (_, f) in FIELDS.items() if _base_type(f.type) in (int, float)]


def test_every_numeric_field_declares_its_range():
    assert [n for n, f in _numeric_fields() if not f.metadata.get("valid")] == []


@pytest.mark.parametrize("name,field", _numeric_fields(), ids=[n for n, _ in _numeric_fields()])
def test_an_out_of_range_value_is_refused_by_flag_before_work(capsys, name, field):
    """Every numeric flag, fed a value outside its range: exit 2 and a line naming the flag first (sizes derived
    from it, e.g. heads from --hidden-size 0, may follow), no traceback."""
    flag = "--" + name.replace("_", "-")
    model = "tiny-moe" if "moe" in name or name == "num_experts" else "tiny-dense"
    assert main(["train", "--model", model, *MOCK, flag, _out_of_range(field)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip().startswith("- ")]
    assert any(ln.strip().startswith(f"- {flag} must be") for ln in lines) and "Traceback" not in err, err


def _fake_checkpoint(root, **model):
    """The files the pre-load check reads: the latest pointer and the run config beside the checkpoint."""
    from megatron_md.training.config import resolve

    saved = resolve("tiny-dense", None, {"mock_data": True, **model})
    (root / "iter_0000002").mkdir(parents=True)
    (root / "iter_0000002" / "run_config.yaml").write_text(saved.to_yaml())
    (root / "latest_checkpointed_iteration.txt").write_text("2")


def test_a_checkpoint_of_another_model_is_refused_by_flag(tmp_path, capsys):
    _fake_checkpoint(tmp_path / "ck", hidden_size=128)
    assert main(["train", "--model", "tiny-dense", *MOCK, "--load", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "--load" in err and "--hidden-size 128 there, 64 here" in err


def test_layout_differences_are_reported_as_reshardable_not_refused(tmp_path):
    from megatron_md.training.config import resolve
    from megatron_md.training.checkpoints.resume_check import check_checkpoint_fits

    _fake_checkpoint(tmp_path / "ck", tensor_model_parallel_size=2)
    cfg = resolve("tiny-dense", None, {"mock_data": True, "load": str(tmp_path / "ck")})
    assert check_checkpoint_fits(cfg) == ["--tensor-model-parallel-size 2 there, 1 here"]
    cfg = resolve("tiny-dense", None, {"mock_data": True, "load": str(tmp_path / "ck"), "num_layers": 4,
                                       "pretrained_checkpoint": None})
    with pytest.raises(ValueError, match=r"--num-layers 2 there, 4 here; set these as it was saved.*reshards them: "
                                         r"--tensor-model-parallel-size 2 there, 1 here"):
        check_checkpoint_fits(cfg)


def test_the_launching_process_checks_without_importing_megatron_core():
    """Before a multi-rank run starts its ranks, the launching process checks the settings (the attention kernel
    against the layer spec included) without importing megatron-core or building a model: each rank imports it.
    Importing the CLI module imports no torch (a checkpoint save's spawn-mode helper imports it again)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import megatron_md.cli\n"
            "assert 'torch' not in sys.modules, 'megatron_md.cli imports torch'\n"
            "from megatron_md.training import config as C\n"
            "from megatron_md.training.validate import validate_config\n"
            "validate_config(C.resolve('tiny-moe', None, {'mock_data': True, 'expert_model_parallel_size': 2}), 2)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
