"""Typed config: generated Megatron-named flags, YAML loading, precedence, derived sizes."""

from __future__ import annotations

import pytest
import yaml

from megatron_md.training.arguments import train_parser
from megatron_md.training.config import FIELDS, RunConfig, flag, resolve


def _parse(argv):
    args = vars(train_parser().parse_args(argv))
    return args.pop("config", None), args


def test_every_field_has_a_megatron_style_flag_with_help():
    parser = train_parser()
    opts = {s for a in parser._actions for s in a.option_strings}
    for name, (_, f) in FIELDS.items():
        assert flag(name) in opts
        assert f.metadata.get("help"), name
    for megatron_flag in ("--tensor-model-parallel-size", "--lr-decay-style", "--moe-router-topk",
                          "--untie-embeddings-and-output-weights", "--no-load-optim", "--log-interval"):
        assert megatron_flag in opts


def test_precedence_defaults_preset_yaml_cli(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "preset": "tiny-moe",
        "optimizer": {"lr": 0.01, "lr_decay_style": "WSD"},
        "train_iters": 7,  # flat keys work too
    }))
    path, cli = _parse(["--config", str(cfg_file), "--lr", "0.02", "--no-swiglu"])
    cfg = resolve(None, path, cli)
    assert cfg.preset == "tiny-moe" and cfg.model.num_experts == 4  # from the preset
    assert cfg.optimizer.lr_decay_style == "WSD"  # from YAML
    assert cfg.training.train_iters == 7  # flat YAML key
    assert cfg.optimizer.lr == 0.02  # CLI beats YAML
    assert cfg.model.swiglu is False  # --no-flag
    assert cfg.optimizer.adam_beta2 == 0.999  # default (Megatron-LM's)


def test_round_trip_through_yaml():
    cfg = resolve("tiny-dense", None, {"hidden_size": 128, "data_path": ["0.3", "a", "0.7", "b"]})
    again = RunConfig.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_type_and_choice_errors_name_the_flag(tmp_path):
    bad = tmp_path / "b.yaml"
    bad.write_text("training:\n  train_iters: lots\n")
    with pytest.raises(ValueError, match="--train-iters expects int"):
        resolve(None, str(bad), {})
    bad.write_text("optimizer:\n  lr_decay_style: sawtooth\n")
    with pytest.raises(ValueError, match="--lr-decay-style must be one of"):
        resolve(None, str(bad), {})
    with pytest.raises(ValueError, match="--config .*not found"):
        resolve(None, str(tmp_path / "missing.yaml"), {})


def test_hidden_size_must_fit_kv_channels():
    with pytest.raises(ValueError, match="--hidden-size 100 is not a multiple of --kv-channels 16"):
        resolve("tiny-dense", None, {"hidden_size": 100})


def test_negative_named_switches_turn_on():
    """--no-load-optim / --no-load-rng are switches that turn their option ON (argparse's
    BooleanOptionalAction would read any "--no-..." as False)."""
    path, cli = _parse(["--no-load-optim", "--no-load-rng"])
    cfg = resolve("tiny-dense", path, cli)
    assert cfg.checkpoint.no_load_optim is True and cfg.checkpoint.no_load_rng is True
    assert resolve("tiny-dense", *_parse([])).checkpoint.no_load_optim is False


def test_muon_newton_schulz_precision_is_fp32_on_cpu_unless_set():
    """megatron's Muon default ('medium') runs Newton-Schulz in bf16: ~100x slower than fp32 on a CPU
    without bf16 units, so 'auto' picks fp32 there and keeps bf16 on GPUs; an explicit value wins."""
    import torch

    from megatron_md.training.build import ns_matmul_precision

    assert resolve("tiny-dense", None, {}).optimizer.muon.muon_fp32_matmul_prec == "auto"
    assert ns_matmul_precision("auto", torch.device("cpu")) == "highest"
    assert ns_matmul_precision("auto", torch.device("cuda", 0)) == "medium"
    assert ns_matmul_precision("medium", torch.device("cpu")) == "medium"


def test_newton_schulz_flags_resolve_for_md_and_manifold():
    """The engine for MD and Manifold Muon, megatron's duplicated mode for its muon; bf16 NS on GPUs."""
    import torch

    from megatron_md.mcore.md_config import MDOptimizerConfig, ns_settings
    from megatron_md.training.build import ns_tp_mode

    assert resolve("tiny-dense", None, {}).optimizer.muon.muon_tp_mode == "auto"
    assert ns_tp_mode("auto", "muon_md") == ns_tp_mode("auto", "manifold_muon") == "layer_sharded"
    assert ns_tp_mode("auto", "muon") == "duplicated" and ns_tp_mode("duplicated", "muon_md") == "duplicated"
    gpu = ns_settings(MDOptimizerConfig(muon_fp32_matmul_prec="medium", muon_tp_mode="layer_sharded"))
    cpu = ns_settings(MDOptimizerConfig(muon_fp32_matmul_prec="highest", muon_tp_mode="duplicated"))
    assert (gpu["dtype"], gpu["tp_mode"]) == (torch.bfloat16, "layer_sharded")
    assert (cpu["dtype"], cpu["matmul_precision"], cpu["tp_mode"]) == (torch.float32, None, "duplicated")
    assert ns_settings(MDOptimizerConfig(muon_fp32_matmul_prec="high", muon_tp_mode="duplicated"))[
        "matmul_precision"] == "high"
    with pytest.raises(ValueError, match="--muon-tp-mode 'blockwise'"):
        ns_settings(MDOptimizerConfig(muon_fp32_matmul_prec="highest", muon_tp_mode="blockwise"))
