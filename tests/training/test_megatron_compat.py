"""Megatron-LM's command line here: its example scripts run shrunk and build the model Megatron-LM builds; its
defaults are ours except where a reason is written down; its flags we lack are refused by name.

The three scripts' argument arrays are copied verbatim from NVIDIA/Megatron-LM at d98e8a64 (2026-08-22), under
https://github.com/NVIDIA/Megatron-LM/tree/d98e8a64ddf34856e74b24714e3bedb2f5a39553/examples : gpt3's
train_gpt3_175b_distributed.sh, mixtral's train_mixtral_8x7b_distributed.sh and llama's
train_llama3_8b_h100_fp8.sh (its MOCK-data branch). The shrinking changes sizes only; the flags
taken out are each shown to be refused with a line naming them.
"""

from __future__ import annotations

import dataclasses
import math
import shlex

import pytest
from mdtest import run_cli

from megatron_md.training import config as C
from megatron_md.training import megatron_compat as mc
from megatron_md.training.arguments import parse_train_args

SCRIPTS = {
    "gpt3-175b": """
        --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
        --attention-backend auto
        --micro-batch-size 1 --global-batch-size 1536
        --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
        --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006
        --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001
        --lr-decay-iters 430000
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
        --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1
        --log-interval 100 --save-interval 10000 --eval-interval 1000 --save $CHECKPOINT_PATH
        --load $CHECKPOINT_PATH --eval-iters 10 --tensorboard-dir $TENSORBOARD_LOGS_PATH""",
    "mixtral-8x7b": """
        --use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
        --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
        --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
        --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8
        --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000
        --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
        --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
        --tokenizer-type Llama2Tokenizer --tokenizer-model ${TOKENIZER_MODEL} --data-path $DATA_PATH
        --split 99990,8,2
        --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000
        --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
        --use-distributed-optimizer --sequence-parallel
        --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save $CHECKPOINT_PATH
        --load $CHECKPOINT_PATH --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" --no-load-optim --no-load-rng""",
    "llama3-8b": """
        --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
        --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
        --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
        --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134
        --attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
        --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
        --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
        --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
        --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
        --empty-unused-memory-level 1 --exit-duration-in-mins 235
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
        --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
        --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
        --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path ${DATA_CACHE_PATH}
        --tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files
        --num-workers 1
        --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
        --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
        --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH\"""",
}
# Sizes a CPU runs in seconds (the ratios the scripts' models have are kept where they matter: GQA 4:1).
SHRINK = {
    "gpt3-175b": {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "64",
                  "--max-position-embeddings": "64", "--global-batch-size": "4", "--train-iters": "2",
                  "--lr-decay-iters": "2", "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "1",
                  "--log-interval": "1", "--save-interval": "2", "--eval-interval": "2", "--eval-iters": "1"},
    "mixtral-8x7b": {"--seq-length": "64", "--max-position-embeddings": "128", "--num-layers": "2",
                     "--hidden-size": "64", "--ffn-hidden-size": "96", "--num-attention-heads": "8",
                     "--num-query-groups": "2", "--global-batch-size": "4", "--train-iters": "2",
                     "--lr-decay-iters": "2", "--lr-warmup-iters": "1", "--pipeline-model-parallel-size": "1",
                     "--expert-model-parallel-size": "2", "--save-interval": "2", "--eval-interval": "2",
                     "--eval-iters": "1"},
    "llama3-8b": {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "224",
                  "--num-attention-heads": "8", "--num-query-groups": "2", "--kv-channels": "16",
                  "--seq-length": "64", "--max-position-embeddings": "64", "--global-batch-size": "4",
                  "--train-samples": "8", "--lr-decay-samples": "8", "--lr-warmup-samples": "4",
                  "--vocab-size": "4000", "--eval-iters": "1", "--eval-interval": "2", "--save-interval": "2",
                  "--profile-step-start": "1", "--profile-step-end": "2"},
}
# Data the scripts read from files (GPT-2 BPE, Llama-2 SentencePiece) is mock data of that vocabulary here.
MOCK_DATA = {"gpt3-175b": ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"],
             "mixtral-8x7b": ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000"]}
FILE_DATA = ("--data-path", "--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model")
# What a CPU run takes out: Megatron-LM flags megatron_md refuses, and CUDA-only settings it refuses on CPU.
REFUSED = {"gpt3-175b": ["--step-batch-size-schedule", "--fp16"],
           "mixtral-8x7b": [],
           "llama3-8b": ["--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"]}
CUDA_ONLY = {"gpt3-175b": [], "mixtral-8x7b": [],  # (--moe-grouped-gemm: a warning, SequentialMLP experts)
             "llama3-8b": ["--attention-backend", "--cross-entropy-loss-fusion"]}
NPROC = {"gpt3-175b": 2, "mixtral-8x7b": 2, "llama3-8b": 1}


def _options(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """[(flag, its values)] in order."""
    out = []
    for t in tokens:
        if t.startswith("--"):
            out.append((t, []))
        else:
            out[-1][1].append(t)
    return out


def shrunk(name: str, tmp) -> tuple[list[str], list[str]]:
    """(the script's flags shrunk for a CPU run, the flags taken out as refused)."""
    paths = {"CHECKPOINT_PATH": tmp / "ck", "TENSORBOARD_LOGS_PATH": tmp / "tb", "DATA_CACHE_PATH": tmp / "cache"}
    text = SCRIPTS[name]
    for var, path in paths.items():
        text = text.replace("${" + var + "}", str(path)).replace("$" + var, str(path))
    args, out = [], []
    for flag, values in _options(shlex.split(text)):
        if flag in REFUSED[name] or flag in CUDA_ONLY[name]:
            out.append(flag)
        elif not (name in MOCK_DATA and flag in FILE_DATA):
            args += [flag, *([SHRINK[name][flag]] if flag in SHRINK[name] else values)]
    args += MOCK_DATA.get(name, [])
    if name == "gpt3-175b":
        args.append("--bf16")  # where the script trains in fp16 (refused: fp16 with loss scaling)
    return [*args, "--run-dir", str(tmp / "run"), "--nproc-per-node", str(NPROC[name])], out


def megatron_tensors(args: list[str]) -> dict[str, tuple]:
    """{checkpoint key: global shape} of the GPTModel Megatron-LM builds for ``args``, by Megatron-LM's rules
    (megatron/training/arguments.py, transformer_config.py), written out here without megatron_md's code. Keys
    are megatron-core's torch_dist names (layers stacked on a leading axis, experts on the next)."""
    a = {f: (v[0] if v else True) for f, v in _options(args)}
    L, h, heads = int(a["--num-layers"]), int(a["--hidden-size"]), int(a["--num-attention-heads"])
    kv = int(a.get("--kv-channels") or h // heads)
    groups = int(a["--num-query-groups"]) if "--group-query-attention" in a else heads
    glu = "--swiglu" in a
    ffn = int(a.get("--ffn-hidden-size") or (int((4 * h * 2 / 3) / 64) * 64 if glu else 4 * h))
    bias = "--disable-bias-linear" not in a
    ln = a.get("--normalization", "LayerNorm") == "LayerNorm"
    tp = int(a.get("--tensor-model-parallel-size", 1))
    vocab = int(a["--vocab-size"])  # megatron-core's NullTokenizer (Megatron-LM's at d98e8a64): eod = vocab - 1
    vocab = math.ceil(vocab / (128 * tp)) * 128 * tp  # --make-vocab-size-divisible-by 128, times TP
    t = {"embedding.word_embeddings.weight": (vocab, h)}
    if a.get("--position-embedding-type", "learned_absolute") == "learned_absolute":
        t["embedding.position_embeddings.weight"] = (int(a["--max-position-embeddings"]), h)

    def norm(key, *lead):
        t[key + "_weight" if key.endswith("layer_norm") else key + ".weight"] = (*lead, h)
        if ln:
            t[key + "_bias" if key.endswith("layer_norm") else key + ".bias"] = (*lead, h)

    def linear(key, out_f, in_f, *lead):
        t[key + ".weight"] = (*lead, out_f, in_f)
        if bias:
            t[key + ".bias"] = (*lead, out_f)

    s = "decoder.layers."
    norm(s + "self_attention.linear_qkv.layer_norm", L)
    linear(s + "self_attention.linear_qkv", (heads + 2 * groups) * kv, h, L)
    linear(s + "self_attention.linear_proj", h, heads * kv, L)
    norm(s + "mlp.linear_fc1.layer_norm", L)
    experts = int(a.get("--num-experts") or 0)
    if experts:
        moe_ffn = int(a.get("--moe-ffn-hidden-size") or ffn)
        t[s + "mlp.router.weight"] = (L, experts, h)
        linear(s + "mlp.experts.experts.linear_fc1", (2 if glu else 1) * moe_ffn, h, L, experts)
        linear(s + "mlp.experts.experts.linear_fc2", h, moe_ffn, L, experts)
    else:
        linear(s + "mlp.linear_fc1", (2 if glu else 1) * ffn, h, L)
        linear(s + "mlp.linear_fc2", h, ffn, L)
    norm("decoder.final_layernorm")
    if "--untie-embeddings-and-output-weights" in a:
        t["output_layer.weight"] = (vocab, h)
    return t


def saved_tensors(ck) -> dict[str, tuple]:
    from torch.distributed.checkpoint import FileSystemReader

    (it,) = [d for d in ck.iterdir() if d.name.startswith("iter_")]
    meta = FileSystemReader(str(it)).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in meta.items()
            if k.startswith(("embedding.", "decoder.", "output_layer.")) and "_extra_state" not in k}


def _check_script(name: str, tmp_path, via=None):
    args, taken_out = shrunk(name, tmp_path)
    for flag in REFUSED[name]:  # each refused flag is named on one line, before any work
        proc = run_cli(["train", *args, flag, *(["x"] if mc.megatron_flag(flag)["value"] else [])], check=False)
        assert proc.returncode != 0 and "not implemented" in proc.stderr, proc.stderr[-800:]
        (line,) = {x for x in proc.stderr.splitlines() if "not implemented" in x}  # one line (per rank), naming it
        assert flag in line
    for flag in CUDA_ONLY[name]:
        proc = run_cli(["train", *args, flag, *_values(name, flag)], check=False)
        assert proc.returncode != 0 and flag in proc.stderr, proc.stderr[-800:]
    proc = run_cli(["train", *args], via=via)
    want = megatron_tensors(args)
    got = saved_tensors(tmp_path / "ck")
    assert got == want
    parameters = sum(math.prod(s) for s in want.values())
    assert parameters == sum(math.prod(s) for s in got.values())
    return proc


def _values(name: str, flag: str) -> list[str]:
    return dict(_options(shlex.split(SCRIPTS[name])))[flag]


@pytest.mark.parametrize("name", ["gpt3-175b", "mixtral-8x7b"])
def test_megatron_lm_example_scripts_run_shrunk_and_build_megatron_lm_s_model(name, tmp_path):
    proc = _check_script(name, tmp_path)
    if name == "mixtral-8x7b":  # its TP1 --sequence-parallel and --no-position-embedding: Megatron-LM's handling
        assert "--sequence-parallel: off" in proc.stderr and "--no-position-embedding: accepted" in proc.stderr


@pytest.mark.e2e
def test_llama3_script_through_the_cli_with_sample_based_schedule(tmp_path):
    proc = _check_script("llama3-8b", tmp_path, via="cli")
    assert "--use-mcore-models: accepted" in proc.stderr and "--context-parallel-size 1: accepted" in proc.stderr
    from mdtest import train_records

    recs = train_records(tmp_path / "run")
    assert [r["consumed_samples"] for r in recs] == [4, 8]  # --train-samples 8 at a global batch of 4: 2 steps
    assert recs[0]["lr"] == pytest.approx(1.5e-4)  # warmup over 4 samples: the peak after the first batch


def test_every_shared_flag_keeps_megatron_lm_s_default_unless_a_reason_is_written():
    shared, differing = mc.shared_defaults(C.FIELDS, C.flag)
    unexplained = {k: v for k, v in differing.items() if k not in mc.DIFFERS}
    assert not unexplained, f"defaults differing from Megatron-LM's without a reason in DIFFERS: {unexplained}"
    stale = set(mc.DIFFERS) - set(differing)
    assert not stale, f"DIFFERS lists flags whose defaults agree (or that are not shared): {stale}"
    assert len(shared) > 120  # the architecture, schedule, parallel and checkpoint flags, at the least
    for table in (mc.ACCEPTED, mc.ONLY_AT, mc.REASONS):  # the tables name Megatron-LM flags we do not define
        for flag in table:
            assert mc.megatron_flag(flag) is not None and flag[2:].replace("-", "_") not in C.FIELDS, flag


def test_without_a_preset_the_model_is_megatron_lm_s():
    m = C.resolve(None, None, {"hidden_size": 256, "num_attention_heads": 4}).model
    assert (m.normalization, m.swiglu, m.position_embedding_type, m.qk_layernorm) == ("LayerNorm", False,
                                                                                      "learned_absolute", False)
    assert (m.untie_embeddings_and_output_weights, m.disable_bias_linear) == (False, False)
    assert (m.attention_dropout, m.hidden_dropout, m.kv_channels, m.ffn_hidden_size) == (0.1, 0.1, 64, 1024)
    glu = C.resolve(None, None, {"hidden_size": 4096, "num_attention_heads": 32, "swiglu": True}).model
    assert glu.ffn_hidden_size == 10880  # int(4 * 4096 * 2/3 / 64) * 64
    sources: dict = {}
    cfg = C.resolve("tiny-dense", None, {"optimizer": "muon_md"}, sources=sources)
    lines = C.describe_sources(sources)
    assert any(line.startswith("preset tiny-dense set ") and "swiglu" in line for line in lines)
    assert any(line.startswith("muon_md recipe set ") and "weight_decay" in line for line in lines)
    assert cfg.model.swiglu and cfg.optimizer.adam_beta2 == 0.95


def test_refused_accepted_and_unknown_flags_before_any_work(capsys):
    with pytest.raises(SystemExit) as e:
        parse_train_args(["--mock-data", "--fp16", "--fp8-format", "hybrid", "--use-mcore-models"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--fp16: fp16 with loss scaling is not implemented: use --bf16" in err
    assert "--fp8-format" in err and "Megatron-LM flags not implemented here" in err and "--use-mcore" not in err
    with pytest.raises(SystemExit):
        parse_train_args(["--mock-data", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_train_args(["--context-parallel-size", "2"])
    assert "--context-parallel-size 2: context parallelism is not implemented" in capsys.readouterr().err
    args, accepted = parse_train_args(["--use-dist-ckpt", "--tiktoken-pattern", "v2", "--lr", "1e-3"])
    assert {k: v for k, v in args.items() if v is not None} == {"lr": 1e-3} and set(accepted) == {"--use-dist-ckpt", "--tiktoken-pattern"}
    cfg = C.resolve(None, None, {})
    with pytest.raises(ValueError, match="--no-position-embedding with --position-embedding-type learned_absolute"):
        mc.normalise(cfg, set(), {"--no-position-embedding": ""})


def test_schedule_flags_are_checked_with_megatron_lm_s_rules():
    from megatron_md.training.validate import ConfigError, validate_config

    def errors(**cli):
        try:
            validate_config(C.resolve("tiny-dense", None, {"mock_data": True, **cli}), 1)
        except ConfigError as e:
            return str(e)
        return ""

    assert "give one warmup" in errors(lr_warmup_fraction=0.1, lr_warmup_iters=2)
    assert "need --train-samples" in errors(lr_warmup_samples=4)
    assert "use --lr-warmup-samples" in errors(train_samples=8, lr_decay_iters=4)
    assert "--decoupled-lr works with --optimizer adam, not muon" in errors(decoupled_lr=1e-3, optimizer="muon")
    assert "--embedding-lr" in errors(decoupled_lr=1e-3, optimizer="muon_md")
    with pytest.raises(ValueError, match="give one"):
        C.resolve("tiny-dense", None, {"train_samples": 8, "train_iters": 2})
    cfg = C.resolve("tiny-dense", None, {"mock_data": True, "train_samples": 9, "global_batch_size": 4})
    validate_config(cfg, 1)
    assert cfg.training.train_iters == 2  # 9 // 4, as Megatron-LM

    from megatron_md.training.build import schedule_samples

    frac = dataclasses.replace(cfg.optimizer, lr_warmup_fraction=0.25)
    assert schedule_samples(dataclasses.replace(cfg, optimizer=frac), 4) == (0.25 * 9, 9, 9)
