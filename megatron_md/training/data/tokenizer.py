"""Tokenizers: SentencePiece training (``train_sentencepiece``), corpus reading, and every
``--tokenizer-type`` built by megatron-core's ``MegatronTokenizer`` (``build_tokenizer``).

Kinds: ``SentencePieceTokenizer`` (a ``.model``), ``HuggingFaceTokenizer`` (a ``tokenizer.json`` or
a local Hugging Face tokenizer directory), ``GPT2BPETokenizer`` (``--vocab-file`` vocab.json +
``--merge-file`` merges.txt) and ``NullTokenizer`` (mock data). With ``--tokenizer-type`` unset the
kind follows from the files (``resolve_tokenizer_type``). The objects carry what megatron-core's
datasets read (``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``), so one can be passed
directly as ``GPTDatasetConfig.tokenizer``; ``save_tokenizer_files`` / ``use_checkpoint_tokenizer``
keep a run's tokenizer files with its checkpoints.

SentencePiece special ids are fixed by ``train_sentencepiece``: ``<unk>``=0, ``<s>``=1, ``</s>``=2
(the end-of-document token appended by ``tools/preprocess_data.py --append-eod``), ``<pad>``=3,
then the 256 byte-fallback pieces.  Training uses the identity normalization, keeps every
space and adds no dummy prefix, so ``detokenize(tokenize(text)) == text`` for any text
(characters outside the vocabulary fall back to their UTF-8 bytes; newlines become ``<0x0A>``).
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import gzip
import os
import random
from pathlib import Path
from typing import Iterable, Iterator, Sequence

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
MODEL_TYPES = ("bpe", "unigram")


# --------------------------------------------------------------------------- input reading
def open_text(path: str | os.PathLike) -> io.TextIOBase:
    """Open a text file, transparently decompressing ``.xz`` / ``.gz``."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--input {path}: no such file")
    if p.suffix == ".xz":
        return lzma.open(p, "rt", encoding="utf-8")
    if p.suffix == ".gz":
        return gzip.open(p, "rt", encoding="utf-8")
    return open(p, "r", encoding="utf-8")


def is_jsonl(path: str | os.PathLike) -> bool:
    """``x.jsonl``, ``x.json``, ``x.jsonl.xz``, ``x.jsonl.gz`` hold one JSON object per line."""
    name = Path(path).name
    for ext in (".xz", ".gz"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    return name.endswith((".jsonl", ".json"))


def iter_texts(path: str | os.PathLike, json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Yield the documents of a jsonl(.xz/.gz) file (the ``json_keys`` fields of each line,
    each as a separate text) or of a plain text file (one document per non-empty line)."""
    jsonl = is_jsonl(path)
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not jsonl:
                yield line.rstrip("\n")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--input {path}: line {lineno} is not valid JSON ({e})") from None
            for key in json_keys:
                if key not in obj:
                    raise ValueError(
                        f"--input {path}: line {lineno} has no key {key!r} (keys: {sorted(obj)}); "
                        "pick the right --json-keys"
                    )
                value = obj[key]
                if not isinstance(value, str):
                    raise ValueError(
                        f"--input {path}: line {lineno}: {key!r} is {type(value).__name__}, not a string"
                    )
                yield value


def _training_sentences(texts: Iterable[str], max_len: int) -> Iterator[str]:
    """SentencePiece trains on "sentences": feed the non-empty lines of every document,
    cut to ``max_len`` bytes' worth of characters so none is skipped as too long."""
    for text in texts:
        for line in text.split("\n"):
            if not line.strip():
                continue
            while len(line.encode("utf-8")) > max_len:
                cut = max_len // 4  # characters; at most 4 bytes each
                yield line[:cut]
                line = line[cut:]
            yield line


# --------------------------------------------------------------------------- training
def train_sentencepiece(
    input: str | os.PathLike,
    model_prefix: str | os.PathLike,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    json_keys: Sequence[str] = ("text",),
    input_sentence_size: int = 0,
    num_threads: int = 1,
    character_coverage: float = 0.9995,
    seed: int = 1234,
    max_sentence_length: int = 4192,
    log=None,
) -> str:
    """Train a SentencePiece model on ``input`` (jsonl/jsonl.xz/txt) and return the path of
    ``{model_prefix}.model`` (a ``.vocab`` file is written next to it).

    ``input_sentence_size`` > 0 trains on a seeded random sample of that many lines (the rest
    is skipped), which keeps training time bounded on large inputs.
    """
    import sentencepiece as spm

    if model_type not in MODEL_TYPES:
        raise ValueError(f"--model-type must be one of {MODEL_TYPES}, got {model_type!r}")
    if vocab_size < 4 + 256 + 1:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small: 4 special + 256 byte-fallback pieces are "
            "reserved; use at least a few hundred"
        )
    if not Path(input).is_file():
        raise FileNotFoundError(f"--input {input}: no such file")
    prefix = Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)

    sentences = list(_training_sentences(iter_texts(input, json_keys), max_sentence_length))
    if not sentences:
        raise ValueError(f"--input {input}: no non-empty text found under --json-keys {list(json_keys)}")
    n_total = len(sentences)
    if input_sentence_size and n_total > input_sentence_size:
        # Sample here (seeded) rather than with SentencePiece's own sampler, so training is
        # reproducible and the unused lines are never handed over.
        rng = random.Random(seed)
        keep = sorted(rng.sample(range(n_total), input_sentence_size))
        sentences = [sentences[i] for i in keep]
    if log:
        log(f"training a {model_type} SentencePiece model, vocab {vocab_size}, on "
            f"{len(sentences):,} of {n_total:,} lines of {input}")

    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_prefix=str(prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=True,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
            unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>", pad_piece="<pad>",
            # lossless: no NFKC, keep runs of spaces, no leading "▁" added to the text
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=max_sentence_length,
            num_threads=max(1, int(num_threads)),
            hard_vocab_limit=model_type != "unigram",
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training failed for --input {input} "
                         f"--vocab-size {vocab_size}: {e}") from None
    return str(prefix) + ".model"


# --------------------------------------------------------------------------- tokenizers
# Every kind is built by megatron-core (``megatron.core.tokenizers.MegatronTokenizer``); the
# objects carry what its GPT datasets read (``vocab_size``, ``eod``, ``pad``,
# ``unique_identifiers``) and ``tokenize``/``detokenize``.
def _file_md5(path: str | os.PathLike) -> str:
    return hashlib.md5(Path(path).read_bytes(), usedforsecurity=False).hexdigest()


SENTENCEPIECE, HUGGINGFACE, GPT2BPE, NULL = (
    "SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")
TOKENIZER_TYPES = (SENTENCEPIECE, HUGGINGFACE, GPT2BPE, NULL)
# Megatron-LM's GPT2BPETokenizer ends documents with this token.
GPT2_EOD = "<|endoftext|>"
# A tokenizer.json alone names no eos token; these are the end-of-text tokens of common families.
_EOD_CANDIDATES = (GPT2_EOD, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
# Files of a Hugging Face tokenizer directory (a model directory also holds weights: never copied).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                      "chat_template.jinja", "chat_template.json")
CKPT_SP_FILE, CKPT_TOKENIZER_DIR = "tokenizer.model", "tokenizer"


def resolve_tokenizer_type(tokenizer_type: str | None, tokenizer_model=None, vocab_file=None,
                           merge_file=None) -> str | None:
    """``--tokenizer-type``, or the kind the files imply when it is unset: ``--vocab-file`` /
    ``--merge-file`` are GPT-2 BPE, a directory or a ``.json`` file is Hugging Face, any other
    file SentencePiece; None: no tokenizer at all."""
    if tokenizer_type:
        return tokenizer_type
    if vocab_file or merge_file:
        return GPT2BPE
    if not tokenizer_model:
        return None
    p = Path(tokenizer_model)
    return HUGGINGFACE if p.is_dir() or p.suffix == ".json" else SENTENCEPIECE


def _looks_like_sentencepiece(path: Path) -> bool:
    """A SentencePiece model is a protobuf: never JSON text (a tokenizer.json starts with '{')."""
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    return not head.startswith(b"{")


def tokenizer_errors(tokenizer_type: str | None, tokenizer_model=None, vocab_file=None,
                     merge_file=None, vocab_size: int | None = None) -> list[str]:
    """What is wrong with these tokenizer flags (each message names the flag and the fix)."""
    kind = resolve_tokenizer_type(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    errs: list[str] = []
    if kind not in TOKENIZER_TYPES + (None,):
        return [f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}, got {kind!r}"]
    model = Path(tokenizer_model) if tokenizer_model else None
    if model is not None and not model.exists():
        errs.append(f"--tokenizer-model {tokenizer_model}: no such file or directory (a SentencePiece .model "
                    "from tools/train_tokenizer.py, a Hugging Face tokenizer.json or tokenizer directory)")
        return errs
    if kind in (SENTENCEPIECE, HUGGINGFACE) and (vocab_file or merge_file):
        errs.append(f"--vocab-file/--merge-file are GPT-2 BPE files: use --tokenizer-type {GPT2BPE} "
                    "(and drop --tokenizer-model)")
    if kind == SENTENCEPIECE:
        if model is None:
            errs.append(f"--tokenizer-type {SENTENCEPIECE} needs --tokenizer-model FILE.model "
                        "(train one with tools/train_tokenizer.py)")
        elif model.is_dir() or not _looks_like_sentencepiece(model):
            errs.append(f"--tokenizer-model {tokenizer_model} is a Hugging Face tokenizer, not a SentencePiece "
                        f".model: pass --tokenizer-type {HUGGINGFACE} (or leave --tokenizer-type unset to detect it)")
    elif kind == HUGGINGFACE:
        if model is None:
            errs.append(f"--tokenizer-type {HUGGINGFACE} needs --tokenizer-model: a tokenizer.json file or a "
                        "local Hugging Face tokenizer directory")
        elif model.is_dir():
            if not any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                gpt2 = (" (GPT-2 BPE files: pass --vocab-file DIR/vocab.json --merge-file DIR/merges.txt)"
                        if (model / "vocab.json").is_file() and (model / "merges.txt").is_file() else "")
                errs.append(f"--tokenizer-model {tokenizer_model}: the directory holds no tokenizer.json or "
                            f"tokenizer_config.json; point it at a Hugging Face tokenizer directory{gpt2}")
        elif _looks_like_sentencepiece(model):
            errs.append(f"--tokenizer-model {tokenizer_model} is not a Hugging Face tokenizer.json (a SentencePiece "
                        f"model?): pass --tokenizer-type {SENTENCEPIECE}, or a tokenizer.json / HF directory")
    elif kind == GPT2BPE:
        for flag, value, name in (("--vocab-file", vocab_file, "vocab.json"), ("--merge-file", merge_file, "merges.txt")):
            if not value:
                errs.append(f"--tokenizer-type {GPT2BPE} needs {flag} (the GPT-2 {name})")
            elif not Path(value).is_file():
                errs.append(f"{flag} {value}: no such file")
        if model is not None:
            errs.append(f"--tokenizer-type {GPT2BPE} reads --vocab-file and --merge-file, not --tokenizer-model "
                        f"{tokenizer_model}; drop --tokenizer-model")
    elif kind == NULL and (vocab_size is None or int(vocab_size) < 2):
        errs.append(f"--tokenizer-type {NULL} needs --vocab-size >= 2, got {vocab_size}")
    return errs


def _hf_with_eod(tok, where: str):
    """A Hugging Face tokenizer needs an end-of-document id (``--append-eod``, generation stops):
    a bare tokenizer.json names no eos token, so take a well-known end-of-text token it has."""
    if tok.eod is not None:
        return tok
    vocab = set(tok.inv_vocab.values())
    for cand in _EOD_CANDIDATES:
        if cand in vocab:
            tok.add_special_tokens({"eos_token": cand})  # known token: the vocabulary does not grow
            return tok
    raise ValueError(f"--tokenizer-model {where}: the Hugging Face tokenizer defines no eos_token and none of "
                     f"{', '.join(_EOD_CANDIDATES)}; set eos_token in its tokenizer_config.json")


def _staged_hf(files: dict, config: dict | None, user_path) -> object:
    """megatron-core's Hugging Face tokenizer of ``files`` ({name in the staging dir: source}) copied into a
    temporary directory (transformers' AutoTokenizer reads directories, not a lone tokenizer.json, and
    megatron-core's ``megatron`` library would fetch the gpt2 config from the Hub for GPT-2 BPE)."""
    import shutil
    import tempfile

    from megatron.core.tokenizers import MegatronTokenizer

    with tempfile.TemporaryDirectory(prefix="tokenizer-") as d:
        for name, src in files.items():
            shutil.copyfile(src, os.path.join(d, name))
        if config:
            Path(d, "tokenizer_config.json").write_text(json.dumps(config))
        tok = MegatronTokenizer.from_pretrained(d, metadata_path={"library": "huggingface", "model_type": "gpt"})
    tok.path = str(user_path)  # keys the dataset-index cache: the user's file, not the temporary copy
    return _hf_with_eod(tok, user_path)


def _gpt2_bpe(vocab_file, merge_file):
    """Megatron-LM's GPT2BPETokenizer: vocab.json + merges.txt as transformers' GPT2Tokenizer,
    ending documents with <|endoftext|>."""
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    special = {k: GPT2_EOD for k in ("bos_token", "eos_token", "unk_token")} if GPT2_EOD in vocab else {}
    return _staged_hf({"vocab.json": vocab_file, "merges.txt": merge_file},
                      {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, **special}, vocab_file)


def build_tokenizer(tokenizer_type: str | None = SENTENCEPIECE, tokenizer_model=None,
                    vocab_size: int | None = None, vocab_file=None, merge_file=None):
    """The megatron-core tokenizer for ``--tokenizer-type/--tokenizer-model/--vocab-file/--merge-file``
    (``--vocab-size`` for NullTokenizer); ValueError naming the flag on bad input."""
    errs = tokenizer_errors(tokenizer_type, tokenizer_model, vocab_file, merge_file, vocab_size)
    if errs:  # a missing file stays FileNotFoundError, as callers (and the tools' exit code 2) expect
        raise (FileNotFoundError if all("no such file" in e for e in errs) else ValueError)("; ".join(errs))
    kind = resolve_tokenizer_type(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    from megatron.core.tokenizers import MegatronTokenizer

    if kind == SENTENCEPIECE:
        return MegatronTokenizer.from_pretrained(
            str(tokenizer_model), metadata_path={"library": "sentencepiece", "model_type": "gpt"})
    if kind == HUGGINGFACE:
        if Path(tokenizer_model).is_file():
            return _staged_hf({"tokenizer.json": tokenizer_model}, None, tokenizer_model)
        tok = MegatronTokenizer.from_pretrained(
            str(tokenizer_model), metadata_path={"library": "huggingface", "model_type": "gpt"})
        return _hf_with_eod(tok, tokenizer_model)
    if kind == GPT2BPE:
        return _gpt2_bpe(vocab_file, merge_file)
    if kind == NULL:
        return MegatronTokenizer.from_pretrained(
            metadata_path={"library": "null-text", "model_type": "gpt"}, vocab_size=int(vocab_size))
    raise ValueError(f"no tokenizer: pass --tokenizer-model (or --vocab-file/--merge-file), got type {kind!r}")


def data_tokenizer_kind(d) -> str | None:
    """The tokenizer kind a DataConfig trains with; None: none (mock data, NullTokenizer, no files)."""
    kind = resolve_tokenizer_type(d.tokenizer_type, d.tokenizer_model, getattr(d, "vocab_file", None),
                                  getattr(d, "merge_file", None))
    return None if getattr(d, "mock_data", False) or kind in (None, NULL) else kind


def tokenizer_for_data(d):
    """The megatron-core tokenizer of a DataConfig, or None (see ``data_tokenizer_kind``)."""
    kind = data_tokenizer_kind(d)
    if kind is None:
        return None
    return build_tokenizer(kind, d.tokenizer_model, vocab_file=getattr(d, "vocab_file", None),
                           merge_file=getattr(d, "merge_file", None))


# --------------------------------------------------------------------------- with a checkpoint
def save_tokenizer_files(d, dest: str | os.PathLike) -> list[str]:
    """Copy the run's tokenizer files into a checkpoint directory so score/generate/export need
    nothing else: SentencePiece as ``tokenizer.model`` (as before), Hugging Face / GPT-2 BPE files
    under ``tokenizer/``. ``d``: a DataConfig or its dict. Returns the written names."""
    import shutil
    from types import SimpleNamespace

    if isinstance(d, dict):
        d = SimpleNamespace(**d)
    kind, dest = data_tokenizer_kind(d), Path(dest)
    if kind == SENTENCEPIECE:
        shutil.copy2(d.tokenizer_model, dest / CKPT_SP_FILE)
        return [CKPT_SP_FILE]
    if kind is None:
        return []
    out = dest / CKPT_TOKENIZER_DIR
    out.mkdir(exist_ok=True)
    if kind == GPT2BPE:
        pairs = [(d.vocab_file, "vocab.json"), (d.merge_file, "merges.txt")]
    elif Path(d.tokenizer_model).is_dir():
        src = Path(d.tokenizer_model)
        pairs = [(src / n, n) for n in HF_TOKENIZER_FILES if (src / n).is_file()]
    else:
        pairs = [(d.tokenizer_model, "tokenizer.json")]
    for src, name in pairs:
        shutil.copy2(src, out / name)
    return [f"{CKPT_TOKENIZER_DIR}/{name}" for _, name in pairs]


def checkpoint_tokenizer_paths(kind: str | None, ckpt_dir: str | os.PathLike) -> dict:
    """Where ``save_tokenizer_files`` puts a ``kind`` tokenizer in ``ckpt_dir``, as DataConfig fields."""
    ckpt_dir = Path(ckpt_dir)
    saved = ckpt_dir / CKPT_TOKENIZER_DIR
    if kind == SENTENCEPIECE:
        return {"tokenizer_model": str(ckpt_dir / CKPT_SP_FILE)}
    if kind == GPT2BPE:
        return {"vocab_file": str(saved / "vocab.json"), "merge_file": str(saved / "merges.txt")}
    if kind == HUGGINGFACE:
        return {"tokenizer_model": str(saved)}
    return {}


def use_checkpoint_tokenizer(d, ckpt_dir: str | os.PathLike) -> bool:
    """Point DataConfig ``d`` at the tokenizer files saved in ``ckpt_dir`` (True if there are any)."""
    paths = checkpoint_tokenizer_paths(data_tokenizer_kind(d), ckpt_dir)
    if not paths or not all(Path(v).exists() for v in paths.values()):
        return False
    for k, v in paths.items():
        setattr(d, k, v)
    return True
