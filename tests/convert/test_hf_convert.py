"""Hugging Face export/import: logits match transformers, round trips are exact, refusals are clear.

End to end: tiny-dense (PP2) and tiny-moe (bf16, TP2 x EP2 with sequence parallelism), each on 2 gloo ranks,
train 3 MuonMD steps on the embedded corpus, are exported through ``megatron-md convert`` and
loaded with ``AutoModelForCausalLM``. In-process: every other family (Llama, Mixtral, Qwen3-MoE
without top-k renormalisation, Gemma3, GPT-2) from a freshly built model with perturbed norms.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
import yaml

from mdtest import QUIET, run_cli

TOL = 1e-4
TRAIN = [
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
    "--optimizer", "muon_md", "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "1", *QUIET,
]


def convert(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return run_cli(["convert", *args], check=check)


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Checkpoints of a dense fp32 run (PP2) and a MoE bf16 run (TP2, EP2, SP), with a SentencePiece tokenizer."""
    from megatron_md.training.data.datasets import prepare_demo_data

    d = tmp_path_factory.mktemp("hf")
    prefix, tok = prepare_demo_data(d / "data", vocab_size=512, log=None)
    data = ["--data-path", prefix, "--tokenizer-model", tok]
    run_cli(["train", "--model", "tiny-dense", *data, *TRAIN, "--nproc-per-node", "2",
             "--pipeline-model-parallel-size", "2", "--save", str(d / "dense"), "--run-dir", str(d / "r1")])
    run_cli(["train", "--model", "tiny-moe", "--bf16", *data, *TRAIN, "--nproc-per-node", "2",
             "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
             "--expert-tensor-parallel-size", "1", "--save", str(d / "moe"), "--run-dir", str(d / "r2")])
    return SimpleNamespace(dir=d, dense=d / "dense", moe=d / "moe", tok=tok, prefix=prefix)


def _export_and_compare(ckpt, out, *extra):
    dump = out.parent / (out.name + "_ours.pt")
    proc = convert(["export", "--load", str(ckpt), "--output", str(out), "--dump-logits", str(dump), *extra])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    from transformers import AutoModelForCausalLM

    ours = torch.load(dump)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=ours["tokens"]).logits
    assert theirs.shape == ours["logits"].shape
    assert rel(theirs, ours["logits"]) <= TOL
    return report, json.loads((out / "config.json").read_text())


@pytest.mark.multirank
@pytest.mark.e2e
def test_dense_export_logits_and_tokenizer(runs):
    """(e2e: ``megatron-md convert`` in a fresh interpreter, as a user runs it.)"""
    out = runs.dir / "hf_dense"
    report, cfg = _export_and_compare(runs.dense, out, "--max-shard-size", "100KB")
    assert report["family"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["vocab_size"] == 512 and cfg["rope_theta"] == 10000.0 and cfg["head_dim"] == 16
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    from transformers import AutoTokenizer

    from megatron_md.training.data.tokenizer import build_tokenizer

    ours, hf = build_tokenizer("SentencePieceTokenizer", runs.tok), AutoTokenizer.from_pretrained(str(out))
    for text in ("Hello, world!  The for statement\n\tx = [1, 22, 333]", "Grüße, 東京 🚀 <s>"):
        assert hf.encode(text) == ours.tokenize(text)
        assert hf.decode(hf.encode(text)) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (ours.bos, ours.eos, ours.pad)


@pytest.mark.multirank
def test_moe_export_from_tp2_ep2(runs):
    report, cfg = _export_and_compare(runs.moe, runs.dir / "hf_moe")
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["norm_topk_prob"] is True and cfg["num_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []
    assert report["dtype"] == cfg["dtype"] == "bfloat16"  # the run's dtype; logits compared in fp32


@pytest.mark.multirank
def test_generate_matches_transformers_greedy_decoding(runs):
    """`megatron-md generate` (greedy) picks the same tokens as transformers' generate on the export."""
    out = runs.dir / "hf_generate"
    convert(["export", "--load", str(runs.dense), "--output", str(out)])
    n = 10
    ours = run_cli(["generate", "--load", str(runs.dense), "--prompt", "def main(args):", "--max-new-tokens",
                    str(n), "--ignore-eos", "--ids"]).stdout.split()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = torch.tensor([tok("def main(args):", add_special_tokens=False)["input_ids"]])
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=tok.pad_token_id)
    assert [int(t) for t in ours] == theirs[0, prompt.shape[1]:].tolist()
    text = run_cli(["generate", "--load", str(runs.dense), "--prompt", "def main(args):", "--max-new-tokens", "5",
                    "--temperature", "0.8", "--top-k", "20"]).stdout
    assert text.startswith("def main(args):")


@pytest.mark.multirank
def test_import_export_round_trip_and_continue_training(runs):
    from megatron_md.convert.hf_import import read_hf_dir

    src = runs.dir / "hf_src"
    convert(["export", "--load", str(runs.dense), "--output", str(src)])
    ck, back = runs.dir / "imported", runs.dir / "hf_back"
    train_yaml = runs.dir / "train.yaml"  # training settings; the model comes from config.json
    train_yaml.write_text(yaml.safe_dump({"model": {"seq_length": 32, "qk_layernorm": True},
                                          "optimizer": {"optimizer": "muon_md", "lr": 0.01}}))
    convert(["import", "--hf", str(src), "--output", str(ck), "--config", str(train_yaml)])
    convert(["export", "--load", str(ck), "--output", str(back)])
    (cfg_a, a), (cfg_b, b) = read_hf_dir(src), read_hf_dir(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert cfg_a == cfg_b
    # score and generate run on it although its config names no data, and give the source checkpoint's numbers
    text = "def main(args):\n    return args"
    scored = [run_cli(["score", "--load", str(c), "--text", text]).stdout.strip().splitlines()[-1].split(" (")[0]
              for c in (ck, runs.dense)]
    assert scored[0] == scored[1] and scored[0].startswith("mean token loss: "), scored
    made = [run_cli(["generate", "--load", str(c), "--prompt", "def main(", "--max-new-tokens", "4", "--ids"]).stdout
            for c in (ck, runs.dense)]
    assert made[0] == made[1] and made[0].strip(), made
    bad = run_cli(["score", "--load", str(ck), "--validation"], check=False)  # what it cannot do, said plainly
    assert bad.returncode == 2 and "names no data to validate on" in bad.stderr, bad.stderr[-500:]
    # The imported checkpoint trains on: weights only, MD gains start from them.
    run_cfg = ck / "iter_0000000" / "run_config.yaml"
    saved = yaml.safe_load(run_cfg.read_text())
    assert saved["model"]["seq_length"] == 32 and saved["model"]["num_query_groups"] == 2
    assert saved["optimizer"]["optimizer"] == "muon_md" and saved["data"]["tokenizer_model"].startswith(str(ck))
    run_cli(["train", "--config", str(run_cfg), "--pretrained-checkpoint", str(ck), "--data-path", runs.prefix,
             *TRAIN, "--train-iters", "1", "--run-dir", str(runs.dir / "r3")])


def test_import_llama_made_by_transformers(tmp_path):
    """A Llama directory written by transformers itself (GQA, untied) imports and exports back exactly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_md.convert.hf_import import read_hf_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rope_theta=50000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.1)  # norms: make a swapped mapping visible
    model.save_pretrained(str(tmp_path / "src"))
    convert(["import", "--hf", str(tmp_path / "src"), "--output", str(tmp_path / "ck")])
    convert(["export", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "back")])
    (_, a), (hc, b) = read_hf_dir(tmp_path / "src"), read_hf_dir(tmp_path / "back")
    assert hc["architectures"] == ["LlamaForCausalLM"] and hc["rope_theta"] == 50000.0
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- every family, in process

FAMILIES = {
    "llama+bias+scales": ("tiny-dense", dict(qk_layernorm=False, disable_bias_linear=False, layer_scale=True,
                                              embedding_scale=True), "LlamaForCausalLM"),
    "mixtral": ("tiny-moe", dict(qk_layernorm=False), "MixtralForCausalLM"),
    "qwen3_moe+pre_softmax": ("tiny-moe", dict(layer_scale=True), "Qwen3MoeForCausalLM"),
    "qwen2_moe+shared+qkv_bias": ("tiny-moe", dict(qk_layernorm=False, moe_shared_expert_intermediate_size=64,
                                                   moe_shared_expert_gate=True, add_qkv_bias=True, layer_scale=True),
                                  "Qwen2MoeForCausalLM"),
    "gemma3+sandwich": ("tiny-dense", dict(sandwich_norm=True, layer_scale=True), "Gemma3ForCausalLM"),
    "gemma3+tied": ("tiny-dense", dict(sandwich_norm=True, embedding_scale=True,
                                       untie_embeddings_and_output_weights=False), "Gemma3ForCausalLM"),
    "gpt2+bias": ("tiny-gpt2", dict(disable_bias_linear=False, layer_scale=True), "GPT2LMHeadModel"),
    "gpt2+untied+scale": ("tiny-gpt2", dict(untie_embeddings_and_output_weights=True, embedding_scale=True),
                          "GPT2LMHeadModel"),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_logits_match(name, mcore_world, tmp_path):
    from megatron_md.convert.hf_export import hf_logits, megatron_logits, write_safetensors
    from megatron_md.convert.mappings import check_mcore, choose_family, hf_config, megatron_to_hf
    from megatron_md.models.builder import build_model
    from megatron_md.training import config as C

    preset, overrides, hf_class = FAMILIES[name]
    cfg = C.resolve(preset, None, dict(overrides, seq_length=32))
    model = build_model(cfg, 512, cpu=True, pre_process=True, post_process=True).eval()
    if "pre_softmax" in name:
        model.config.moe_router_pre_softmax = True  # softmax over all experts, no top-k renormalisation
    with torch.no_grad():  # O(1) activations, so e.g. GELU's tanh approximation would show
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0 if n.endswith("bias") else 1.0, 0.1)
            else:
                p.mul_(8.0)
    fam = choose_family(cfg.model, pre_softmax=check_mcore(model.config))
    assert fam.hf_class == hf_class
    assert fam.norm_topk_prob == ("pre_softmax" not in name)
    sd = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    hf_config(fam, cfg.model, 512, torch.float32).save_pretrained(str(tmp_path))
    write_safetensors(megatron_to_hf(fam, cfg.model, sd), tmp_path, 1 << 30)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    assert rel(hf_logits(tmp_path, tokens), megatron_logits(model, tokens)) <= TOL


# ----------------------------------------------------------------------------- refusals

REFUSED = [
    ("tiny-moe", dict(sandwich_norm=True), "model.sandwich_norm"),
    ("tiny-dense", dict(disable_bias_linear=False), "model.disable_bias_linear"),
    ("tiny-gpt2", dict(embedding_scale=True), "model.embedding_scale"),
    ("tiny-dense", dict(embedding_scale=True, untie_embeddings_and_output_weights=False), "model.embedding_scale"),
    ("tiny-dense", dict(sandwich_norm=True, qk_layernorm=False), "model.sandwich_norm"),
    ("tiny-dense", dict(position_embedding_type="none"), "model.position_embedding_type"),
    ("tiny-dense", dict(swiglu=False), "model.swiglu"),
    ("tiny-gpt2", dict(query_group_ratio=0.5), "model.num_query_groups"),
]


@pytest.mark.parametrize("preset,overrides,field", REFUSED)
def test_unsupported_configs_are_refused(preset, overrides, field):
    from megatron_md.convert.mappings import ConversionError, choose_family
    from megatron_md.training import config as C

    with pytest.raises(ConversionError, match=field):
        choose_family(C.resolve(preset, None, overrides).model)


def test_unsupported_megatron_routing_and_hf_imports_are_refused():
    from megatron_md.convert.import_map import model_overrides_from_hf
    from megatron_md.convert.mappings import ConversionError, check_mcore

    router = SimpleNamespace(num_moe_experts=4, moe_router_score_function="sigmoid")
    with pytest.raises(ConversionError, match="--moe-router-score-function sigmoid: cannot be exported"):
        check_mcore(router)
    for name, value, flag in [("moe_shared_expert_intermediate_size", 64, "--moe-shared-expert-intermediate-size"),
                              ("moe_expert_capacity_factor", 1.25, "--moe-expert-capacity-factor")]:
        with pytest.raises(ConversionError, match=f"{flag} {value}: cannot be exported"):  # by the flag a user set
            check_mcore(SimpleNamespace(num_moe_experts=4, **{name: value}))
    with pytest.raises(ConversionError, match="moe_router_num_groups=2"):  # no run flag sets it: megatron's name
        check_mcore(SimpleNamespace(num_moe_experts=4, moe_router_num_groups=2))
    with pytest.raises(ConversionError, match="import supports qwen3, llama"):
        model_overrides_from_hf({"model_type": "gemma3"})
    with pytest.raises(ConversionError, match="rope type 'yarn'"):
        model_overrides_from_hf({"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}})


@pytest.mark.multirank
def test_cli_refuses_with_a_clear_message(runs, tmp_path):
    from megatron_md.convert.hf_export import checkpoint_vocab, load_run_config
    from megatron_md.convert.mappings import ConversionError

    cfg, path, tok, saved = load_run_config(runs.dense)
    cfg.model.make_vocab_size_divisible_by = 96
    with pytest.raises(ConversionError, match="vocab padding mismatch: .* 512 rows"):
        checkpoint_vocab(path, cfg, tok, saved.tensor_model_parallel_size)
    ck = tmp_path / "ck"
    shutil.copytree(runs.dense, ck)
    rc = ck / "iter_0000003" / "run_config.yaml"
    data = yaml.safe_load(rc.read_text())
    data["model"]["sandwich_norm"] = True
    data["model"]["qk_layernorm"] = False
    rc.write_text(yaml.safe_dump(data))
    # run_config.yaml was edited by hand above, so its checksum no longer matches: skip that check here.
    proc = convert(["export", "--load", str(ck), "--output", str(tmp_path / "hf"), "--no-verify-checkpoint"],
                   check=False)
    assert proc.returncode == 2
    assert "model.sandwich_norm (--sandwich-norm): sandwich norm maps to Gemma3" in proc.stderr
    assert not (tmp_path / "hf" / "config.json").exists()
