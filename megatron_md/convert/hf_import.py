"""Import a Hugging Face Qwen3, Llama, Qwen3-MoE or Mixtral directory as our ``torch_dist`` checkpoint.

Writes ``OUTPUT/iter_0000000/`` (model weights only: no optimizer, scheduler or RNG state),
``run_config.yaml`` derived from ``config.json`` (training settings from ``--config``), the
tokenizer (the HF directory's SentencePiece ``tokenizer.model``, else its Hugging Face
``tokenizer.json``; training, score, generate and export then use it) and
``latest_checkpointed_iteration.txt``. Continue training with
``megatron-md train --config OUTPUT/iter_0000000/run_config.yaml --pretrained-checkpoint OUTPUT``
(or ``--load OUTPUT --no-load-optim``); MD optimizers start their gains at 1 from these weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megatron_md.convert.import_map import hf_to_megatron, model_overrides_from_hf
from megatron_md.convert.mappings import ConversionError, choose_family

# Buffers some HF checkpoints carry that are recomputed from the config.
_IGNORED = ("rotary_emb.inv_freq",)
# Model fields that are training choices rather than the architecture: --config may set them.
_TRAINING_CHOICES = ("seq_length", "init_method_std", "attention_dropout", "hidden_dropout",
                     "make_vocab_size_divisible_by", "moe_aux_loss_coeff")


def read_hf_dir(hf_dir: str | Path) -> tuple[dict, dict]:
    """(config.json, every tensor of the safetensors files)."""
    from safetensors.torch import load_file

    d = Path(hf_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--hf {hf_dir}: no config.json there")
    hc = json.loads((d / "config.json").read_text())
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"--hf {hf_dir}: no model.safetensors(.index.json); only safetensors weights are read")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(d / f)))
    return hc, tensors


def _explicit_model_keys(config_path: str | None) -> dict:
    """Model settings written in the --config YAML (flat or under ``model:``)."""
    from megatron_md.training import config as C

    if not config_path:
        return {}
    data = C.load_yaml(config_path)
    flat = dict(data.get("model") or {}) if isinstance(data.get("model"), dict) else {}
    flat.update({k: v for k, v in data.items() if not isinstance(v, dict)})
    return {k.replace("-", "_"): v for k, v in flat.items()
            if C.FIELDS.get(k.replace("-", "_"), ("",))[0] == "model"}


def import_config(hc: dict, config_path: str | None, hf_dir: Path):
    """RunConfig: training settings from ``--config``, the model from config.json."""
    from megatron_md.models.builder import padded_vocab_size
    from megatron_md.training import config as C

    model = model_overrides_from_hf(hc)
    for k, v in _explicit_model_keys(config_path).items():
        if k in _TRAINING_CHOICES:
            model.pop(k, None)  # the --config value wins
        elif k in model and model[k] != v:
            raise ConversionError(
                f"--config {config_path}: model.{k} = {v!r} contradicts the HF config.json ({model[k]!r})"
            )
    cfg = C.resolve(None, config_path, dict(model))  # config.json's model wins, like command-line flags
    cfg.preset = None
    vocab, div = cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by
    tp = cfg.parallel.tensor_model_parallel_size
    if padded_vocab_size(vocab, div, tp) != vocab:
        raise ConversionError(
            f"vocab_size {vocab} is not a multiple of make_vocab_size_divisible_by {div} x TP {tp}: megatron "
            "would pad the embedding and this checkpoint would not load at that TP size; set a "
            "make_vocab_size_divisible_by in --config that keeps vocab_size a multiple of it x TP"
        )
    return cfg


def _fit_vocab_padding(cfg, raw: int, vocab: int) -> int | None:
    """The smallest make_vocab_size_divisible_by that pads ``raw`` tokens to exactly ``vocab`` rows at the
    run's TP (the trainer sizes the embedding from the tokenizer), or None. E.g. Qwen3: 151669 tokens,
    151936 rows: 1187 (151936 = 128 x 1187), which stays exact at any TP dividing 128."""
    tp = cfg.parallel.tensor_model_parallel_size
    if raw > vocab or vocab % tp:
        return None
    per_rank = vocab // tp
    for div in range((vocab - raw) // tp + 1, per_rank + 1):
        if per_rank % div == 0:
            return div
    return None


def _tokenizer_for(cfg, hf_dir: Path, vocab: int):
    """(where the tokenizer comes from, as DataConfig-like fields, or None; a note). The HF directory's
    tokenizer.model (SentencePiece), else its tokenizer.json / tokenizer_config.json (Hugging Face),
    else the --config one; checked to pad to the model's vocabulary."""
    from types import SimpleNamespace

    from megatron_md.models.builder import padded_vocab_size
    from megatron_md.training.data.tokenizer import (HUGGINGFACE, SENTENCEPIECE, data_tokenizer_kind,
                                                tokenizer_for_data)

    own = True
    if (hf_dir / "tokenizer.model").is_file():
        src = SimpleNamespace(tokenizer_type=SENTENCEPIECE, tokenizer_model=str(hf_dir / "tokenizer.model"))
    elif any((hf_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        src = SimpleNamespace(tokenizer_type=HUGGINGFACE, tokenizer_model=str(hf_dir))
    elif data_tokenizer_kind(cfg.data):
        src, own = SimpleNamespace(**{k: getattr(cfg.data, k) for k in
                                      ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")}), False
    else:
        return None, "no tokenizer in the HF directory: the run config uses model.vocab_size"
    src.tokenizer_type = data_tokenizer_kind(src)
    raw = tokenizer_for_data(src).vocab_size
    m = cfg.model
    padded = padded_vocab_size(raw, m.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)
    name = Path(src.tokenizer_model).name if src.tokenizer_model else "the tokenizer"
    note = f"tokenizer {name} ({src.tokenizer_type}, {raw} tokens) copied beside the checkpoint"
    if padded != vocab:
        div = _fit_vocab_padding(cfg, raw, vocab) if own else None
        if div is not None:
            note += f"; make_vocab_size_divisible_by {m.make_vocab_size_divisible_by} -> {div} so they pad to {vocab}"
            m.make_vocab_size_divisible_by = div
        elif own:
            return None, f"{name} has {raw} tokens, padded {padded} != vocab_size {vocab}: not used"
        else:
            raise ConversionError(f"--config tokenizer {name}: {raw} tokens pad to {padded}, not the model's {vocab}")
    return src, note


class _Tracking(dict):
    """Records which HF tensors the mapping read, so nothing is silently dropped."""

    def __init__(self, *a):
        super().__init__(*a)
        self.used: set[str] = set()

    def __getitem__(self, k):
        self.used.add(k)
        return super().__getitem__(k)


def import_checkpoint(hf_dir: str | Path, output: str | Path, *, config: str | None = None, log=print) -> dict:
    """Write our checkpoint of the HF model in ``hf_dir``; returns a report."""
    from megatron.core import dist_checkpointing

    from megatron_md.convert.hf_export import init_single_process, shutdown
    from megatron_md.models.builder import build_model
    from megatron_md.training.checkpoints import checkpointing as ckpt

    hf_dir, root = Path(hf_dir), Path(output)
    hc, hf = read_hf_dir(hf_dir)
    cfg = import_config(hc, config, hf_dir)
    m = cfg.model
    fam = choose_family(m, pre_softmax=m.num_experts is not None and m.moe_router_pre_softmax)
    if fam.name != hc["model_type"]:
        raise ConversionError(f"internal: config.json {hc['model_type']} maps back to {fam.name}")
    tok_src, tok_note = _tokenizer_for(cfg, hf_dir, m.vocab_size)
    if (root / ckpt.LATEST).exists() or ckpt.iter_dir(root, 0).exists():
        raise FileExistsError(f"--output {root}: already holds a checkpoint; choose an empty directory")
    final = ckpt.iter_dir(root, 0)
    if tok_src is not None:  # the run config names the copies saved with the checkpoint
        from megatron_md.training.data.tokenizer import checkpoint_tokenizer_paths

        cfg.data.tokenizer_type = tok_src.tokenizer_type
        cfg.data.tokenizer_model = cfg.data.vocab_file = cfg.data.merge_file = None
        for k, v in checkpoint_tokenizer_paths(tok_src.tokenizer_type, final.resolve()).items():
            setattr(cfg.data, k, v)
    tracked = _Tracking(hf)
    mapped = hf_to_megatron(m, tracked, hc["model_type"])
    # A tied model's lm_head.weight (some checkpoints store it) is ignored by transformers too.
    unused = sorted(k for k in hf if k not in tracked.used and not k.endswith(_IGNORED)
                    and not (k == "lm_head.weight" and not m.untie_embeddings_and_output_weights))
    if unused:
        raise ConversionError(f"--hf {hf_dir}: tensors this mapping does not place: {unused[:5]}")
    run_yaml = cfg.to_yaml()
    p = cfg.parallel  # the run config keeps the training layout; the checkpoint is layout-free
    p.tensor_model_parallel_size = p.pipeline_model_parallel_size = p.expert_model_parallel_size = 1
    p.expert_tensor_parallel_size, p.sequence_parallel = None, False
    cfg.model.transformer_impl = "local"
    init_single_process(cfg.training.seed)
    try:
        model = build_model(cfg, m.vocab_size, cpu=True, pre_process=True, post_process=True)
        sd = model.state_dict()
        missing = [k for k, v in sd.items() if torch.is_tensor(v) and k not in mapped]
        extra = [k for k in mapped if k not in sd]
        if missing or extra:
            raise ConversionError(f"state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for k, v in mapped.items():
                if sd[k].shape != v.shape:
                    raise ConversionError(f"{k}: HF shape {tuple(v.shape)} != ours {tuple(sd[k].shape)}")
                sd[k].copy_(v)
        partial = final.with_name(final.name + ".partial")
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        state = {"model": model.sharded_state_dict(), "iteration": 0, "consumed_samples": 0,
                 "has_md": False, "extra": {"imported_from": str(hf_dir.resolve())}}
        dist_checkpointing.save(state, str(partial))
    finally:
        shutdown()
    (partial / ckpt.RUN_CONFIG).write_text(run_yaml)
    if tok_src is not None:
        from megatron_md.training.data.tokenizer import save_tokenizer_files

        save_tokenizer_files(tok_src, partial)
    from megatron_md.training.checkpoints.integrity import write_manifest

    write_manifest(partial)  # checksums.json, as save_checkpoint writes (one process here)
    partial.rename(final)
    (root / ckpt.LATEST).write_text("0\n")
    log(f"import: {hf_dir} ({hc['model_type']}) -> {final}; {tok_note}")
    return {"family": fam.name, "path": str(final), "vocab_size": m.vocab_size, "tokenizer": tok_src is not None}
