"""The embedded demo corpus: the Python 3.11 documentation as jsonl.xz (see README.md here).

``CORPUS_PATH`` is the ``python_docs.jsonl.xz`` file (one ``{"text", "source"}`` object per
line), usable directly as ``--input`` of ``tools/train_tokenizer.py`` and
``tools/preprocess_data.py``; ``iter_documents()`` yields its objects.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Iterator

CORPUS_DIR = Path(__file__).resolve().parent
CORPUS_PATH = CORPUS_DIR / "python_docs.jsonl.xz"
LICENSE_PATH = CORPUS_DIR / "LICENSE.txt"


def iter_documents(path: str | Path = CORPUS_PATH) -> Iterator[dict]:
    """Yield ``{"text": str, "source": str}`` for every document of the corpus, in file order."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"embedded corpus {p} is missing; rebuild it with tools/build_corpus.py "
            "(see megatron_md/corpus/README.md)"
        )
    with lzma.open(p, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


__all__ = ["CORPUS_DIR", "CORPUS_PATH", "LICENSE_PATH", "iter_documents"]
