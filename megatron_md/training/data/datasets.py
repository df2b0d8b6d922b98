"""Datasets: ``--data-path`` parsing, up-front data validation, megatron-core GPT datasets, demo data.

* ``parse_data_path`` / ``blend_from_data_path``: a prefix, several prefixes, or a weighted
  blend ``"0.3 A 0.7 B"`` (megatron's ``get_blend_from_list`` format).
* ``validate_data``: every problem megatron-core would hit later (missing ``.bin``/``.idx``,
  missing tokenizer model, malformed ``--split``, a split with no or too few tokens -- on
  which ``GPTDataset._get_num_epochs`` loops forever) raised now as a ``ValueError`` naming the
  flag and the fix.
* ``build_gpt_datasets``: ``BlendedMegatronDatasetBuilder(GPTDataset | MockGPTDataset, ...)``.
  Samples are dicts of ``tokens``, ``labels`` (tokens shifted by one), ``loss_mask`` and
  ``position_ids``, each of length ``seq_length`` (blends add ``dataset_id``).
* ``prepare_demo_data``: tokenizer + ``.bin/.idx`` of the embedded Python-docs corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

SPLIT_NAMES = ("train", "validation", "test")
_PREPROCESS_HINT = "create it with tools/preprocess_data.py (it writes PREFIX.bin and PREFIX.idx)"


# --------------------------------------------------------------------------- --data-path
def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def parse_data_path(data_path: Sequence[str] | str | None) -> list[str]:
    """Normalize ``--data-path`` to megatron's flat list: ``["A"]``, ``["A", "B"]`` or
    ``["0.3", "A", "0.7", "B"]``.  Accepts a string or a list of strings; every item is
    split on whitespace, so ``["0.3 A 0.7 B"]`` and ``["0.3", "A", "0.7", "B"]`` are equal."""
    if data_path is None:
        raise ValueError("--data-path: no dataset given; pass a PREFIX (see tools/preprocess_data.py) or --mock-data")
    items = [data_path] if isinstance(data_path, (str, os.PathLike)) else list(data_path)
    tokens = [t for item in items for t in str(item).split()]
    if not tokens:
        raise ValueError("--data-path: no dataset given; pass a PREFIX (see tools/preprocess_data.py) or --mock-data")
    numeric = [_is_number(t) for t in tokens]
    if not any(numeric):
        return tokens  # one or several unweighted prefixes
    shape_ok = len(tokens) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2])
    if not shape_ok:
        raise ValueError(
            f"--data-path {' '.join(tokens)}: expected a PREFIX, several prefixes, or weight/prefix "
            "pairs 'W1 PREFIX1 W2 PREFIX2 ...' (e.g. '0.3 A 0.7 B')"
        )
    weights = [float(t) for t in tokens[0::2]]
    if any(not np.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"--data-path {' '.join(tokens)}: blend weights must be positive numbers")
    return tokens


def blend_from_data_path(data_path: Sequence[str] | str) -> tuple[list[str], Optional[list[float]]]:
    """``--data-path`` as megatron's ``blend``: (prefixes, weights or None)."""
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes, weights = get_blend_from_list(parse_data_path(data_path))
    return list(prefixes), (list(weights) if weights is not None else None)


def data_prefixes(data_path: Sequence[str] | str) -> list[str]:
    tokens = parse_data_path(data_path)
    return tokens[1::2] if _is_number(tokens[0]) else tokens


# --------------------------------------------------------------------------- --split
def parse_split(split: str) -> list[float]:
    """``"949,50,1"`` -> normalized ``[0.949, 0.05, 0.001]``; ValueError naming ``--split``."""
    parts = str(split).split(",")
    if len(parts) != 3 or not all(p.strip() and _is_number(p) for p in parts):
        raise ValueError(
            f"--split {split!r}: must be 3 comma-separated non-negative numbers train,valid,test "
            "(e.g. --split 949,50,1 or --split 90,10,0)"
        )
    weights = [float(p) for p in parts]
    if any(not np.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"--split {split}: weights must be non-negative numbers")
    if weights[0] <= 0:
        raise ValueError(f"--split {split}: the train weight must be positive (e.g. --split 90,10,0)")
    total = sum(weights)
    return [w / total for w in weights]


def split_document_ranges(num_documents: int, split: str) -> list[Optional[tuple[int, int]]]:
    """The ``[begin, end)`` element range megatron gives each split (None: split disabled),
    computed exactly as ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`` does
    (for GPT, the elements are the sequences of the ``.idx``, one per document here)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )

    matrix = convert_split_vector_to_split_matrix(parse_split(split))
    ranges: list[Optional[tuple[int, int]]] = []
    for bookend in matrix:
        if bookend is None:
            ranges.append(None)
        else:
            ranges.append((int(round(bookend[0] * float(num_documents))),
                           int(round(bookend[1] * float(num_documents)))))
    return ranges


# --------------------------------------------------------------------------- .idx reading
def read_sequence_lengths(prefix: str) -> np.ndarray:
    """The per-sequence token counts of ``PREFIX.idx`` (read by megatron-core's ``IndexedDataset``),
    checked against the size of ``PREFIX.bin``; a damaged pair is a ValueError naming ``--data-path``."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    idx, bin_ = prefix + ".idx", prefix + ".bin"
    rebuild = "rebuild it with tools/preprocess_data.py --overwrite"
    try:
        ds = IndexedDataset(prefix, mmap=True)
        # copies: the arrays view the index's mmap, which closes when ``ds`` is collected
        lengths = np.array(ds.sequence_lengths)
        last = int(ds.index.sequence_pointers[-1]) if len(lengths) else 0
        itemsize = np.dtype(ds.index.dtype).itemsize
        del ds
    except (AssertionError, ValueError, OSError, struct.error) as e:  # bad header, truncated index
        raise ValueError(f"--data-path {prefix}: {idx} is not a readable megatron indexed dataset "
                         f"({e or type(e).__name__}); {rebuild}") from None
    expected = last + int(lengths[-1]) * itemsize if len(lengths) else 0
    actual = os.path.getsize(bin_)
    if actual != expected:
        raise ValueError(
            f"--data-path {prefix}: {bin_} holds {actual} bytes but {idx} describes {expected}; "
            f"the pair is inconsistent -- {rebuild}"
        )
    return lengths


def _check_prefix_exists(prefix: str) -> None:
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            raise ValueError(
                f"--data-path {prefix}: give the prefix without {ext} (--data-path {prefix[: -len(ext)]})"
            )
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        hint = ""
        if os.path.isfile(prefix + "_text_document.idx"):
            hint = f" (did you mean --data-path {prefix}_text_document?)"
        raise ValueError(
            f"--data-path {prefix}: {' and '.join(missing)} not found{hint}; {_PREPROCESS_HINT}"
        )


def _check_splits(prefix: str, split: str, seq_length: int,
                  sampled: Sequence[bool] = (True, True, False)) -> None:
    """Every enabled split needs tokens, and a split samples are drawn from needs at least one
    sample's worth (``seq_length + 1`` tokens).

    A split with zero tokens makes ``GPTDataset._get_num_epochs`` loop forever (it adds epochs
    of 0 tokens until it reaches the requested count), even for 0 requested samples.  A split
    with fewer tokens than one sample does not hang, but every sample would repeat the same
    few tokens; that is an error for the splits marked in ``sampled`` (by default train and
    validation: the trainer asks no test samples)."""
    lengths = read_sequence_lengths(prefix)
    n = len(lengths)
    for name, rng, needs_sample in zip(SPLIT_NAMES, split_document_ranges(n, split), sampled):
        if rng is None:
            continue
        beg, end = rng
        docs = end - beg
        tokens = int(lengths[beg:end].astype(np.int64).sum())
        fix = ("use a larger corpus" if name == "train" else
               "use a larger corpus, or give that split a larger share or 0 to disable it "
               "(e.g. --split 90,10,0)")
        if docs == 0 or tokens == 0:
            raise ValueError(
                f"{name} split of --split {split} has {docs} documents and {tokens} tokens of the "
                f"{n} documents in --data-path {prefix} (its share rounds to documents "
                f"[{beg}, {end})); {fix}"
            )
        if needs_sample and tokens < seq_length + 1:
            raise ValueError(
                f"{name} split of --split {split} has {tokens} tokens ({docs} of the {n} documents of "
                f"--data-path {prefix}), fewer than one sample of --seq-length {seq_length} "
                f"(needs {seq_length + 1}); {fix}, or lower --seq-length"
            )


def validate_data(
    data_path: Sequence[str] | str | None,
    split: str,
    seq_length: int,
    tokenizer_model: str | None,
    mock: bool,
) -> None:
    """Raise ``ValueError`` (naming the flag and the fix) for any data problem, before any work.

    Splits: each enabled split of every prefix must hold tokens (else megatron hangs); train and
    validation must hold at least ``seq_length + 1`` tokens (one sample)."""
    if not isinstance(seq_length, (int, np.integer)) or seq_length < 1:
        raise ValueError(f"--seq-length must be a positive integer, got {seq_length!r}")
    if tokenizer_model is not None and not os.path.exists(tokenizer_model):
        raise ValueError(
            f"--tokenizer-model {tokenizer_model}: no such file (train one with tools/train_tokenizer.py, or "
            "pass a Hugging Face tokenizer.json / tokenizer directory)"
        )
    if mock:
        return
    prefixes = data_prefixes(data_path)
    parse_split(split)
    for prefix in prefixes:
        _check_prefix_exists(prefix)
    for prefix in prefixes:
        _check_splits(prefix, split, seq_length)


# --------------------------------------------------------------------------- datasets
def as_megatron_tokenizer(tokenizer=None, vocab_size: int | None = None):
    """A megatron-core tokenizer (``build_tokenizer``) passes through; None becomes megatron-core's
    NullTokenizer of ``vocab_size`` (mock data needs no tokenizer file)."""
    from megatron_md.training.data.tokenizer import build_tokenizer

    if tokenizer is None:
        if vocab_size is None:
            raise ValueError("no tokenizer: pass --tokenizer-model, or --vocab-size for mock data")
        return build_tokenizer("NullTokenizer", vocab_size=vocab_size)
    return tokenizer


def _default_cache_dir(prefixes: Sequence[str]) -> str:
    """``DIR_OF_FIRST_PREFIX/index_cache/<fingerprint>``: megatron keys its index cache on the
    path, not the content, so a re-preprocessed prefix would silently reuse stale indices;
    the fingerprint (path, size and mtime of every ``.bin``/``.idx``) changes when data does."""
    ident = []
    for p in prefixes:
        for ext in (".bin", ".idx"):
            st = os.stat(p + ext)
            ident.append([os.path.abspath(p + ext), st.st_size, st.st_mtime_ns])
    fp = hashlib.md5(json.dumps(ident).encode(), usedforsecurity=False).hexdigest()[:16]
    return os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "index_cache", fp)


def dataset_options(d) -> dict:
    """build_gpt_datasets' keyword arguments from a DataConfig: the per-split paths and the document switches."""
    per_split = (d.train_data_path, d.valid_data_path, d.test_data_path)
    return dict(per_split=per_split if any(per_split) else None, eod_mask_loss=d.eod_mask_loss,
                reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask)


def build_gpt_datasets(
    data_path: Sequence[str] | str | None,
    split: str,
    seq_length: int,
    seed: int,
    tokenizer,
    train_samples: Optional[int],
    valid_samples: Optional[int],
    test_samples: Optional[int],
    mock: bool = False,
    is_built_on_rank: Callable[[], bool] = lambda: True,
    path_to_cache: Optional[str] = None,
    vocab_size: Optional[int] = None,
    per_split: Optional[Sequence[Optional[Sequence[str]]]] = None,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
):
    """Build (train, valid, test) with megatron-core; a split with weight 0 comes back None.

    ``per_split``: (train, valid, test) prefixes or blends ('W1 P1 W2 P2 ...'; None: that split is not built)
    instead of ``data_path`` and ``split`` (Megatron-LM's --train/valid/test-data-path). The three switches are
    GPTDataset's: mask the loss on end-of-document tokens; restart positions, and block attention, at each
    document boundary (the last one builds a per-sample attention mask).

    ``tokenizer``: a megatron-core tokenizer (``tokenizer.build_tokenizer``) or anything with
    ``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers``; None means megatron-core's
    NullTokenizer of ``vocab_size`` (mock data needs no tokenizer file).
    ``path_to_cache`` None: a per-data fingerprinted directory next to the first prefix (see
    ``_default_cache_dir``); mock data is not cached.  When torch.distributed is initialized,
    megatron-core builds on rank 0 first (barriers inside), so call this on every rank.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    tok = as_megatron_tokenizer(tokenizer, vocab_size)
    sizes = [train_samples, valid_samples, test_samples]
    blend_per_split = None
    if mock:
        cls, blend, split_arg = MockGPTDataset, None, None  # megatron uses split 1,1,1 for mock
    elif per_split is not None:
        blend_per_split = [blend_from_data_path(p) if p else None for p in per_split]
        prefixes = [q for b in blend_per_split if b for q in b[0]]
        for prefix in prefixes:
            _check_prefix_exists(prefix)
        sizes = [n if b else None for n, b in zip(sizes, blend_per_split)]
        cls, blend, split_arg = GPTDataset, None, None
        if path_to_cache is None:
            path_to_cache = _default_cache_dir(prefixes)
    else:
        blend = blend_from_data_path(data_path)
        for prefix in blend[0]:
            _check_prefix_exists(prefix)
            # never let GPTDataset loop on an empty split
            _check_splits(prefix, split, seq_length, [n is None or n > 0 for n in sizes])
        cls, split_arg = GPTDataset, split
        if path_to_cache is None:
            path_to_cache = _default_cache_dir(blend[0])
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split_arg,
        path_to_cache=path_to_cache,
        tokenizer=tok,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=reset_attention_mask,  # the mask is only needed where documents split it
        mmap_bin_files=True,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()
    return train, valid, test


# --------------------------------------------------------------------------- demo data
DEMO_PREFIX_NAME = "python_docs"


def prepare_demo_data(work_dir: Path, vocab_size: int = 4096, log=print) -> tuple[str, str]:
    """Tokenizer + indexed dataset of the embedded Python-docs corpus, in ``work_dir``.

    Trains ``work_dir/python_docs_sp{vocab_size}.model`` (BPE, on a seeded sample of lines)
    unless present, then writes ``work_dir/python_docs_text_document.bin/.idx`` unless both
    exist and were made with this tokenizer from this corpus (a small ``.json`` stamp records
    that).  Returns ``(data_prefix, tokenizer_model_path)``.  A few seconds on 2 cores.
    Call it from one process (the CLI does, before launching ranks).
    """
    from megatron_md.corpus import CORPUS_PATH
    from megatron_md.training.data.preprocess import preprocess
    from megatron_md.training.data.tokenizer import _file_md5, train_sentencepiece

    log = log or (lambda *_: None)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if not CORPUS_PATH.is_file():
        raise FileNotFoundError(f"embedded corpus {CORPUS_PATH} is missing (rebuild: tools/build_corpus.py)")

    model = work / f"{DEMO_PREFIX_NAME}_sp{vocab_size}.model"
    if model.is_file():
        log(f"tokenizer: reusing {model}")
    else:
        t0 = time.time()
        tmp_prefix = work / f".{DEMO_PREFIX_NAME}_sp{vocab_size}.tmp{os.getpid()}"
        path = train_sentencepiece(
            CORPUS_PATH, tmp_prefix, vocab_size, model_type="bpe",
            input_sentence_size=100_000, num_threads=min(2, os.cpu_count() or 1), log=log,
        )
        os.replace(str(tmp_prefix) + ".vocab", model.with_suffix(".vocab"))
        os.replace(path, model)  # the .model appears last and complete
        log(f"tokenizer: trained {model} in {time.time() - t0:.1f}s")

    prefix = work / f"{DEMO_PREFIX_NAME}_text_document"
    stamp_path = work / f"{DEMO_PREFIX_NAME}_text_document.json"
    stamp = {"corpus": CORPUS_PATH.name, "corpus_bytes": CORPUS_PATH.stat().st_size,
             "tokenizer_md5": _file_md5(model), "append_eod": True}
    have = all((prefix.parent / (prefix.name + ext)).is_file() for ext in (".bin", ".idx"))
    old = None
    if have and stamp_path.is_file():
        try:
            old = json.loads(stamp_path.read_text())
        except ValueError:
            old = None
    if have and old == stamp:
        log(f"data: reusing {prefix}.bin/.idx")
    else:
        if have:
            log(f"data: {prefix}.bin/.idx were made with another tokenizer or corpus; rebuilding them")
        preprocess(
            CORPUS_PATH, work / DEMO_PREFIX_NAME, tokenizer_model=model, json_keys=["text"],
            append_eod=True, workers=1, overwrite=True, log=log,
        )
        stamp_path.write_text(json.dumps(stamp, indent=1) + "\n")
    return str(prefix), str(model)
