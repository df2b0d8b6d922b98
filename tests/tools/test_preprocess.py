"""Tokenizer training, tools/train_tokenizer.py and tools/preprocess_data.py on tiny corpora."""

from __future__ import annotations

import json
import lzma
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
WORDS = ("the a module function returns value list of objects when python string is "
         "called with an argument and raises error for each item in sequence data file "
         "new class method attribute default none true false number").split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        sents = []
        for _ in range(rng.randint(2, 6)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
            sents.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
        text = " ".join(sents)
        if i % 5 == 0:
            text += f"\n\n    >>> f({i})\n    {i * 7}\n"
        if i % 7 == 0:
            text = "  indented start, naïve café\n" + text
        docs.append(text)
    return docs


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    payload = "".join(json.dumps({key: d, "source": f"doc{i}"}) + "\n" for i, d in enumerate(docs))
    if path.suffix == ".xz":
        path.write_bytes(lzma.compress(payload.encode()))
    else:
        path.write_text(payload)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 60-document corpus and a 400-piece BPE tokenizer trained on it."""
    from megatron_md.training.data.tokenizer import train_sentencepiece

    d = tmp_path_factory.mktemp("tiny")
    docs = make_docs(60)
    corpus = write_jsonl(d / "corpus.jsonl", docs)
    model = train_sentencepiece(corpus, d / "sp", 400, num_threads=1)
    return d, docs, corpus, model


def read_documents(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


# ----------------------------------------------------------------------------- tokenizer
def test_tokenizer_ids_and_roundtrip(tiny):
    from megatron_md.training.data.tokenizer import build_tokenizer

    _, docs, _, model = tiny
    tok = build_tokenizer("SentencePieceTokenizer", model)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)  # megatron-core's wrapper gives SentencePiece's own ids
    assert tok.vocab_size == 400 and tok.path == model
    assert (tok.unk, tok.bos, tok.eod, tok.pad) == (0, 1, 2, 3)
    assert tok.eos == tok.eod
    for text in docs[:10] + ["  two  spaces,\ttab\nnewline", "unseen: 東京 — ünïcödé ✓", ""]:
        ids = tok.tokenize(text)
        assert ids == sp.encode(text, out_type=int)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    assert {"class", "tokenizer_path"} <= set(tok.unique_identifiers)


def test_tokenizer_missing_files(tmp_path):
    from megatron_md.training.data.tokenizer import build_tokenizer, train_sentencepiece

    with pytest.raises(FileNotFoundError, match="--input"):
        train_sentencepiece(tmp_path / "nope.jsonl", tmp_path / "sp", 400)
    with pytest.raises(FileNotFoundError, match="--tokenizer-model .*nope.model: no such file"):
        build_tokenizer("SentencePieceTokenizer", tmp_path / "nope.model")


def test_train_tokenizer_cli(tmp_path, tiny):
    _, _, corpus, _ = tiny
    tool = [sys.executable, str(REPO / "tools" / "train_tokenizer.py")]
    r = subprocess.run(tool + ["--input", str(tmp_path / "missing.jsonl"), "--vocab-size", "400",
                               "--model-prefix", str(tmp_path / "sp")], capture_output=True, text=True)
    assert r.returncode == 2 and "--input" in r.stderr and "no such file" in r.stderr
    args = ["--input", str(corpus), "--vocab-size", "320", "--model-type", "unigram",
            "--model-prefix", str(tmp_path / "sp"), "--num-threads", "1", "--input-sentence-size", "50"]
    r = subprocess.run(tool + args, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "sp.model").is_file() and "eod=2" in r.stderr
    r = subprocess.run(tool + args, capture_output=True, text=True)
    assert r.returncode == 2 and "--overwrite" in r.stderr


def test_null_tokenizer():
    from megatron_md.training.data.tokenizer import build_tokenizer

    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.vocab_size == 100 and tok.eod == 99
    assert tok.tokenize("1 2 3") == [1, 2, 3] and tok.detokenize([1, 2, 3]) == "1 2 3"
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer", None)


# ----------------------------------------------------------------------------- preprocess
def test_preprocess_roundtrip(tiny, tmp_path):
    from megatron_md.training.data.preprocess import preprocess
    from megatron_md.training.data.tokenizer import build_tokenizer

    _, docs, corpus, model = tiny
    tok = build_tokenizer("SentencePieceTokenizer", model)
    stats = preprocess(corpus, tmp_path / "out", tokenizer_model=model, append_eod=True, log=None)
    prefix = str(tmp_path / "out_text_document")
    assert stats.prefixes == (prefix,) and stats.documents == len(docs)
    got = read_documents(prefix)
    assert len(got) == len(docs)
    for ids, text in zip(got, docs):
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.detokenize(ids[:-1]) == text
    assert stats.tokens == sum(map(len, got))
    # one sequence per document
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert len(ds.sequence_lengths) == len(docs)
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    assert ds.index.dtype == np.uint16


def test_preprocess_workers_xz_txt_same_output(tiny, tmp_path):
    from megatron_md.training.data.preprocess import preprocess

    _, docs, corpus, model = tiny
    xz = write_jsonl(tmp_path / "c.jsonl.xz", docs)
    txt = tmp_path / "c.txt"
    txt.write_text("".join(d.replace("\n", " ") + "\n" for d in docs))
    preprocess(corpus, tmp_path / "a", tokenizer_model=model, append_eod=True, log=None)
    preprocess(xz, tmp_path / "b", tokenizer_model=model, append_eod=True, workers=2, chunk_size=7, log=None)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a_text_document{ext}").read_bytes() == (tmp_path / f"b_text_document{ext}").read_bytes()
    preprocess(txt, tmp_path / "t", tokenizer_model=model, log=None)
    assert len(read_documents(str(tmp_path / "t_text_document"))) == len(docs)


def test_preprocess_refuses_overwrite(tiny, tmp_path):
    from megatron_md.training.data.preprocess import preprocess

    _, docs, corpus, model = tiny
    preprocess(corpus, tmp_path / "out", tokenizer_model=model, log=None)
    bin_ = tmp_path / "out_text_document.bin"
    before = bin_.read_bytes()
    with pytest.raises(FileExistsError, match="--overwrite"):
        preprocess(corpus, tmp_path / "out", tokenizer_model=model, append_eod=True, log=None)
    assert bin_.read_bytes() == before
    preprocess(corpus, tmp_path / "out", tokenizer_model=model, append_eod=True, overwrite=True, log=None)
    assert len(bin_.read_bytes()) == len(before) + 2 * len(docs)  # one uint16 eod per document
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_preprocess_bad_inputs(tiny, tmp_path):
    from megatron_md.training.data.preprocess import preprocess

    _, _, corpus, model = tiny
    with pytest.raises(FileNotFoundError, match="--input"):
        preprocess(tmp_path / "nope.jsonl", tmp_path / "o", tokenizer_model=model, log=None)
    with pytest.raises(ValueError, match="--json-keys"):
        preprocess(corpus, tmp_path / "o", tokenizer_model=model, json_keys=["body"], log=None)
    assert not list(tmp_path.glob("o_*"))
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        preprocess(corpus, tmp_path / "o", tokenizer_model=tmp_path / "nope.model", log=None)


def test_preprocess_cli(tiny, tmp_path):
    _, docs, corpus, model = tiny
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(corpus),
           "--json-keys", "text", "--output-prefix", str(tmp_path / "cli"), "--tokenizer-type",
           "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod", "--workers", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stderr and f"{len(docs)} documents" in r.stderr
    assert (tmp_path / "cli_text_document.bin").is_file() and (tmp_path / "cli_text_document.idx").is_file()
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and "--overwrite" in r.stderr
