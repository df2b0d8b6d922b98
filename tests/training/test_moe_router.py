"""Megatron-LM's router options and --recompute-modules, passed to megatron-core and run as a cluster user runs them:
EP2 with the distributed optimizer in bf16, saved and resumed bit for bit.

The run under test routes as DeepSeek-V3 does: fp32 router, sigmoid scores, aux-loss-free balancing. Its expert
bias is a buffer of every router that megatron-core moves after each global batch from the token counts
(finalize_model_grads), not a parameter: no optimizer steps it, MD and Manifold Muon included, and a checkpoint must
carry it. Each source run trains 4 steps and saves at steps 2 and 4; a resumed run loads step 2 and saves step 4.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from mdtest import QUIET, flat_tensors, run_cli, shared_run, train_records

pytestmark = pytest.mark.multirank

ROUTER = ["--moe-router-dtype", "fp32", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
          "--moe-router-bias-update-rate", "0.01"]
BASE = ["train", "--model", "tiny-moe", "--use-distributed-optimizer", "--bf16", "--mock-data", "--train-iters", "4",
        "--global-batch-size", "4", "--micro-batch-size", "1", "--seq-length", "32", "--log-interval", "1",
        "--eval-iters", "1", "--dist-ckpt-optim-fully-reshardable", *QUIET]
EP2 = ["--nproc-per-node", "2", "--expert-model-parallel-size", "2"]


def _losses(run_dir) -> list[float]:
    return [r["lm_loss"] for r in train_records(run_dir)]


def _tensors(iteration_dir) -> dict:
    from megatron.core import dist_checkpointing

    return flat_tensors(dist_checkpointing.load_plain_tensors(str(iteration_dir)))


def _resume_from_step_2(out):
    (out / "ck" / "latest_checkpointed_iteration.txt").write_text("2\n")


def _source(opt: str):
    out = shared_run([*BASE, *EP2, *ROUTER, "--optimizer", opt, "--save", "{out}/ck", "--save-interval", "2",
                      "--run-dir", "{out}/run"], name=f"moe-router-{opt}", after=_resume_from_step_2)
    return _losses(out / "run"), out / "ck"


def _same(a: dict, b: dict) -> list[str]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:10]
    return [k for k in a if isinstance(a[k], torch.Tensor) and not (a[k].shape == b[k].shape and a[k].equal(b[k]))]


@pytest.mark.parametrize("opt", ["muon_md", pytest.param("adam", marks=pytest.mark.e2e)])
def test_router_options_train_and_resume_bit_identically_at_ep2(tmp_path, opt, mcore_world):
    straight, ck = _source(opt)
    assert len(straight) == 4
    at2 = _tensors(ck / "iter_0000002")
    biases = {k: v for k, v in at2.items() if k.endswith("expert_bias")}
    assert biases, sorted(at2)[:20]
    for k, v in biases.items():  # fp32 whatever the model's dtype, one entry per expert, and it moved
        assert v.dtype == torch.float32 and v.shape[-1] == 4 and v.abs().sum() > 0, (k, v)
    again = tmp_path / "ck"
    run_cli([*BASE, *EP2, *ROUTER, "--optimizer", opt, "--load", str(ck), "--save", str(again),
             "--run-dir", str(tmp_path / "resumed")])
    assert _losses(tmp_path / "resumed") == straight[2:]
    final, resumed = _tensors(ck / "iter_0000004"), _tensors(again / "iter_0000004")
    assert not _same(final, resumed)  # weights, optimizer state and the expert bias, bit for bit
    assert any(not final[k].equal(at2[k]) for k in biases)  # the bias kept moving after the resume point


def test_the_expert_bias_survives_a_reshard_to_ep1(tmp_path, mcore_world):
    """Loaded at EP1 (DP2) and saved again without a step, every tensor of the EP2 checkpoint comes back."""
    _, ck = _source("muon_md")
    again = tmp_path / "again"
    # --train-iters 2 ends the run at the loaded iteration: no step, one final save (same LR decay span)
    run_cli([*BASE, "--nproc-per-node", "2", *ROUTER, "--optimizer", "muon_md", "--train-iters", "2",
             "--lr-decay-iters", "4", "--load", str(ck), "--save", str(again), "--run-dir", str(tmp_path / "run")])
    before, after = _tensors(ck / "iter_0000002"), _tensors(again / "iter_0000002")
    assert any(k.endswith("expert_bias") for k in before)
    assert not _same(before, after)


def test_recomputing_the_moe_layer_changes_no_number(tmp_path):
    """--recompute-granularity selective --recompute-modules core_attn moe: the same losses as no recomputation,
    bit for bit, with the expert bias on (a recomputed forward must not count its tokens into the bias twice in
    a way that changes the update)."""
    straight, _ = _source("muon_md")
    run = tmp_path / "recompute"
    run_cli([*BASE, *EP2, *ROUTER, "--optimizer", "muon_md", "--recompute-granularity", "selective",
             "--recompute-modules", "core_attn", "moe", "--run-dir", str(run)])
    assert _losses(run) == straight
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["recompute_modules"] == ["core_attn", "moe"]


def test_the_options_reach_megatron_core():
    from megatron_md.models.builder import transformer_config
    from megatron_md.training.config import resolve

    cfg = resolve("tiny-moe", None, {"moe_router_dtype": "fp64", "moe_router_score_function": "sqrtsoftplus",
                                     "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.5,
                                     "recompute_granularity": "selective", "recompute_modules": ["layernorm", "moe"]})
    tc = transformer_config(cfg.model, cfg.parallel, bf16=False, cpu=True)
    assert (tc.moe_router_dtype, tc.moe_router_score_function, tc.moe_router_enable_expert_bias,
            tc.moe_router_bias_update_rate, tc.moe_permute_fusion) == ("fp64", "sqrtsoftplus", True, 0.5, False)
    assert tc.recompute_granularity == "selective" and set(tc.recompute_modules) == {"layernorm", "moe"}
    plain = resolve("tiny-moe", None, {"recompute_granularity": "selective"})
    tc = transformer_config(plain.model, plain.parallel, bf16=False, cpu=True)
    assert tc.recompute_modules == ["core_attn"] and tc.moe_router_score_function == "softmax"
    assert tc.moe_router_dtype is None and not tc.moe_router_enable_expert_bias


@pytest.mark.parametrize("model,settings,message", [
    ("tiny-moe", {"moe_router_enable_expert_bias": True}, "--moe-router-enable-expert-bias needs "
                                                           "--moe-router-score-function sigmoid"),
    ("tiny-moe", {"moe_permute_fusion": True}, "--moe-permute-fusion needs Transformer Engine's permute kernels on "
                                               r"CUDA \(this run is on the CPU\)"),
    ("tiny-moe", {"recompute_modules": ["moe"]}, "--recompute-modules moe applies to --recompute-granularity "
                                                 "selective"),
    ("tiny-moe", {"recompute_granularity": "selective", "recompute_modules": ["moe_act"]},
     "--recompute-modules moe_act needs grouped GEMM experts"),
    ("tiny-moe", {"recompute_granularity": "selective", "recompute_modules": ["shared_experts"]},
     "--recompute-modules shared_experts needs --moe-shared-expert-intermediate-size"),
    ("tiny-dense", {"moe_router_score_function": "sigmoid"}, "--moe-router-score-function needs an MoE model"),
    ("tiny-dense", {"moe_router_dtype": "fp32"}, "--moe-router-dtype needs an MoE model"),
    ("tiny-dense", {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
     "--recompute-modules moe, moe_act and shared_experts need an MoE model"),
], ids=["bias-softmax", "permute-fusion-cpu", "modules-not-selective", "moe-act-no-grouped-gemm",
        "shared-experts-none", "dense-score-function", "dense-router-dtype", "dense-recompute-moe"])
def test_bad_router_and_recompute_settings_are_refused_before_work_starts(model, settings, message):
    from megatron_md.training.config import resolve
    from megatron_md.training.validate import ConfigError, validate_config

    cfg = resolve(model, None, {"mock_data": True, "device": "cpu", **settings})
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, 1)


def test_a_checkpoint_saved_without_the_expert_bias_is_refused_by_a_run_that_turns_it_on():
    from megatron_md.training.checkpoints.resume_check import compare
    from megatron_md.training.config import resolve

    cfg = resolve("tiny-moe", None, {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True})
    refused, _ = compare({"model": {"moe_router_enable_expert_bias": False}}, cfg)
    assert refused == ["--moe-router-enable-expert-bias False there, True here"]


def test_dense_first_layers_train_and_resume_bit_identically_at_ep2(tmp_path, mcore_world):
    """--moe-layer-freq '([0]+[1]*1)': layer 0 a dense MLP (stepped as any dense MLP), layer 1 the experts and the
    router, as megatron-core builds them from the pattern; a resume from step 2 repeats the straight run."""
    freq = ["--moe-layer-freq", "([0]+[1]*1)", "--optimizer", "muon_md"]
    src = tmp_path / "src"
    run_cli([*BASE, *EP2, *ROUTER, *freq, "--save", str(src), "--save-interval", "2", "--run-dir", str(tmp_path / "a")])
    (src / "latest_checkpointed_iteration.txt").write_text("2\n")
    again = tmp_path / "again"
    run_cli([*BASE, *EP2, *ROUTER, *freq, "--load", str(src), "--save", str(again), "--run-dir", str(tmp_path / "b")])
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")[2:]
    final = _tensors(src / "iter_0000004")
    assert not _same(final, _tensors(again / "iter_0000004"))
    dense = [k for k in final if k.startswith("decoder.layers.0.mlp.linear_fc") and "experts" not in k]
    moe = [k for k in final if k.startswith("decoder.layers.1.mlp.experts")]
    assert dense and moe and not any(k.startswith("decoder.layers.0.mlp.router") for k in final), sorted(final)[:40]
