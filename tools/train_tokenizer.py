#!/usr/bin/env python3
"""Train a SentencePiece tokenizer (BPE or unigram, byte fallback) on a jsonl / jsonl.xz / txt file.

Example (the embedded demo corpus, ~1 s with BPE):

    python tools/train_tokenizer.py --input megatron_md/corpus/python_docs.jsonl.xz \\
        --json-keys text --vocab-size 4096 --model-prefix data/python_docs_sp4096

writes ``data/python_docs_sp4096.model`` (pass it as ``--tokenizer-model``) and ``.vocab``.
Ids: <unk>=0, <s>=1, </s>=2 (end of document), <pad>=3, then the 256 byte pieces.  The text is
not normalized and spaces are kept, so detokenize(tokenize(text)) == text.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

try:
    import megatron_md  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="x.jsonl, x.jsonl.xz, x.jsonl.gz or x.txt (one document per line)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl fields to train on (default: text)")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="train on a seeded random sample of this many lines (0: all)")
    p.add_argument("--num-threads", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_md.training.data.tokenizer import build_tokenizer, train_sentencepiece

    model = Path(args.model_prefix + ".model")
    if model.exists() and not args.overwrite:
        print(f"train_tokenizer.py: error: {model} already exists; pass --overwrite to replace it",
              file=sys.stderr)
        return 2
    try:
        path = train_sentencepiece(
            args.input, args.model_prefix, args.vocab_size, model_type=args.model_type,
            json_keys=args.json_keys, input_sentence_size=args.input_sentence_size,
            num_threads=args.num_threads, character_coverage=args.character_coverage,
            seed=args.seed, log=lambda m: print(m, file=sys.stderr, flush=True),
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"train_tokenizer.py: error: {e}", file=sys.stderr)
        return 2
    tok = build_tokenizer("SentencePieceTokenizer", path)  # as training will read it: megatron-core's
    print(f"wrote {path} (vocab {tok.vocab_size}; unk={tok.unk} bos={tok.bos} eod={tok.eod} pad={tok.pad})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
