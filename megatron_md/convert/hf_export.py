"""Export a ``torch_dist`` checkpoint (saved at any TP/PP/EP layout) to a Hugging Face directory.

The model described by ``run_config.yaml`` beside the checkpoint is built at TP=PP=EP=1 in this
single process (world size 1, gloo, CPU runtime) and loaded through megatron's
``dist_checkpointing``, which reshards whatever layout the run used. The TP1 state dict is then
mapped to the HF architecture chosen by ``mappings.choose_family``. MD runs need nothing special:
the model parameters already are the fused ``W = diag(γ_r) Ŵ diag(γ_c)``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

import torch
import yaml

from megatron_md.convert.mappings import ConversionError, Family, check_mcore, choose_family, hf_config
from megatron_md.convert.mappings import megatron_to_hf

DEFAULT_SHARD = "5GB"


# ----------------------------------------------------------------------------- runtime

def init_single_process(seed: int = 1234):
    """A world-size-1 gloo group on the CPU runtime with megatron's parallel state at TP=PP=EP=1."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_md.runtime import activate, select_runtime
    from megatron_md.runtime.distributed import init_distributed

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(k, None)
    rt = select_runtime("cpu")
    activate(rt)
    init_distributed(rt)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(seed)  # megatron's init draws from the tracked RNG
    return rt


def shutdown() -> None:
    from megatron_md.runtime import cpu
    from megatron_md.runtime.distributed import destroy_distributed

    destroy_distributed()
    cpu.uninstall()


# ----------------------------------------------------------------------------- the run's model

def load_run_config(load: str | Path, iteration: int | None = None):
    """(RunConfig at TP=PP=EP=1, checkpoint dir, the run's tokenizer (megatron-core's, from the files saved
    with the checkpoint) or None, the run's ParallelConfig)."""
    from megatron_md.training.checkpoints import checkpointing as ckpt
    from megatron_md.training.config import RunConfig

    text, path = ckpt.read_run_config(load, iteration)
    cfg = RunConfig.from_dict(yaml.safe_load(text))
    saved = copy.deepcopy(cfg.parallel)
    p = cfg.parallel
    p.tensor_model_parallel_size = p.pipeline_model_parallel_size = p.expert_model_parallel_size = 1
    p.expert_tensor_parallel_size = None
    p.sequence_parallel = p.use_distributed_optimizer = False
    cfg.training.device, cfg.training.nproc_per_node = "cpu", 1
    cfg.model.transformer_impl = "local"
    cfg.model.moe_grouped_gemm = False  # megatron checkpoints grouped and sequential experts alike
    from megatron_md.training.data.tokenizer import tokenizer_for_data, use_checkpoint_tokenizer

    tok = tokenizer_for_data(cfg.data) if use_checkpoint_tokenizer(cfg.data, path) else None
    return cfg, path, tok, saved


def checkpoint_vocab(path: Path, cfg, tokenizer, saved_tp: int) -> tuple[int, int]:
    """(padded vocabulary stored in the checkpoint, real vocabulary); refuses a mismatch."""
    from megatron.core import dist_checkpointing

    from megatron_md.models.builder import padded_vocab_size

    meta = dist_checkpointing.load_tensors_metadata(str(path))
    key = "embedding.word_embeddings.weight"
    if key not in meta:
        raise ConversionError(f"{path}: no {key} in the checkpoint (not a model checkpoint of this trainer?)")
    rows = meta[key].global_shape[0]
    if tokenizer is not None:
        raw, what = tokenizer.vocab_size, f"the tokenizer's vocabulary ({cfg.data.tokenizer_type})"
    else:
        raw, what = cfg.model.vocab_size, "model.vocab_size"
    div = cfg.model.make_vocab_size_divisible_by
    expected = padded_vocab_size(raw, div, saved_tp)
    if rows != expected:
        raise ConversionError(
            f"vocab padding mismatch: the checkpoint's word embedding has {rows} rows, but {what} ({raw}) "
            f"padded to a multiple of make_vocab_size_divisible_by {div} x TP {saved_tp} is {expected}; "
            "run_config.yaml does not describe this checkpoint"
        )
    return rows, raw


def build_and_load(cfg, load: str | Path, iteration: int | None, vocab: int, *, verify: bool = True):
    """Our GPTModel at TP1 with the checkpoint's weights (needs ``init_single_process``)."""
    from megatron_md.models.builder import build_model
    from megatron_md.training.checkpoints import checkpointing as ckpt

    model = build_model(cfg, vocab, cpu=True, pre_process=True, post_process=True)
    ckpt.load_checkpoint(load, model, load_optim=False, load_rng=False, iteration=iteration, verify=verify)
    model.eval()
    return model


def fp32_copy(cfg, model, vocab: int):
    """The same weights in an fp32-configured model (a bf16 config also runs softmax in bf16)."""
    if not cfg.training.bf16:
        return model
    from megatron_md.models.builder import build_model

    cfg = copy.deepcopy(cfg)
    cfg.training.bf16 = False
    fp32 = build_model(cfg, vocab, cpu=True, pre_process=True, post_process=True)
    fp32.load_state_dict(model.state_dict())  # copy_ upcasts
    return fp32.eval()


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(tokens, pos, None).float()


@torch.no_grad()
def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    return model(input_ids=tokens).logits.float()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|."""
    return ((a - b).abs().max() / b.abs().max()).item()


def sample_tokens(cfg, tokenizer, raw_vocab: int, length: int = 48) -> torch.Tensor:
    """Two rows of ids to compare logits on: the tokenizer's sample texts, or seeded random ids."""
    n = min(length, cfg.model.seq_length)
    if tokenizer is not None:
        from megatron_md.convert.hf_tokenizer import SAMPLE_TEXTS

        ids = tokenizer.tokenize(" ".join(SAMPLE_TEXTS))
        ids = (ids * (2 * n // max(len(ids), 1) + 1))[: 2 * n]
        return torch.tensor(ids).view(2, n)
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, raw_vocab, (2, n), generator=g)


# ----------------------------------------------------------------------------- writing

def parse_size(size: str | int) -> int:
    """'5GB', '500MB', '2GiB' or bytes -> bytes (transformers' max_shard_size convention)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", size.upper())
    if not m:
        raise ValueError(f"--max-shard-size {size!r}: expected e.g. 5GB, 500MB or a byte count")
    unit = m.group(2).rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    return int(float(m.group(1)) * base**power)


def write_safetensors(tensors: dict, out: Path, max_shard_bytes: int) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if cur and size + n > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += n
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        names.append(fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names + ["model.safetensors.index.json"]


def add_v4_keys(config_json: Path, fam: Family, m) -> None:
    """transformers 5 writes ``rope_parameters``, ``num_local_experts`` and ``dtype``; readers on
    transformers 4 look for ``rope_theta``, ``num_experts`` and ``torch_dtype`` and would silently
    fall back to their defaults (e.g. Qwen3's rope_theta 1e6). Write both spellings."""
    c = json.loads(config_json.read_text())
    if fam.name != "gpt2":
        c.setdefault("rope_theta", float(m.rotary_base))
    if fam.name == "gemma3":
        c.setdefault("rope_local_base_freq", float(m.rotary_base))
    if fam.name == "qwen3_moe":
        c.setdefault("num_experts", m.num_experts)
    if "dtype" in c:
        c.setdefault("torch_dtype", c["dtype"])
    config_json.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


def _staging_dir(out: Path) -> Path:
    """``OUT.partial``, renamed to ``OUT`` once everything is written (a failed export leaves no model)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--output {out}: already exists and is not empty; choose a new directory")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


# ----------------------------------------------------------------------------- export

def export_checkpoint(
    load: str | Path,
    output: str | Path,
    *,
    iteration: int | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = DEFAULT_SHARD,
    verify: bool = False,
    dump_logits: str | Path | None = None,
    check_integrity: bool = True,
    log=print,
) -> dict:
    """Write the HF model directory; returns a report (family, vocab, files, logits error).

    ``check_integrity``: check the checkpoint against its checksums.json before reading anything.
    """
    if check_integrity:
        from megatron_md.training.checkpoints.integrity import verify_load

        verify_load(load, iteration)
    cfg, path, tok, saved = load_run_config(load, iteration)
    m = cfg.model
    choose_family(m)  # refuse before any heavy work; routing details are checked once built
    out = Path(output)
    tmp = _staging_dir(out)
    init_single_process(cfg.training.seed)
    try:
        vocab, raw = checkpoint_vocab(path, cfg, tok, saved.tensor_model_parallel_size)
        model = build_and_load(cfg, load, iteration, vocab, verify=False)  # checked above
        fam: Family = choose_family(m, pre_softmax=check_mcore(model.config))
        layout = (f"TP{saved.tensor_model_parallel_size} PP{saved.pipeline_model_parallel_size} "
                  f"EP{saved.expert_model_parallel_size}")
        log(f"export: {path} (saved at {layout}, loaded at TP1 PP1 EP1) -> {fam.hf_class} in {out}")
        sd = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
        out_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if cfg.training.bf16 else torch.float32)
        tensors = {k: v.to(out_dtype) for k, v in megatron_to_hf(fam, m, sd).items()}
        special = {}
        if tok is not None:
            from megatron_md.convert.hf_tokenizer import write_hf_tokenizer

            special = write_hf_tokenizer(cfg.data, tok, tmp, m.max_position_embeddings)
        hf_config(fam, m, vocab, out_dtype, special).save_pretrained(str(tmp))
        add_v4_keys(tmp / "config.json", fam, m)
        files = write_safetensors(tensors, tmp, parse_size(max_shard_size))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
        log(f"export: wrote config.json, {', '.join(files)}" + (", tokenizer files" if tok else "")
            + f"; vocab_size {vocab} (padded; the tokenizer has {raw})")
        report = {"family": fam.name, "hf_class": fam.hf_class, "vocab_size": vocab, "tokenizer_vocab": raw,
                  "dtype": str(out_dtype).removeprefix("torch."), "files": files}
        if verify:
            tokens = sample_tokens(cfg, tok, raw)
            ours = megatron_logits(fp32_copy(cfg, model, vocab), tokens)
    finally:
        shutdown()
    if verify:
        if dump_logits:
            torch.save({"tokens": tokens, "logits": ours}, str(dump_logits))
        err = rel_error(hf_logits(out, tokens), ours)
        report["max_rel_error"] = err
        log(f"export: logits of transformers' {fam.hf_class} vs ours on {tuple(tokens.shape)} tokens: "
            f"max|a-b|/max|b| = {err:.3e}")
    return report
