"""Tokenize a jsonl(.xz)/txt corpus into megatron-core indexed datasets (``.bin``/``.idx``).

``preprocess(...)`` writes ``{output_prefix}_{key}_document.bin/.idx`` for every json key, one
document per input record (one sequence per document: ``add_document(ids, [len(ids)])``),
optionally followed by the tokenizer's end-of-document id.  Empty records are skipped.  The
result is read by ``megatron.core.datasets.indexed_dataset.IndexedDataset`` and GPTDataset.

Outputs are written to temporary names and renamed into place at the end (``.bin`` first,
``.idx`` last), so an interrupted run never leaves a prefix that looks complete.  Existing
outputs are never overwritten unless ``overwrite=True``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from itertools import islice
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from megatron_md.training.data.tokenizer import build_tokenizer, iter_texts

LEVEL = "document"


def output_prefix_for(output_prefix: str | os.PathLike, key: str) -> str:
    """Megatron-LM naming: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_{LEVEL}"


def output_files(output_prefix: str | os.PathLike, json_keys: Sequence[str]) -> list[str]:
    files = []
    for key in json_keys:
        p = output_prefix_for(output_prefix, key)
        files += [p + ".bin", p + ".idx"]
    return files


@dataclass
class PreprocessStats:
    documents: int = 0          # documents written (per key)
    skipped_empty: int = 0      # records whose text was empty
    tokens: int = 0             # tokens written, eod included (all keys)
    seconds: float = 0.0
    prefixes: tuple[str, ...] = ()


# ----------------------------------------------------------------------- worker side
_TOKENIZER = None
_APPEND_EOD = False


def _init_worker(tokenizer_args: dict, append_eod: bool) -> None:
    # megatron-core's tokenizers cost each worker one import of megatron.core (measured 8-11 s on 2 busy
    # cores, against 0.04 s for sentencepiece alone): a fixed start-up cost, small next to a real corpus.
    global _TOKENIZER, _APPEND_EOD
    _TOKENIZER = build_tokenizer(**tokenizer_args)
    _APPEND_EOD = append_eod


def _encode_chunk(chunk: list[tuple[str, ...]]) -> list[tuple[list[int], ...]]:
    """Tokenize a chunk of records (one text per json key)."""
    tok = _TOKENIZER
    out = []
    for record in chunk:
        encoded = []
        for text in record:
            ids = tok.tokenize(text) if text else []
            if ids and _APPEND_EOD:
                ids.append(tok.eod)
            encoded.append(ids)
        out.append(tuple(encoded))
    return out


def _records(input_path: str, json_keys: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """One tuple of texts (one per key) per input record."""
    texts = iter_texts(input_path, json_keys)
    k = len(json_keys)
    while True:
        rec = tuple(islice(texts, k))
        if not rec:
            return
        yield rec


def _chunks(it: Iterable, size: int) -> Iterator[list]:
    it = iter(it)
    while True:
        c = list(islice(it, size))
        if not c:
            return
        yield c


def _checked(input: str, output_prefix, json_keys: list[str], workers: int, tokenizer_args: dict, append_eod: bool,
             overwrite: bool):
    """The tokenizer, once the input, the keys, the workers and the outputs are checked (before any work)."""
    if not Path(input).is_file():
        raise FileNotFoundError(f"--input {input}: no such file")
    if not json_keys:
        raise ValueError("--json-keys: give at least one key")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    tok = build_tokenizer(**tokenizer_args)  # fail early, in this process
    if append_eod and (tok.eod is None or tok.eod < 0):
        raise ValueError("--append-eod: the tokenizer defines no end-of-document id")
    existing = [f for f in output_files(output_prefix, json_keys) if os.path.exists(f)]
    if existing and not overwrite:
        raise FileExistsError(
            f"--output-prefix {output_prefix}: {', '.join(existing)} already exist; "
            "pass --overwrite to replace them, or choose another --output-prefix"
        )
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    return tok


def _add_documents(encoded_chunks, builders: list, dtype, stats: "PreprocessStats", log, log_interval: float,
                   t0: float) -> None:
    """Each record's ids per json key into that key's builder (a record empty in every key is skipped)."""
    n_records, last = 0, t0
    for chunk in encoded_chunks:
        for record in chunk:
            n_records += 1
            if all(len(ids) == 0 for ids in record):
                stats.skipped_empty += 1
                continue
            for builder, ids in zip(builders, record):
                if not ids:
                    continue
                # one sequence per document: lengths is the list of sequence lengths
                # inside the document, i.e. [len(ids)] (not [0], which makes it empty)
                builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                stats.tokens += len(ids)
            stats.documents += 1
        now = time.time()
        if log and now - last >= log_interval:
            last = now
            log(f"processed {n_records:,} documents, {stats.tokens:,} tokens "
                f"({stats.tokens / max(now - t0, 1e-9):,.0f} tokens/s)")


# ----------------------------------------------------------------------- main entry
def preprocess(
    input: str | os.PathLike,
    output_prefix: str | os.PathLike,
    *,
    tokenizer_type: str | None = None,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    chunk_size: int = 64,
    overwrite: bool = False,
    log: Callable[[str], None] | None = print,
    log_interval: float = 5.0,
) -> PreprocessStats:
    """Tokenize ``input`` and write ``{output_prefix}_{key}_document.bin/.idx`` per json key.

    The tokenizer: ``tokenizer.build_tokenizer`` of the ``tokenizer_*`` / ``vocab_*`` / ``merge_file``
    arguments (``tokenizer_type`` None: detected from the files)."""
    input, json_keys = str(input), list(json_keys)
    tokenizer_args = dict(
        tokenizer_type=tokenizer_type, vocab_size=vocab_size,
        **{k: (str(v) if v is not None else None) for k, v in
           dict(tokenizer_model=tokenizer_model, vocab_file=vocab_file, merge_file=merge_file).items()},
    )
    tok = _checked(input, output_prefix, json_keys, workers, tokenizer_args, append_eod, overwrite)

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tok.vocab_size)
    prefixes = [output_prefix_for(output_prefix, k) for k in json_keys]
    tmp = {p: (f"{p}.bin.tmp{os.getpid()}", f"{p}.idx.tmp{os.getpid()}") for p in prefixes}
    builders = {p: IndexedDatasetBuilder(tmp[p][0], dtype=dtype) for p in prefixes}

    stats = PreprocessStats(prefixes=tuple(prefixes))
    t0 = time.time()
    pool = None
    try:
        chunks = _chunks(_records(input, json_keys), chunk_size)
        if workers > 1:
            pool = get_context("spawn").Pool(
                workers, initializer=_init_worker,
                initargs=(tokenizer_args, append_eod),
            )
            encoded_chunks = pool.imap(_encode_chunk, chunks)  # ordered: output is deterministic
        else:
            _init_worker(tokenizer_args, append_eod)
            encoded_chunks = map(_encode_chunk, chunks)
        _add_documents(encoded_chunks, [builders[p] for p in prefixes], dtype, stats, log, log_interval, t0)
        for p in prefixes:
            builders[p].finalize(tmp[p][1])
    except BaseException:
        for p in prefixes:
            try:
                builders[p].data_file.close()
            except Exception:
                pass
            for f in tmp[p]:
                if os.path.exists(f):
                    os.remove(f)
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()

    for p in prefixes:  # .bin first, .idx last: a prefix is complete once its .idx exists
        os.replace(tmp[p][0], p + ".bin")
        os.replace(tmp[p][1], p + ".idx")
    stats.seconds = time.time() - t0
    if log:
        log(f"wrote {', '.join(p + '.bin/.idx' for p in prefixes)}: {stats.documents:,} documents, "
            f"{stats.tokens:,} tokens ({stats.skipped_empty} empty skipped) in {stats.seconds:.1f}s")
    return stats
