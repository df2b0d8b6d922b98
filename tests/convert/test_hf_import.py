"""Hugging Face MoE import: Qwen3-MoE and Mixtral directories written by transformers import, give transformers'
logits at TP1 and at TP2 x EP2 (2 gloo ranks, through ``dist_checkpointing``'s resharding), and export back
bit for bit; the families megatron-core's layers cannot reproduce are refused with the reason.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from mdtest import run_cli, run_tool

PROBE = "tests/convert/_import_probe.py"
TOL = 1e-5  # fp32 logits, max|a-b| / max|b|


def _tiny_hf(name: str, out, **extra):
    """A random transformers model of family ``name`` with O(1) norms and activations, saved to ``out``."""
    import transformers as T

    shape = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False)
    if name == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=4, **shape, **extra)
    elif name == "qwen2_moe":
        cfg = T.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=64,
                               num_experts=4, **shape, **extra)
    else:
        cfg = T.MixtralConfig(intermediate_size=48, num_local_experts=4, rope_theta=1e6, **shape, **extra)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.1)  # norms: a swapped mapping shows
            else:
                p.mul_(4.0)  # O(1) activations: a wrong router or scale shows
    model.save_pretrained(str(out))
    return model


CASES = {"qwen3_moe": {"norm_topk_prob": True}, "qwen3_moe+pre_softmax": {"norm_topk_prob": False},
         "qwen2_moe": {}, "mixtral": {}}


@pytest.mark.multirank
@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_moe_import_matches_transformers_at_tp1_and_tp2_ep2(case, tmp_path):
    """(e2e: ``megatron-md convert`` in a fresh interpreter, the probe under torchrun.)"""
    from megatron_md.convert.hf_import import read_hf_dir

    family = case.split("+")[0]
    src, ck, back = tmp_path / "src", tmp_path / "ck", tmp_path / "back"
    hf = _tiny_hf(family, src, **CASES[case]).eval()
    run_cli(["convert", "import", "--hf", str(src), "--output", str(ck)])
    saved = json.loads(run_cli(["convert", "export", "--load", str(ck), "--output", str(back), "--dump-logits",
                                str(tmp_path / "tp1.pt")]).stdout.strip().splitlines()[-1])
    assert saved["family"] == family, saved
    (cfg_a, a), (cfg_b, b) = read_hf_dir(src), read_hf_dir(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)  # the round trip is exact
    experts = [c.get("num_experts") or c.get("num_local_experts") for c in (cfg_a, cfg_b)]  # transformers' alias
    assert experts == [4, 4], experts
    for k in ("num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size",
              "intermediate_size", "head_dim", "num_key_value_heads", "rope_parameters"):
        assert cfg_a.get(k) == cfg_b.get(k), k
    dump = torch.load(tmp_path / "tp1.pt")
    with torch.no_grad():
        want = hf(input_ids=dump["tokens"]).logits.float()
    tp1 = ((dump["logits"] - want).abs().max() / want.abs().max()).item()
    assert tp1 <= TOL, tp1  # TP1, EP1
    layout = {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}
    run_tool(PROBE, [str(ck), str(tmp_path / "tp1.pt"), str(tmp_path / "tp2.pt"), json.dumps(layout)], nproc=2)
    got = torch.load(tmp_path / "tp2.pt")
    assert got.shape == want.shape
    tp2 = ((got - want).abs().max() / want.abs().max()).item()
    assert tp2 <= TOL, tp2  # TP2 x EP2
    print(f"{case}: logits vs transformers, TP1 {tp1:.1e}, TP2 x EP2 {tp2:.1e}")


def test_moe_families_that_do_not_map_are_refused_with_the_reason():
    from megatron_md.convert.import_map import model_overrides_from_hf
    from megatron_md.convert.mappings import ConversionError

    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, intermediate_size=96,
                num_experts_per_tok=2)
    for hc, match in [
        (dict(model_type="olmoe", num_experts=4), "normalises q and k over the whole projection"),
        (dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=0),
         "shared expert always exists"),
        (dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=48, decoder_sparse_step=2),
         "dense layers among the MoE ones"),
        (dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=48, mlp_only_layers=[0]),
         "dense layers among the MoE ones"),
        (dict(model_type="mixtral", num_local_experts=4, router_jitter_noise=0.1), "router_jitter_noise"),
        (dict(model_type="mixtral", num_local_experts=4, sliding_window=32), "sliding_window"),
        (dict(model_type="gpt_oss", num_local_experts=4), "import supports qwen3, llama, qwen3_moe, qwen2_moe, mixtral"),
    ]:
        with pytest.raises(ConversionError, match=match):
            model_overrides_from_hf(dict(base, **hc))
    m = model_overrides_from_hf(dict(base, model_type="qwen3_moe", num_experts=4, moe_intermediate_size=48,
                                     norm_topk_prob=True, router_aux_loss_coef=0.001))
    assert (m["num_experts"], m["moe_ffn_hidden_size"], m["moe_router_topk"], m["moe_router_pre_softmax"],
            m["qk_layernorm"], m["moe_aux_loss_coeff"]) == (4, 48, 2, False, True, 0.001)


# ----------------------------------------------------------------------------- continue training an imported model

def _lm_losses(run_dir) -> list[float]:
    from mdtest import train_records

    return [r["lm_loss"] for r in train_records(run_dir)]


@pytest.mark.multirank
def test_imported_moe_continues_with_muon_md_from_its_exact_function_and_resumes_bit_identically(tmp_path):
    """A Qwen3-MoE import trained on with MuonMD (EP2 x DP2 over 2 ranks, distributed optimizer, bf16): the gains
    take the loaded norms, so step 0's loss is the imported model's (Adam's step 0 on the same batch, which leaves
    the weights alone), once the embedding has gains (MuonMD's default has none: the log names the flag); 2 straight steps == 1 step + save + resume + 1 step. Manifold Muon projects the loaded
    matrices onto their manifolds: its step-0 loss differs and the log says by how much the weights moved."""
    from mdtest import QUIET

    _tiny_hf("qwen3_moe", tmp_path / "src", norm_topk_prob=True)
    ck = tmp_path / "ck"
    run_cli(["convert", "import", "--hf", str(tmp_path / "src"), "--output", str(ck)])
    base = ["train", "--config", str(ck / "iter_0000000" / "run_config.yaml"), "--mock-data", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0",
            "--nproc-per-node", "2", "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16",
            "--lr", "1e-2", *QUIET]
    start = ["--pretrained-checkpoint", str(ck)]

    def train(name, *extra):
        return run_cli([*base, *extra, "--run-dir", str(tmp_path / name)]).stdout

    train("adam", *start, "--optimizer", "adam", "--train-iters", "1")
    start += ["--md-embedding-gains", "row"]  # MuonMD's default embedding has no gains to hold its row norms
    out = train("straight", *start, "--optimizer", "muon_md", "--train-iters", "2")
    assert "loaded weights: kept exactly" in out and "projected" not in out, out[-3000:]
    resumed = tmp_path / "resumed"
    train("first", *start, "--optimizer", "muon_md", "--train-iters", "2", "--exit-interval", "1",
          "--save", str(resumed))
    train("second", "--optimizer", "muon_md", "--md-embedding-gains", "row", "--train-iters", "2", "--load",
          str(resumed))
    imported, straight = _lm_losses(tmp_path / "adam"), _lm_losses(tmp_path / "straight")
    assert straight[0] == imported[0]  # step 0 runs the imported function, bit for bit
    assert _lm_losses(tmp_path / "first") + _lm_losses(tmp_path / "second") == straight
    out = train("manifold", *start, "--optimizer", "manifold_muon", "--train-iters", "1")
    moved = re.search(r"manifold (\S+)", out.split("loaded weights:", 1)[1].splitlines()[0])
    assert moved and float(moved.group(1)) > 0, out[-3000:]
    assert _lm_losses(tmp_path / "manifold")[0] != imported[0]
