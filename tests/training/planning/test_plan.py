"""``megatron-md plan`` against what the trainer really allocates, and the command on the big presets.

The multi-rank test runs ``_plan_probe.py`` twice (world 1: DP1; world 2: DP2, TP2, EP2 layouts in one
process group; in the suite's pooled worlds, or under torchrun with --launch=cli) and compares each case's per-rank bytes (max over ranks) with the plan's: parameters,
gradients, master weights and optimizer state within 5%, activations within 25% (the bytes the forward saves
for backward, in the case's recomputation mode).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mdtest import run_tool
from megatron_md.training.config import resolve
from megatron_md.training.planning.report import (DEVICES, find_device, make_plan, parse_bytes, parse_headroom,
                                              resolve_target)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

# (world size, case): tiny presets, seq 64, two sequences per micro-batch; every optimizer state kind is
# covered (AdamW moments, Muon momentum, MD gains, Manifold Muon duals), bf16 master weights, both
# distributed optimizers (byte-sharded adam, layer-wise), sequence parallelism and expert parallelism.
CASES = [
    (1, {"name": "dp1-muon_md-fp32-paper", "model": "tiny-dense",  # the MD paper's model options
         "cli": {"optimizer": "muon_md", "sandwich_norm": True, "layer_scale": True, "embedding_scale": True}}),
    # A small vocabulary on some cases so that the layers' activations, not the logits, dominate.
    (1, {"name": "dp1-adam-bf16", "model": "tiny-dense", "cli": {"optimizer": "adam", "bf16": True,
                                                                 "vocab_size": 512}}),
    (1, {"name": "dp1-moe-shared-muon-fp32", "model": "tiny-moe",
         "cli": {"optimizer": "muon", "vocab_size": 512, "moe_shared_expert_intermediate_size": 96}}),
    # Recomputation: what the forward saves (full: the layer inputs; the backward's working set is not seen).
    (1, {"name": "dp1-adam-fp32-selective", "model": "tiny-dense",
         "cli": {"optimizer": "adam", "vocab_size": 512, "recompute_granularity": "selective"}}),
    (1, {"name": "dp1-adam-fp32-full", "model": "tiny-dense",
         "cli": {"optimizer": "adam", "vocab_size": 512, "recompute_granularity": "full"}}),
    (2, {"name": "dp2-muon_md-bf16-distopt", "model": "tiny-dense",
         "cli": {"optimizer": "muon_md", "bf16": True, "use_distributed_optimizer": True}}),
    (2, {"name": "dp2-adam-bf16-distopt", "model": "tiny-dense",
         "cli": {"optimizer": "adam", "bf16": True, "use_distributed_optimizer": True}}),
    (2, {"name": "tp2-sp-manifold_muon", "model": "tiny-dense",
         "cli": {"optimizer": "manifold_muon", "tensor_model_parallel_size": 2, "sequence_parallel": True,
                 "vocab_size": 512}}),
    (2, {"name": "tp2-adam_md", "model": "tiny-dense",
         "cli": {"optimizer": "adam_md", "tensor_model_parallel_size": 2}}),
    (2, {"name": "tp2-sp-adam-full-recompute", "model": "tiny-dense",
         "cli": {"optimizer": "adam", "tensor_model_parallel_size": 2, "sequence_parallel": True,
                 "vocab_size": 512, "recompute_granularity": "full", "recompute_num_layers": 2}}),
    (2, {"name": "ep2-moe-muon_md-bf16-distopt", "model": "tiny-moe",
         "cli": {"optimizer": "muon_md", "expert_model_parallel_size": 2, "bf16": True,
                 "use_distributed_optimizer": True, "vocab_size": 512}}),
]
for _, case in CASES:
    case["cli"]["micro_batch_size"] = 2

STATIC_TOL, ACTIVATION_TOL = 0.05, 0.25


def probe(nproc: int, cases: list[dict]) -> dict:
    out = run_tool("tests/training/planning/_plan_probe.py", [json.dumps(cases)], nproc=nproc, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    assert out.returncode == 0 and lines, f"probe failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return json.loads(lines[-1][len("PROBE "):])


def planned(world: int, case: dict) -> dict:
    cli = {"mock_data": True, "device": "cpu", **case["cli"]}
    return make_plan(resolve(case["model"], None, dict(cli)), world)


def ratios(world: int, case: dict, measured: dict) -> dict:
    dev = planned(world, case)["per_device"]
    mode = dev["recompute"]
    acts = dev["activations_full_saved"] if mode == "full" else dev["activations"][mode]
    plan = {"params": dev["params"], "grads": dev["grads"], "master": dev["master_weights"],
            "state": dev["optimizer_state"], "activations": acts}
    return {k: (plan[k] / measured[k] if measured[k] else (1.0 if plan[k] == 0 else float("inf")))
            for k in plan}


@pytest.mark.multirank
def test_plan_matches_the_trainers_allocation():
    results = {}
    for world in (1, 2):
        measured = probe(world, [c for w, c in CASES if w == world])
        for w, case in CASES:
            if w == world:
                results[case["name"]] = ratios(world, case, measured[case["name"]])
    print(json.dumps(results, indent=1))
    bad = {name: {k: round(v, 3) for k, v in r.items()
                  if abs(v - 1) > (ACTIVATION_TOL if k == "activations" else STATIC_TOL)}
           for name, r in results.items()}
    assert not any(bad.values()), f"plan / allocated off: {bad}\nall: {results}"


def plan_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``megatron-md plan ARGS`` in this process (the command only computes; no process group)."""
    from megatron_md.cli import main

    capsys.readouterr()
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("model, extra", [
    ("dense-1.29b", []),
    ("moe-6.7b", ["--expert-model-parallel-size", "8"]),
])
def test_plan_big_presets_on_8x_h100(capsys, model, extra):
    from megatron_md.models.presets import count_parameters

    rc, stdout, _ = plan_cli(capsys, "--json", "--model", model, "--num-gpus", "8", "--device", "H100-80GB", "--bf16",
                     "--use-distributed-optimizer", "--optimizer", "muon_md", "--micro-batch-size", "4",
                     "--global-batch-size", "256", *extra)
    assert rc == 0
    plan = json.loads(stdout)
    dev, n = plan["per_device"], count_parameters(resolve(model, None, {}).model)
    assert plan["parameters"]["total"] == n.total
    # Param bytes: bf16 x this rank's share (all of a dense model at TP1; 1/EP of the experts at EP8).
    ep = plan["layout"]["ep"]
    assert 2 * n.total / ep <= dev["params"] <= 2 * n.total * 1.01, dev["params"]
    if ep == 1:
        pad = plan["parameters"]["padded_vocab"] - resolve(model, None, {}).model.vocab_size
        assert dev["params"] == 2 * (n.total + 2 * pad * 2048)
        assert dev["grads"] == 2 * dev["params"]  # fp32 grad buffers
        # Master weights and Adam moments sharded 8 ways.
        assert abs(dev["master_weights"] - 4 * n.total / 8) / (4 * n.total / 8) < 0.01
    acts = dev["activations"]
    assert acts["full"] < acts["selective"] <= acts["none"]
    assert dev["total"]["none"] == dev["static_total"] + acts["none"]
    assert plan["fits"]["full"] is True and plan["device_memory"] == 81082 * 2**20  # as CUDA reports it
    assert plan["device"]["name"] == "H100-80GB" and plan["headroom"] == 0.05
    assert plan["attention"]["kernel"] == "flash" and plan["attention"]["scores_per_layer"] == 0
    fl = plan["flops_per_step"]
    tokens = plan["layout"]["global_batch"] * plan["layout"]["seq_length"]
    assert 6 * n.active * tokens * 0.8 < fl["model"] < 6 * n.active * tokens * 1.5
    assert 0 < fl["optimizer_newton_schulz"] < fl["model"]  # at 256 x 1024 tokens per step
    comm = plan["communication_per_device"]
    assert comm["dp_grad_reduce_scatter"] > 0 and comm["dp_param_all_gather"] > 0
    assert (comm["ep_all_to_all"] > 0) == (ep > 1)
    # Expert grads reduce over expert-DP (1 at EP8 on 8 devices): only the dense params' fp32 grads go over DP.
    dense = dev["param_count"] - dev["expert_param_count"]
    assert comm["dp_grad_reduce_scatter"] == pytest.approx(7 / 8 * 4 * (dense if ep == 8 else dev["param_count"]))


def test_plan_text_table_and_fit_verdict(capsys):
    rc, stdout, _ = plan_cli(capsys, "--model", "dense-1.29b", "--num-gpus", "8", "--device-memory", "8GB")
    assert rc == 0 and "DOES NOT FIT" in stdout and "optimizer: adam moments" in stdout
    assert "attention: flash" in stdout


def test_fit_verdict_keeps_the_headroom(capsys):
    """A total between (1 - headroom) and 100% of the device is TIGHT, not a fit; --headroom 0 makes it one."""
    base = ["--json", "--model", "dense-181m", "--num-gpus", "1", "--bf16"]
    _, stdout, _ = plan_cli(capsys, *base)
    total = json.loads(stdout)["per_device"]["total"]["none"]
    mem = f"{total / 0.97 / 2**20:.0f}MiB"  # 3% spare
    for headroom, fits in (("5%", False), ("0.02", True), ("0", True)):
        _, stdout, _ = plan_cli(capsys, *base, "--device-memory", mem, "--headroom", headroom)
        plan = json.loads(stdout)
        assert plan["fits"]["none"] is fits and plan["spare_fraction"]["none"] == pytest.approx(0.03, abs=1e-4)
    _, stdout, _ = plan_cli(capsys, *base[1:], "--device-memory", mem)
    assert "TIGHT" in stdout and "under the 5% headroom" in stdout


@pytest.mark.parametrize("args, needle", [
    (["--device-memory", "eighty"], "--device-memory 'eighty'"),
    (["--device-memory", "80XB"], "--device-memory '80XB'"),
    (["--device-memory=-1GB"], "--device-memory '-1GB'"),
    (["--device-memory", "0GB"], "--device-memory '0GB'"),
    (["--num-gpus", "3", "--tensor-model-parallel-size", "2"], "--world-size 3"),
    # A size without a unit is refused, not read as bytes (80 bytes: nothing fits) or as GB.
    (["--device-memory", "80"], "--device-memory 80: give a unit"),
    (["--device-memory", "80G"], "--device-memory '80G'"),
    (["--device", "H300"], "--device 'H300': unknown device; known: H100-80GB"),
    (["--target-device", "cpu"], "--device cpu: give the memory of one rank"),
    (["--headroom", "120%"], "--headroom '120%'"),
    (["--device", "H100-80GB", "--transformer-impl", "local", "--attention-backend", "flash"],
     "--attention-backend flash is a Transformer Engine kernel"),
    (["--device", "cpu", "--device-memory", "4GiB", "--transformer-impl", "transformer_engine"],
     "--transformer-impl transformer_engine needs CUDA"),
])
def test_plan_bad_input(capsys, args, needle):
    rc, _, stderr = plan_cli(capsys, "--model", "dense-1.29b", *args)
    assert rc == 2 and needle in stderr, stderr[-2000:]


def test_parse_bytes_units():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("141 GiB") == 141 * 2**30
    assert parse_bytes("80gib") == 80 * 2**30
    assert parse_bytes("79.6GiB") == int(79.6 * 2**30)
    assert parse_bytes("81559MiB") == 81559 * 2**20
    for bad in ("80 gigs", "96e9", "80", "80G"):
        with pytest.raises(ValueError, match="--device-memory"):
            parse_bytes(bad)
    assert parse_headroom("5%") == parse_headroom("0.05") == 0.05


def test_device_names():
    """Names are case-insensitive (spaces and underscores read as dashes); memory is what CUDA reports."""
    assert find_device("h100-80gb") is find_device("H100 80GB") is find_device("h100") is DEVICES[0]
    assert find_device("H100-80GB").memory == 81082 * 2**20  # 79.18 GiB, not 80 GiB nor 80 GB
    assert find_device("h200").memory == 143156 * 2**20
    assert find_device("A100_40GB").name == "A100-40GB" and find_device("H300") is None
    assert len({d.name for d in DEVICES}) == len(DEVICES)
    assert all(d.source in ("cuda", "nvidia-smi") and 30_000 < d.mib < 200_000 for d in DEVICES)
    # A size beats the name's memory; a device name given as the memory is that device.
    assert resolve_target("H200", "100GiB")["memory"] == 100 * 2**30
    assert resolve_target(None, "H200")["name"] == "H200"
    assert resolve_target(None, None) is None


def _attention(cli: dict, cpu: bool = False) -> dict:
    cfg = resolve("dense-181m", None, {"mock_data": True, "bf16": True, "micro_batch_size": 2, **cli})
    target = {"name": "cpu", "memory": 2**34, "source": "given"} if cpu else find_device("H100-80GB").memory
    return make_plan(cfg, 1, target)["attention"]


@pytest.mark.parametrize("cli, cpu, kernel", [
    ({}, False, "flash"),  # auto on a GPU: TE's spec, TE picks flash or cuDNN attention
    ({"attention_backend": "fused"}, False, "flash"),
    ({"transformer_impl": "transformer_engine", "attention_backend": "unfused"}, False, "te-unfused"),
    ({"transformer_impl": "local"}, False, "sdpa"),  # no TE: auto is torch's SDPA in the local spec
    ({"transformer_impl": "local", "attention_backend": "sdpa", "attention_dropout": 0.1}, False, "sdpa"),
    ({"transformer_impl": "local", "attention_backend": "local"}, False, "unfused"),  # megatron's DotProductAttention
    ({"transformer_impl": "local", "attention_backend": "unfused"}, False, "unfused"),
    ({"transformer_impl": "local", "attention_backend": "local", "masked_softmax_fusion": True}, False,
     "unfused-fused-softmax"),
    ({"transformer_impl": "local", "attention_backend": "local", "masked_softmax_fusion": True, "seq_length": 8192,
      "max_position_embeddings": 8192}, False, "unfused"),  # the fused kernel stops at 4096
    ({}, True, "sdpa"),  # CPU: always the local spec
    ({"device": "cpu"}, False, "sdpa"),
    ({"attention_dropout": 0.1}, True, "sdpa-math"),  # CPU dropout: torch's math fallback
    ({"attention_backend": "local"}, True, "unfused"),
])
def test_attention_kernel_follows_the_config(cli, cpu, kernel):
    attn = _attention(cli, cpu)
    assert attn["kernel"] == kernel, attn
    m = resolve("dense-181m", None, {**cli}).model
    a, s, b = m.num_attention_heads, m.seq_length, 2
    # bf16: torch's softmax keeps 4 + 2 bytes a score plus an s x s bool mask; the fused kernel 2 bytes.
    expect = {"flash": 0, "sdpa": 0, "unfused": a * s * s * b * 6 + s * s, "te-unfused": a * s * s * b * 6 + s * s,
              "unfused-fused-softmax": a * s * s * b * 2, "sdpa-math": a * s * s * b * 12}[kernel]
    assert attn["scores_per_layer"] == expect


def test_sdpa_under_te_is_refused_by_the_plan():
    with pytest.raises(ValueError, match="--attention-backend sdpa.*--transformer-impl local"):
        _attention({"attention_backend": "sdpa"})


# Attention at a shape where unfused attention's s x s tensors are a large part (seq 256 against hidden 64): fp32
# and bf16, with and without attention dropout (which adds a bool mask and keeps dropout's output instead of the
# copy), for megatron's DotProductAttention (local) and torch's SDPA (on the CPU: a flash-style kernel, or the
# math path with dropout).
SCORE_CASES = [
    {"name": f"scores-{backend}-{prec}-drop{drop}", "model": "tiny-dense",
     "cli": {"optimizer": "adam", "vocab_size": 512, "seq_length": 256, "max_position_embeddings": 256,
             "micro_batch_size": 2, "bf16": prec == "bf16", "attention_dropout": drop, "attention_backend": backend}}
    for backend in ("local", "sdpa") for prec in ("fp32", "bf16") for drop in (0.0, 0.1)
]


def test_attention_scores_match_measurement():
    measured = probe(1, SCORE_CASES)
    for case in SCORE_CASES:
        plan = planned(1, case)
        drop = case["cli"]["attention_dropout"] > 0
        kernel = {"local": "unfused", "sdpa": "sdpa-math" if drop else "sdpa"}[case["cli"]["attention_backend"]]
        assert plan["attention"]["kernel"] == kernel, (case["name"], plan["attention"])
        layers = resolve(case["model"], None, dict(case["cli"])).model.num_layers
        got = measured[case["name"]]
        assert got["scores"] == layers * plan["attention"]["scores_per_layer"], (case["name"], got, plan["attention"])
        if kernel == "sdpa":
            assert got["scores"] == 0, got
        else:
            assert got["scores"] > 0.25 * got["activations"], got  # a large part at this shape
        acts = plan["per_device"]["activations"]["none"]
        assert abs(acts / got["activations"] - 1) < 0.05, (case["name"], acts, got["activations"])
    # SDPA without dropout keeps about half of what DotProductAttention keeps at this shape (measured 0.51 in bf16).
    assert measured["scores-sdpa-bf16-drop0.0"]["activations"] < 0.55 * measured["scores-local-bf16-drop0.0"]["activations"]


def test_docs_plans_are_current(capsys):
    """docs/planning.md's plan table (benchmarks/results/plan_8xh100.json) is what this code plans now."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from plan_tables import COMMON, RESULT
    finally:
        sys.path.remove(str(ROOT / "tools"))
    stored = json.loads((ROOT / RESULT).read_text())
    for name, entry in stored["plans"].items():
        rc, stdout, _ = plan_cli(capsys, *entry["args"], *COMMON, "--json")
        assert rc == 0 and json.loads(stdout) == entry["plan"], (
            f"{name}: stale; run python tools/plan_tables.py --generate && "
            "python tools/render_readme_tables.py --block plan")


def test_plan_pipeline_and_tensor_split(capsys):
    """PP keeps PP micro-batches in flight on the first stage (1F1B) and splits the layers; TP splits params."""
    base = ["--json", "--model", "dense-181m", "--bf16", "--micro-batch-size", "2", "--global-batch-size", "64"]
    plans = {}
    for name, extra in {"dp4": ["--num-gpus", "4"],
                        "pp4": ["--num-gpus", "4", "--pipeline-model-parallel-size", "4"],
                        "tp2": ["--num-gpus", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"]}.items():
        rc, stdout, _ = plan_cli(capsys, *base, *extra)
        assert rc == 0
        plans[name] = json.loads(stdout)["per_device"]
        plans[name]["stages"] = json.loads(stdout)["pipeline_stages"]
    assert [s["in_flight_micro_batches"] for s in plans["pp4"]["stages"].values()] == [4, 1]
    assert plans["dp4"]["in_flight_micro_batches"] == 1
    assert plans["pp4"]["param_count"] < plans["dp4"]["param_count"] / 2
    # TP2 + SP: every param matrix (vocab-parallel embedding and head too) and every activation split in two.
    assert plans["tp2"]["param_count"] < 0.51 * plans["dp4"]["param_count"]
    assert plans["tp2"]["activations"]["none"] < 0.55 * plans["dp4"]["activations"]["none"]
