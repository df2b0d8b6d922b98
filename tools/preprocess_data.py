#!/usr/bin/env python3
"""Tokenize a jsonl / jsonl.xz / txt corpus into megatron-core ``.bin``/``.idx`` files.

Example (the embedded demo corpus):

    python tools/train_tokenizer.py --input megatron_md/corpus/python_docs.jsonl.xz \\
        --vocab-size 4096 --model-prefix data/python_docs_sp4096
    python tools/preprocess_data.py --input megatron_md/corpus/python_docs.jsonl.xz \\
        --json-keys text --output-prefix data/python_docs \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/python_docs_sp4096.model \\
        --append-eod --workers 2

(a Hugging Face tokenizer: ``--tokenizer-model tokenizer.json`` or a tokenizer directory; GPT-2 BPE:
``--vocab-file vocab.json --merge-file merges.txt``; ``--tokenizer-type`` is detected from them)
writes ``data/python_docs_text_document.bin`` and ``.idx``; pass
``--data-path data/python_docs_text_document`` to training.  jsonl inputs: one JSON object per
line, the ``--json-keys`` fields are the documents (one output per key); txt inputs: one
document per non-empty line.  Existing outputs are never replaced without ``--overwrite``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import megatron_md  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_parser() -> argparse.ArgumentParser:
    from megatron_md.training.data.tokenizer import TOKENIZER_TYPES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="x.jsonl, x.jsonl.xz, x.jsonl.gz or x.txt")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl fields to tokenize (default: text)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="default: from the files (--vocab-file/--merge-file: GPT2BPETokenizer; a directory or "
                   ".json --tokenizer-model: HuggingFaceTokenizer; another file: SentencePieceTokenizer)")
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model (tools/train_tokenizer.py), Hugging Face tokenizer.json or directory")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document id to each document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    g.add_argument("--overwrite", action="store_true", help="replace existing output files")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument("--chunk-size", type=int, default=64, help="documents per work item")
    g.add_argument("--log-interval", type=float, default=5.0, help="seconds between progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging
    import warnings

    # megatron.core's import chatter on CPU-only machines is irrelevant to preprocessing
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from megatron_md.training.data.preprocess import preprocess

    try:
        preprocess(
            args.input, args.output_prefix,
            tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size, vocab_file=args.vocab_file, merge_file=args.merge_file,
            json_keys=args.json_keys, append_eod=args.append_eod,
            workers=args.workers, chunk_size=args.chunk_size, overwrite=args.overwrite,
            log=lambda m: print(m, file=sys.stderr, flush=True), log_interval=args.log_interval,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
