"""SentencePiece tokenizer: training (``train_sentencepiece``) and a small wrapper (``Tokenizer``).

The wrapper exposes what megatron-core's datasets read from a tokenizer (``vocab_size``, ``eod``,
``eos``, ``pad``, ``bos``, ``unique_identifiers``), so an instance can be passed directly as
``GPTDatasetConfig.tokenizer``.

Special ids are fixed by ``train_sentencepiece``: ``<unk>``=0, ``<s>``=1, ``</s>``=2 (the
end-of-document token appended by ``tools/preprocess_data.py --append-eod``), ``<pad>``=3,
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
from collections import OrderedDict
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
def _file_md5(path: str | os.PathLike) -> str:
    return hashlib.md5(Path(path).read_bytes(), usedforsecurity=False).hexdigest()


class Tokenizer:
    """A SentencePiece model with the attributes megatron-core datasets expect."""

    def __init__(self, model_path: str | os.PathLike) -> None:
        import sentencepiece as spm

        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"--tokenizer-model {model_path}: no such file (train one with tools/train_tokenizer.py)"
            )
        self.model_path = str(path)
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self._md5 = _file_md5(path)

    # ids
    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Keys megatron-core hashes into its dataset-index cache names."""
        return OrderedDict(
            [("class", f"{type(self).__module__}.{type(self).__qualname__}"),
             ("tokenizer_path", self.model_path), ("md5", self._md5),
             ("vocab_size", self.vocab_size)]
        )

    # text <-> ids
    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


class NullTokenizer:
    """Mock-data tokenizer: text is space-separated ids; eod is ``vocab_size - 1``, no pad."""

    def __init__(self, vocab_size: int, eod_id: int | None = None) -> None:
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 2, got {vocab_size}")
        self._vocab_size = int(vocab_size)
        self._eod = int(eod_id) if eod_id is not None else self._vocab_size - 1
        self.model_path = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return -1

    @property
    def pad(self) -> int:
        return -1

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [("class", f"{type(self).__module__}.{type(self).__qualname__}"),
             ("vocab_size", self._vocab_size), ("eod_id", self._eod)]
        )

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self._vocab_size})"


TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer")


def build_tokenizer(
    tokenizer_type: str = "SentencePieceTokenizer",
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
) -> Tokenizer | NullTokenizer:
    """``--tokenizer-type`` / ``--tokenizer-model`` / ``--vocab-size`` to a tokenizer."""
    if tokenizer_type == "SentencePieceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model FILE.model")
        return Tokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type must be one of {TOKENIZER_TYPES}, got {tokenizer_type!r}")
