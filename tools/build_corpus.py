#!/usr/bin/env python3
"""Build the embedded demo corpus ``megatron_md/corpus/python_docs.jsonl.xz``.

Source: the reStructuredText sources of the Python 3.11 documentation as shipped in the
Debian package ``python3.11-doc`` (3.11.2-6+deb12u9), directory
``usr/share/doc/python3.11/html/_sources``.  Get them with::

    apt-get download python3.11-doc
    dpkg-deb -x python3.11-doc_3.11.2-6+deb12u9_all.deb /tmp/pydoc

then run ``python tools/build_corpus.py`` (``--source-root`` to point elsewhere).

One JSON object per document: ``{"text": ..., "source": "library/functools.rst"}``, where a
document is a run of consecutive sections of one source file, at least ~4000 characters long
(section boundaries are kept, so documents start at a heading).  Documents are shuffled with a
fixed seed, because Megatron's ``--split`` cuts train/valid/test as contiguous document ranges.
reST markup is lightly cleaned so the text reads like the rendered documentation
(roles, targets, index entries, heading adornments and directive boilerplate removed; code
examples are kept verbatim).  Output is deterministic: files are visited in sorted order, the
shuffle is seeded, and the result is compressed with Python's ``lzma`` at a fixed preset, so rerunning gives identical bytes.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import re
import sys
import textwrap
from pathlib import Path

DEFAULT_SOURCE_ROOT = "/tmp/pydoc/usr/share/doc/python3.11/html/_sources"
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "megatron_md" / "corpus" / "python_docs.jsonl.xz"
# Directories (relative to _sources) taken into the corpus, in this order of preference.
# c-api, distutils, install, distributing and the top-level front-matter pages are left out.
DEFAULT_DIRS = ("tutorial", "howto", "faq", "reference", "library", "whatsnew", "using", "extending")
MIN_DOC_CHARS = 500  # toctree-only index pages clean down to a title or two: dropped
CHUNK_CHARS = 4000  # sections are merged into documents of at least this many characters
RELEASE = "3.11"

# ---------------------------------------------------------------------------- directives
DROP = {
    "module", "moduleauthor", "sectionauthor", "index", "testsetup", "testcleanup", "toctree",
    "highlight", "currentmodule", "image", "figure", "raw", "include", "literalinclude",
    "tabularcolumns", "audit-event", "audit-event-table", "contents",
    "program", "role", "default-role", "miscnews", "limited-api-list", "c:namespace",
    "c:namespace-push", "c:namespace-pop", "cssclass", "rst-class", "sectnum", "grammar-snippet",
}
LITERAL = {"productionlist", "code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "parsed-literal"}
ADMONITION = {
    "note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:",
    "caution": "Caution:", "attention": "Attention:", "tip": "Tip:", "hint": "Hint:",
    "danger": "Danger:", "impl-detail": "CPython implementation detail:",
}
OBJECT = {
    "function", "method", "class", "attribute", "data", "exception", "decorator",
    "decoratormethod", "classmethod", "staticmethod", "abstractmethod", "coroutinefunction",
    "coroutinemethod", "awaitablefunction", "awaitablemethod", "opcode", "cmdoption", "option",
    "envvar", "describe", "object", "pdbcommand", "2to3fixer", "c:function", "c:type",
    "c:macro", "c:member", "c:var", "c:struct", "c:data",
}

DIRECTIVE_RE = re.compile(r"^\.\.\s+([A-Za-z0-9_:-]+)::(?:\s+(.*))?$")
ADORNMENT_RE = re.compile(r"""^([=\-~*^#"'`+_.:<>])\1{2,}(\s+\1{2,})*$""")
GRID_BORDER_RE = re.compile(r"^\+[-=+]+\+$")
OPTION_RE = re.compile(r"^:[\w -]+:(\s|$)")
ROLE_RE = re.compile(r":(?:[A-Za-z0-9_-]+:)*[A-Za-z0-9_-]+:`([^`]+)`")
LINK_RE = re.compile(r"`([^`<]+?)\s*<[^>`]*>`_{1,2}")
NAMED_REF_RE = re.compile(r"`([^`]+)`_{1,2}(?!\w)")
FOOTNOTE_REF_RE = re.compile(r"\s?\[(?:#\w*|\d+|\*)\]_")
LITERAL_RE = re.compile(r"``(.+?)``", re.S)
STRONG_RE = re.compile(r"\*\*([^*\s](?:[^*]*?[^*\s])?)\*\*")
EMPH_RE = re.compile(r"(?<![\w*\\])\*([^*\s](?:[^*]*?[^*\s])?)\*(?![\w*])")
SUBST_RE = re.compile(r"\|(release|version|today)\|")


# ":ref:`label`" renders as the title of the section the label points at; filled by build().
LABEL_TITLES: dict[str, str] = {}


def collect_label_titles(files: list[Path]) -> dict[str, str]:
    """Map reST targets (``.. _label:``) placed right before a section title to that title."""
    titles: dict[str, str] = {}
    for path in files:
        lines = path.read_text(encoding="utf-8").split("\n")
        for k, line in enumerate(lines):
            m = re.match(r"^\.\. _([^:]+):\s*$", line)
            if not m:
                continue
            rest = [l.rstrip() for l in lines[k + 1 : k + 8] if l.strip()]
            rest = [l for l in rest if not re.match(r"^\.\. _[^:]+:\s*$", l)]
            if len(rest) >= 2 and ADORNMENT_RE.match(rest[0].strip()) and len(rest) >= 3:
                rest = rest[1:]  # over-and-under title
            if len(rest) >= 2 and ADORNMENT_RE.match(rest[1].strip()) and not rest[0].startswith(".."):
                titles.setdefault(m.group(1).lower(), rest[0].strip())
    return titles


def _role_text(m: re.Match) -> str:
    role = m.group(0)[1 : m.group(0).index(":`")]
    body = m.group(1).strip()
    explicit = re.match(r"^(.*?)\s*<[^>]*>$", body, re.S)
    if explicit and explicit.group(1):
        return explicit.group(1)
    body = body.lstrip("!")
    if role in ("pep", "rfc"):
        return f"{role.upper()} {body.split('#')[0].strip()}"
    if role == "issue":
        return f"bpo-{body}"
    if role == "gh":
        return f"gh-{body}"
    if role == "samp":
        return re.sub(r"\{([^}]*)\}", r"\1", body)
    if role == "ref" and body.lower() in LABEL_TITLES:
        return clean_inline(LABEL_TITLES[body.lower()])
    if role == "ref":
        return body.replace("-", " ")
    if body.startswith("~"):
        body = body[1:].rsplit(".", 1)[-1]
    return body


def clean_inline(text: str) -> str:
    text = SUBST_RE.sub(RELEASE, text)
    text = ROLE_RE.sub(_role_text, text)
    text = LINK_RE.sub(r"\1", text)
    text = FOOTNOTE_REF_RE.sub("", text)
    text = LITERAL_RE.sub(r"\1", text)
    text = NAMED_REF_RE.sub(r"\1", text)
    text = STRONG_RE.sub(r"\1", text)
    text = EMPH_RE.sub(r"\1", text)
    text = text.replace("\\ ", "").replace("\\*", "*").replace("\\_", "_").replace("\\`", "`")
    return text


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _strip_options(body: list[str]) -> list[str]:
    """Drop the ``:option: value`` lines that open a directive body."""
    k = 0
    while k < len(body) and body[k].strip() and OPTION_RE.match(body[k].strip()):
        k += 1
    return body[k:]


def _emit(out: list[str], lines: list[str], ind: int) -> None:
    pad = " " * ind
    out.extend(pad + l if l.strip() else "" for l in lines)


def clean_block(lines: list[str]) -> list[str]:
    """Clean one (dedented) block of reST lines; recursive over directive bodies."""
    out: list[str] = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i].rstrip()
        s = line.strip()
        if not s:
            out.append("")
            i += 1
            continue
        ind = _indent(line)
        if s.startswith(".. ") or s == "..":
            # explicit markup: directive, comment, target, substitution or footnote
            j = i + 1
            while j < n and (not lines[j].strip() or _indent(lines[j]) > ind):
                j += 1
            body = [l.rstrip() for l in lines[i + 1 : j]]
            while body and not body[-1].strip():
                body.pop()
            body = textwrap.dedent("\n".join(body)).split("\n") if body else []
            i = j
            m = DIRECTIVE_RE.match(s)
            if not m:
                fn = re.match(r"^\.\.\s+\[(#\w*|\d+|\*)\]\s*(.*)$", s)
                if fn:  # footnote: keep its text
                    _emit(out, clean_block([fn.group(2)] + body), ind)
                    out.append("")
                continue  # comment, hyperlink target, substitution definition
            name, arg = m.group(1), (m.group(2) or "").strip()
            if name in DROP:
                continue
            if name in LITERAL:
                body = _strip_options(body)
                if name == "productionlist":  # grammar rules: `name` marks a cross-reference
                    body = [re.sub(r"`([^`]+)`", r"\1", l) for l in body]
                while body and not body[0].strip():
                    body.pop(0)
                _emit(out, body, ind)
                out.append("")
                continue
            if name in OBJECT:
                sigs = [arg] if arg else []
                k = 0
                while k < len(body) and body[k].strip() and not OPTION_RE.match(body[k].strip()):
                    sigs.append(body[k].strip())  # continuation signature lines
                    k += 1
                body = _strip_options(body[k:])
                for sig in sigs:
                    out.append(" " * ind + clean_inline(sig))
                out.append("")
                _emit(out, clean_block(body), ind)
                out.append("")
                continue
            body = _strip_options(body)
            if name in ("versionadded", "versionchanged", "deprecated", "deprecated-removed"):
                parts = arg.split(None, 2 if name == "deprecated-removed" else 1)
                if name == "versionadded":
                    head = f"New in version {parts[0] if parts else ''}"
                elif name == "versionchanged":
                    head = f"Changed in version {parts[0] if parts else ''}"
                elif name == "deprecated":
                    head = f"Deprecated since version {parts[0] if parts else ''}"
                else:
                    head = f"Deprecated since version {parts[0] if parts else ''}, will be removed in version {parts[1] if len(parts) > 1 else ''}"
                rest = parts[-1] if len(parts) > (2 if name == "deprecated-removed" else 1) else ""
                text = clean_block(([rest] if rest else []) + body)
                while text and not text[0].strip():
                    text.pop(0)
                if text:
                    out.append(" " * ind + head + ": " + text[0].strip())
                    _emit(out, text[1:], ind)
                else:
                    out.append(" " * ind + head + ".")
                out.append("")
                continue
            if name == "availability":
                out.append(" " * ind + "Availability: " + clean_inline(arg))
                out.append("")
                continue
            if name in ADMONITION:
                text = clean_block(([arg] if arg else []) + body)
                while text and not text[0].strip():
                    text.pop(0)
                if text:
                    out.append(" " * ind + ADMONITION[name] + " " + text[0].strip())
                    _emit(out, text[1:], ind)
                    out.append("")
                continue
            # rubric, topic, sidebar, admonition, only, glossary, list-table, table, epigraph...
            if arg and name in ("rubric", "topic", "sidebar", "admonition", "table"):
                out.append(" " * ind + clean_inline(arg))
                out.append("")
            _emit(out, clean_block(body), ind)
            out.append("")
            continue
        if ADORNMENT_RE.match(s) or GRID_BORDER_RE.match(s):
            i += 1
            continue
        # a paragraph: consecutive text lines, cleaned together so that inline markup
        # spanning a line break is handled; a trailing "::" opens a literal block
        para = []
        while i < n:
            t = lines[i].rstrip()
            ts = t.strip()
            if not ts or ts.startswith(".. ") or ts == ".." or ADORNMENT_RE.match(ts) \
                    or GRID_BORDER_RE.match(ts):
                break
            i += 1
            if not re.match(r"^:(tocdepth|orphan|nosearch|tabsize):", ts):  # file-wide metadata
                para.append(re.sub(r"^(\s*):(\w[\w ]*):(\s|$)", r"\1\2:\3", t))  # ":Author: x"
        if not para:
            continue
        last = para[-1]
        lit_ind = _indent(last)
        if len(para) == 1:  # "* item::" -- the item's text, not the bullet, sets the indent
            bullet = re.match(r"^\s*(?:[-*+]|\d+\.|#\.|\(\w+\))\s+", last)
            if bullet:
                lit_ind = len(bullet.group(0))
        literal = last.endswith("::")
        if literal:
            if last.strip() == "::":
                para.pop()
            elif last.endswith(" ::"):
                para[-1] = last[:-3]
            else:
                para[-1] = last[:-1]
        if para:
            out.extend(clean_inline("\n".join(para)).split("\n"))
        if literal:
            while i < n and not lines[i].strip():
                out.append("")
                i += 1
            while i < n and (not lines[i].strip() or _indent(lines[i]) > lit_ind):
                out.append(lines[i].rstrip())
                i += 1
    return out


SECTION_MARK = "\ue000"  # (private-use char) inserted before every section title, split on after cleaning


def _mark_sections(lines: list[str]) -> list[str]:
    """Put a SECTION_MARK line before each (top-level, adorned) section title."""
    out: list[str] = []
    for k, line in enumerate(lines):
        nxt = lines[k + 1].rstrip() if k + 1 < len(lines) else ""
        title = line.rstrip()
        if (title and not title[0].isspace() and not title.startswith("..")
                and re.fullmatch(r"""([=\-~*^#"'+])\1{2,}""", nxt) and len(nxt) >= len(title)
                and not ADORNMENT_RE.match(title.strip())):
            if out and out[-1].strip() and out[-1].strip()[0] * len(nxt) == out[-1].strip():
                out.insert(len(out) - 1, SECTION_MARK)  # over-and-under title
            else:
                out.append(SECTION_MARK)
        out.append(line)
    return out


def clean_document(raw: str) -> list[str]:
    """Clean one reST file; return its text cut into section-aligned chunks."""
    lines = raw.replace("\r\n", "\n").replace("\t", "        ").split("\n")
    text = "\n".join(l.rstrip() for l in clean_block(_mark_sections(lines)))
    chunks: list[str] = []
    cur = ""
    for section in text.split(SECTION_MARK):
        section = re.sub(r"\n{3,}", "\n\n", section).strip()
        if not section:
            continue
        cur = f"{cur}\n\n{section}" if cur else section
        if len(cur) >= CHUNK_CHARS:
            chunks.append(cur + "\n")
            cur = ""
    if cur:
        if chunks and len(cur) < MIN_DOC_CHARS * 5:
            chunks[-1] = chunks[-1] + "\n" + cur + "\n"  # fold a short tail into the last chunk
        else:
            chunks.append(cur + "\n")
    return chunks


def build(source_root: Path, dirs: tuple[str, ...], seed: int = 1234) -> list[dict]:
    files = sorted(
        (p for d in dirs for p in (source_root / d).rglob("*.rst.txt") if p.is_file()),
        key=lambda p: p.relative_to(source_root).as_posix(),
    )
    LABEL_TITLES.clear()
    LABEL_TITLES.update(collect_label_titles(
        sorted(source_root.rglob("*.rst.txt"), key=lambda p: p.relative_to(source_root).as_posix())))
    docs = []
    for path in files:
        rel = path.relative_to(source_root).as_posix()
        rel = rel[: -len(".txt")] if rel.endswith(".txt") else rel
        for chunk in clean_document(path.read_text(encoding="utf-8")):
            if len(chunk) >= MIN_DOC_CHARS:
                docs.append({"text": chunk, "source": rel})
    # Megatron splits train/valid/test as contiguous document ranges: shuffle (seeded, so the
    # output stays deterministic) so that every split samples the whole documentation.
    random.Random(seed).shuffle(docs)
    return docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source-root", default=DEFAULT_SOURCE_ROOT,
                    help="the html/_sources directory of the extracted python3.11-doc package")
    ap.add_argument("--dirs", nargs="+", default=list(DEFAULT_DIRS),
                    help="sub-directories of --source-root to include")
    ap.add_argument("--output", default=str(DEFAULT_OUTPUT))
    args = ap.parse_args(argv)

    root = Path(args.source_root)
    missing = [d for d in args.dirs if not (root / d).is_dir()]
    if missing:
        print(f"error: --source-root {root} lacks {missing}. Extract the Debian package first:\n"
              "  apt-get download python3.11-doc && "
              "dpkg-deb -x python3.11-doc_3.11.2-6+deb12u9_all.deb /tmp/pydoc", file=sys.stderr)
        return 2
    docs = build(root, tuple(args.dirs))
    payload = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    blob = lzma.compress(payload, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(blob)
    raw_chars = sum(len(d["text"]) for d in docs)
    raw_bytes = sum(len(d["text"].encode("utf-8")) for d in docs)
    print(f"wrote {out}: {len(docs)} documents, {raw_chars:,} characters "
          f"({raw_bytes:,} bytes of text, {len(payload):,} bytes of jsonl), "
          f"{len(blob):,} bytes compressed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
