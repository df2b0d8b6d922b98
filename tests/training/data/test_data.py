"""megatron_md.training.data.datasets: --data-path parsing, validation, GPT/mock datasets, demo data."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from test_preprocess import make_docs, write_jsonl  # noqa: E402

from megatron_md.training.data.datasets import (  # noqa: E402
    blend_from_data_path,
    build_gpt_datasets,
    parse_data_path,
    split_document_ranges,
    validate_data,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two preprocessed tiny corpora (60 and 40 documents, eod appended) and their tokenizer."""
    from megatron_md.training.data.preprocess import preprocess
    from megatron_md.training.data.tokenizer import build_tokenizer, train_sentencepiece

    d = tmp_path_factory.mktemp("data")
    docs_a, docs_b = make_docs(60, seed=1), make_docs(40, seed=2)
    model = train_sentencepiece(write_jsonl(d / "a.jsonl", docs_a), d / "sp", 400, num_threads=1)
    preprocess(d / "a.jsonl", d / "a", tokenizer_model=model, append_eod=True, log=None)
    preprocess(write_jsonl(d / "b.jsonl", docs_b), d / "b", tokenizer_model=model, append_eod=True, log=None)
    tok = build_tokenizer("SentencePieceTokenizer", model)
    return d, str(d / "a_text_document"), str(d / "b_text_document"), tok, docs_a


# ----------------------------------------------------------------------------- --data-path
def test_parse_data_path():
    assert parse_data_path("A") == ["A"]
    assert parse_data_path(["A"]) == ["A"]
    assert parse_data_path(["A", "B"]) == ["A", "B"]
    assert parse_data_path("0.3 A 0.7 B") == ["0.3", "A", "0.7", "B"]
    assert parse_data_path(["0.3", "A", "0.7", "B"]) == ["0.3", "A", "0.7", "B"]
    assert parse_data_path(["0.3 A", "0.7 B"]) == ["0.3", "A", "0.7", "B"]
    assert blend_from_data_path("0.3 A 0.7 B") == (["A", "B"], [0.3, 0.7])
    assert blend_from_data_path(["A", "B"]) == (["A", "B"], None)
    assert blend_from_data_path("A") == (["A"], None)
    for bad in (None, "", [], "0.3 A B", "A 0.3", "0.5", "-1 A 2 B", "0 A 1 B", "0.3 A 0.7"):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_path(bad)


def test_split_ranges_match_megatron():
    assert split_document_ranges(1000, "949,50,1") == [(0, 949), (949, 999), (999, 1000)]
    assert split_document_ranges(10, "949,50,1") == [(0, 9), (9, 10), (10, 10)]
    assert split_document_ranges(10, "90,10,0") == [(0, 9), (9, 10), None]


# ----------------------------------------------------------------------------- validate_data
def test_validate_ok_and_mock(data):
    _, a, b, tok, _ = data
    validate_data([a], "90,10,0", 32, tok.path, False)
    validate_data(f"0.3 {a} 0.7 {b}", "90,10,0", 32, tok.path, False)
    validate_data(None, "949,50,1", 32, None, True)  # mock data needs nothing on disk


def test_validate_missing_prefix_names_data_path(data, tmp_path):
    _, a, _, tok, _ = data
    with pytest.raises(ValueError, match=r"--data-path .*nope.*preprocess_data\.py"):
        validate_data([str(tmp_path / "nope")], "90,10,0", 32, tok.path, False)
    with pytest.raises(ValueError, match="without .bin"):
        validate_data([a + ".bin"], "90,10,0", 32, tok.path, False)
    with pytest.raises(ValueError, match="_text_document"):
        validate_data([a[: -len("_text_document")]], "90,10,0", 32, tok.path, False)
    with pytest.raises(ValueError, match="--data-path"):
        validate_data(None, "90,10,0", 32, tok.path, False)


def test_validate_missing_tokenizer_and_bad_split(data, tmp_path):
    _, a, _, tok, _ = data
    with pytest.raises(ValueError, match="--tokenizer-model"):
        validate_data([a], "90,10,0", 32, str(tmp_path / "nope.model"), False)
    for bad in ("90,10", "a,b,c", "90,-10,0", "0,10,0", "90 10 0", "1,2,3,4"):
        with pytest.raises(ValueError, match="--split"):
            validate_data([a], bad, 32, tok.path, False)


def test_validate_catches_empty_split(data, tmp_path):
    """949,50,1 over 10 documents leaves the test split 0 documents: megatron would hang."""
    from megatron_md.training.data.preprocess import preprocess

    _, _, _, tok, _ = data
    preprocess(write_jsonl(tmp_path / "s.jsonl", make_docs(10)), tmp_path / "s",
               tokenizer_model=tok.path, append_eod=True, log=None)
    small = str(tmp_path / "s_text_document")
    with pytest.raises(ValueError, match=r"test split of --split 949,50,1 has 0 documents.*90,10,0"):
        validate_data([small], "949,50,1", 16, tok.path, False)
    # and build_gpt_datasets refuses it too, instead of looping in GPTDataset._get_num_epochs
    t0 = time.time()
    with pytest.raises(ValueError, match="--split 949,50,1"):
        build_gpt_datasets([small], "949,50,1", 16, 1, tok, 10, 10, 0)
    assert time.time() - t0 < 30
    # a validation split holding fewer tokens than one sample of --seq-length
    with pytest.raises(ValueError, match=r"validation split of --split 90,10,0 .*--seq-length 200"):
        validate_data([small], "90,10,0", 200, tok.path, False)
    with pytest.raises(ValueError, match=r"train split of --split 90,10,0 .*--seq-length 4096"):
        validate_data([small], "90,10,0", 4096, tok.path, False)


# ----------------------------------------------------------------------------- datasets
def test_gpt_dataset_samples(data, tmp_path):
    _, a, _, tok, docs = data
    train, valid, test = build_gpt_datasets(
        [a], "80,20,0", 32, 1234, tok, 40, 8, 0, path_to_cache=str(tmp_path / "cache"))
    assert test is None  # weight 0 disables the split
    assert len(train) >= 40 and len(valid) >= 8
    for ds in (train, valid):
        for i in range(5):
            s = ds[i]
            assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
            for k in s:
                assert s[k].shape == (32,)
            assert s["tokens"][1:].tolist() == s["labels"][:-1].tolist()
            assert s["position_ids"].tolist() == list(range(32))
            assert float(s["loss_mask"].sum()) == 32.0
            assert int(s["tokens"].max()) < tok.vocab_size
    assert tok.eod in np.concatenate([train[i]["tokens"].numpy() for i in range(len(train))])
    # samples are documents (shuffled) joined by eod: every eod-free run of a sample is a
    # contiguous stretch of one document's tokens
    docs_ids = ["," + ",".join(map(str, tok.tokenize(d))) + "," for d in docs]
    for i in range(10):
        s = train[i]
        seq = np.concatenate([s["tokens"].numpy(), s["labels"].numpy()[-1:]]).tolist()
        runs, cur = [], []
        for t in seq:
            if t == tok.eod:
                runs.append(cur)
                cur = []
            else:
                cur.append(t)
        runs.append(cur)
        for run in runs:
            if run:
                needle = "," + ",".join(map(str, run)) + ","
                assert any(needle in d for d in docs_ids)
    assert any((tmp_path / "cache").iterdir())


def test_gpt_dataset_default_cache_and_blend(data):
    d, a, b, tok, _ = data
    train, valid, _ = build_gpt_datasets(f"0.3 {a} 0.7 {b}", "90,10,0", 16, 7, tok, 30, 6, 0)
    assert len(train) >= 30 and len(valid) >= 6
    s = train[0]
    assert s["tokens"].shape == (16,) and "dataset_id" in s
    assert s["tokens"][1:].tolist() == s["labels"][:-1].tolist()
    assert (d / "index_cache").is_dir()  # fingerprinted, next to the data


def test_mock_dataset_without_tokenizer():
    train, valid, test = build_gpt_datasets(None, "969,30,1", 16, 1, None, 12, 4, 0, mock=True, vocab_size=128)
    assert len(train) >= 12 and len(valid) >= 4
    s = train[0]
    assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert s["tokens"].shape == (16,) and int(s["tokens"].max()) < 128
    assert s["tokens"][1:].tolist() == s["labels"][:-1].tolist()
    with pytest.raises(ValueError, match="vocab"):
        build_gpt_datasets(None, "969,30,1", 16, 1, None, 12, 4, 0, mock=True)


# ----------------------------------------------------------------------------- embedded corpus
def test_embedded_corpus():
    from megatron_md.corpus import CORPUS_PATH, LICENSE_PATH, iter_documents

    docs = list(iter_documents())
    assert len(docs) > 1000
    assert all(set(d) == {"text", "source"} and d["source"].endswith(".rst") for d in docs)
    assert sum(len(d["text"]) for d in docs) > 6_000_000
    assert 1_000_000 < CORPUS_PATH.stat().st_size < 2_500_000
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in LICENSE_PATH.read_text()


def test_prepare_demo_data(tmp_path):
    """The embedded corpus end to end with a small vocabulary (a few seconds)."""
    from megatron_md.training.data.datasets import prepare_demo_data
    from megatron_md.training.data.tokenizer import build_tokenizer

    msgs = []
    t0 = time.time()
    prefix, model = prepare_demo_data(tmp_path, vocab_size=512, log=msgs.append)
    assert time.time() - t0 < 60
    assert Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()
    assert prefix == str(tmp_path / "python_docs_text_document")
    assert build_tokenizer("SentencePieceTokenizer", model).vocab_size == 512
    validate_data([prefix], "969,30,1", 128, model, False)  # the trainer's default split works
    msgs.clear()
    t0 = time.time()
    assert prepare_demo_data(tmp_path, vocab_size=512, log=msgs.append) == (prefix, model)
    assert time.time() - t0 < 2 and any("reusing" in m for m in msgs)
