"""The documentation's references resolve, and its generated blocks are current.

Fast and standard library only (no torch import): it reads the tracked files (``git ls-files``).

1. Every relative Markdown link and image in every tracked ``*.md`` (README.md, docs/, records/*/README.md,
   slurm/README.md, benchmarks/README.md, megatron_md/**/README.md, ...) names an existing file or folder in
   the repository, and an anchor (``docs/usage.md#logs``, ``#logs``) names a heading of that page, slugged
   as GitHub does.
2. Every repository path those pages mention (in backticks, code blocks or plain text), and every one that a
   comment or docstring of a tracked ``*.py``, ``*.sh``, ``*.sbatch`` or ``*.yaml`` mentions, exists. A path is
   a word that contains a ``/`` and ends in one of ``PATH_SUFFIXES``, or a bare Markdown file name
   (``README.md``). It may be written from the repository root, from the mentioning file's folder, or from
   ``megatron_md/`` (code says ``optim/md.py``). Not paths into this repository, and so skipped (``not_a_repo_path``):
   - patterns: a word with a placeholder character (``< > * $ { }``) or ``...``;
   - URLs and paths outside the repository: ``scheme://...``, absolute (``/data/x.json``) and home paths,
     and paths in another project's tree (``DEPENDENCY_ROOTS``: ``megatron/core/...``, ``torch/...``);
   - what a run writes or a user supplies: paths under ``OUTPUT_ROOTS`` (``runs/``, ``logs/``, ``hf/``: the
     docs' example outputs), under a directory named in capitals (``OUT/results.csv``, ``DIR/...``: a
     directory you choose), and one-letter file names (``x.yaml``: any file of yours);
   - a bare suffix (``.md``) and a dotted module name (``megatron_md.optim.md``).
3. No tracked file mentions the design notes that never shipped with the repository (``RETIRED``).
4. ``tools/render_readme_tables.py --check``: the generated blocks of README.md, docs/*.md and the records'
   READMEs match benchmarks/results/ and records/.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import subprocess
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PATH_SUFFIXES = (".py", ".md", ".sh", ".sbatch", ".yaml", ".yml", ".json", ".toml", ".tsv", ".csv", ".png", ".txt")
CODE_SUFFIXES = (".py", ".sh", ".sbatch", ".yaml", ".yml")
BASES = ("", "megatron_md")  # besides the mentioning file's own folder
OUTPUT_ROOTS = {"runs", "logs", "hf"}
DEPENDENCY_ROOTS = {"megatron", "torch", "transformer_engine", "transformers", "emerging_optimizers"}
RETIRED = ("ALGORITHMS" + ".md", "MEGATRON" + "_HOOKS", "shared" + "/design")  # spelt apart: not a mention

# A word that may be a path: what a shell or a Markdown sentence would keep together.
WORD = re.compile(r"[\w./<>*${}~@%+:-]+")
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # may span lines
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
FENCE = re.compile(r"^\s*(```|~~~)")


@lru_cache(maxsize=None)
def tracked() -> tuple[str, ...]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return tuple(p for p in out.decode().split("\0") if p and (REPO / p).is_file())


def pages() -> list[str]:
    return [p for p in tracked() if p.endswith(".md")]


# ----------------------------------------------------------------------------- Markdown


def without_code(text: str) -> str:
    """``text`` with fenced code blocks and code spans blanked (line numbers kept)."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (fence is None or m[1] == fence):
            fence = m[1] if fence is None else None
            out.append("")
        else:
            out.append("" if fence else line)
    span = re.compile(r"(`+)((?:(?!\n\s*\n).)+?)\1", re.DOTALL)  # a code span ends at its paragraph's end
    return span.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), "\n".join(out))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than - and _ removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """Every heading's slug (GitHub numbers repeats: x, x-1, x-2) and every explicit <a id/name>."""
    seen: dict[str, int] = {}
    out = set()
    text = path.read_text()
    for line in without_code(text).splitlines():
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m[1])
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    out.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", without_code(text)))
    return frozenset(out)


def links(page: str):
    """(line, target) of every inline link, image and reference definition outside code."""
    text = without_code((REPO / page).read_text())
    line_of = lambda pos: text.count("\n", 0, pos) + 1  # noqa: E731
    for m in LINK.finditer(text):
        yield line_of(m.start()), m[3]
        for inner in LINK.finditer(m[2]):  # [![badge](img)](target)
            yield line_of(m.start()), inner[3]
    for m in REF_DEF.finditer(text):
        yield line_of(m.start()), m[1]


def broken_link(page: str, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    here = REPO / page
    dest = (here.parent / path).resolve() if path else here
    if not dest.is_relative_to(REPO):
        return "outside the repository"
    if not dest.exists():
        return "no such file"
    if anchor and dest.suffix == ".md" and dest.is_file() and anchor not in anchors(dest):
        return f"no heading with the anchor #{anchor} in {dest.relative_to(REPO)}"
    return None


def test_markdown_links_resolve():
    bad = [f"{page}:{line}: ({target}): {why}" for page in pages() for line, target in links(page)
           if (why := broken_link(page, target))]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_slug_is_githubs():
    assert slug("Planning a job: megatron-md plan") == "planning-a-job-megatron-md-plan"
    assert slug("What `make demo` does") == "what-make-demo-does"
    assert slug("Newton–Schulz & the [engine](x.md)") == "newtonschulz--the-engine"
    assert slug("Tested / not yet tested") == "tested--not-yet-tested"


# ----------------------------------------------------------------------------- path mentions


def not_a_repo_path(word: str) -> bool:
    """The skip rules of this module's docstring, point 2."""
    if any(c in word for c in "<>*${}") or "..." in word or "…" in word:
        return True
    if "://" in word or word.startswith(("/", "~")):
        return True
    if word.split("/", 1)[0] in DEPENDENCY_ROOTS:
        return True
    first, name = word.removeprefix("./").split("/", 1)[0], word.rsplit("/", 1)[-1]
    if "/" in word and re.fullmatch(r"[A-Z][A-Z0-9_]*", first):  # OUT/results.csv: a directory you name
        return True
    if re.fullmatch(r"[A-Za-z]\.\w+", name):  # x.yaml: any file of yours
        return True
    return first in OUTPUT_ROOTS


def mentions(text: str):
    """(line offset, path) for each word of ``text`` that looks like a repository path."""
    for i, line in enumerate(text.splitlines()):
        for m in WORD.finditer(line):
            word = m[0]
            if "://" not in word:
                word = word.split(":", 1)[0]  # file.py:12, file.py::test_name
            word = word.rstrip(".,;:-")
            name = word.rsplit("/", 1)[-1]
            if name.startswith(".") or not word.endswith(PATH_SUFFIXES):  # a bare suffix: `.md`
                continue
            if "/" in word or re.fullmatch(r"[\w-]+\.md", name):  # not megatron_md.optim.md, a module
                if not not_a_repo_path(word):
                    yield i, word


def resolves(path: str, mentioned_in: str) -> bool:
    bases = [(REPO / mentioned_in).parent, *(REPO / b for b in BASES)]
    return any((base / path).exists() for base in bases)


def code_comments(path: str):
    """(line, text) of the comments and docstrings of a tracked code file."""
    text = (REPO / path).read_text(errors="replace")
    if path.endswith(".py"):
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                        isinstance(first.value.value, str):
                    yield first.lineno, first.value.value
    else:  # shell and YAML: from a # that starts the line or follows a blank
        for i, line in enumerate(text.splitlines(), 1):
            m = re.search(r"(?:^|\s)(#.*)$", line)
            if m:
                yield i, m[1]


def dangling_mentions() -> list[str]:
    bad: list[str] = []
    for path in tracked():
        if path.endswith(".md"):
            chunks = [(1, (REPO / path).read_text())]
        elif path.endswith(CODE_SUFFIXES):
            chunks = code_comments(path)
        else:
            continue
        for line, text in chunks:
            for offset, word in mentions(text):
                if not resolves(word, path):
                    bad.append(f"{path}:{line + offset} -> {word}")
    return list(dict.fromkeys(bad))  # a link's text and target often name the same path


def test_mentioned_paths_exist():
    bad = dangling_mentions()
    assert not bad, f"{len(bad)} mentioned paths do not exist:\n" + "\n".join(bad)


def test_mention_rules():
    found = [w for _, w in mentions(
        "see `optim/md.py`, tests/test_a.py::test_b, docs/usage.md#logs and (tools/run.py:12); ./tools/go.sh.\n"
        "not: runs/<time>/config.yaml, $OUT/x.yaml, OUT/results.csv, https://h.org/a.py, /data/t.json, "
        "hf/m/config.json, examples/..., records/*/README.md, logs/run.txt, examples/md_paper/x.yaml, the `.md` "
        "file, megatron_md.optim.md, megatron/core/optimizer/muon.py\nbare README.md and setup.py")]
    assert found == ["optim/md.py", "tests/test_a.py", "docs/usage.md", "tools/run.py", "./tools/go.sh", "README.md"]
    assert resolves("optim/md.py", "tools/x.py") and resolves("grids/example_lr_sweep.tsv", "slurm/README.md")
    assert not resolves("optim/nothing.py", "tools/x.py")


# ----------------------------------------------------------------------------- retired names, generated blocks


def test_no_mention_of_retired_design_notes():
    bad = []
    for path in tracked():
        data = (REPO / path).read_bytes()
        bad += [f"{path}: {name}" for name in RETIRED if name.encode() in data]
    assert not bad, "mentions of files that are not in the repository:\n" + "\n".join(bad)


def test_generated_blocks_are_current(capsys):
    """README.md's and docs/*.md's generated blocks match benchmarks/results and records/ (fix: make readme)."""
    spec = importlib.util.spec_from_file_location("render_readme_tables", REPO / "tools" / "render_readme_tables.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    rc = render.main(["--check"])
    assert rc == 0, capsys.readouterr().out[-4000:]
