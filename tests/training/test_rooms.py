"""training/'s rooms import only what their folder allows, and the layers below training/ never import it.

Read from the syntax trees (no import of torch or megatron): every ``import megatron_md.training...`` and
``from megatron_md.training... import ...``, at any depth of a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "megatron_md"
TRAINING = PKG / "training"
TRAINER = "trainer"  # the files directly in training/: config, arguments, validate, build, step, trainer
# What each room may import from training/ besides itself (docs/architecture.md, "The repository").
ALLOWED = {
    "data": set(),
    "checkpoints": {"data"},  # the tokenizer files a checkpoint carries
    "observability": set(),
    "planning": {"observability"},  # the FLOPs formula of the throughput report
    "evaluation": {"checkpoints", "data", TRAINER},  # loads a checkpoint with the trainer's build
}
BELOW = ("mcore", "models", "optim", "parallel", "runtime", "corpus")


def training_imports(path: Path) -> set[str]:
    """The rooms (or TRAINER) of training/ that a file imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] if node.module != "megatron_md.training" else \
                [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["megatron_md", "training"] and len(parts) > 2:
                out.add(parts[2] if (TRAINING / parts[2]).is_dir() else TRAINER)
    return out


def test_every_room_is_listed_and_says_what_it_holds():
    rooms = {p.name for p in TRAINING.iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(ALLOWED)
    for room in rooms:
        assert ast.get_docstring(ast.parse((TRAINING / room / "__init__.py").read_text())).startswith(f"{room}:")


def test_rooms_import_only_what_their_folder_allows():
    bad = []
    for room, allowed in ALLOWED.items():
        for path in sorted((TRAINING / room).rglob("*.py")):
            extra = training_imports(path) - allowed - {room}
            bad += [f"{path.relative_to(PKG)} imports training's {r}" for r in sorted(extra)]
    assert not bad, "\n".join(bad)


def test_the_layers_below_training_never_import_it():
    bad = [str(p.relative_to(PKG)) for d in BELOW for p in sorted((PKG / d).rglob("*.py")) if training_imports(p)]
    assert not bad, bad


def test_the_check_sees_every_kind_of_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import megatron_md.training.data.batches\nfrom megatron_md.training import config as C\n"
                 "def g():\n    from megatron_md.training.checkpoints.integrity import LATEST\n")
    assert training_imports(f) == {"data", TRAINER, "checkpoints"}
