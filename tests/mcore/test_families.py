"""The optimizer-family registry: one entry per --optimizer, and no optimizer named outside it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_md.mcore.families import FAMILIES, MD_OPTIMIZERS, descriptions, family_of
from megatron_md.training.config import FIELDS, resolve, setting

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_md"
# Where the run is built and driven: none of it may branch on an optimizer's name. (Record judging,
# sweep/records.py, names the optimizers whose claims it judges; the sweep's LR ladders are a table.)
NO_NAMES = [*sorted((PKG / "training").rglob("*.py")), PKG / "cli.py", PKG / "sweep" / "coord_check.py",
            PKG / "sweep" / "command.py", PKG / "sweep" / "runner.py", PKG / "sweep" / "grid.py"]


def _name_comparisons(path: Path, root: Path = ROOT) -> list[str]:
    names = set(FAMILIES)
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            text = ast.unparse(node)
            consts = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if "optimizer" in text and consts & names:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
        if isinstance(node, ast.Name) and node.id == "MD_OPTIMIZERS":
            found.append(f"{path.relative_to(root)}:{node.lineno}: MD_OPTIMIZERS")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "endswith":
            if any(isinstance(a, ast.Constant) and a.value == "_md" for a in node.args):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_optimizer_name_is_compared_outside_the_registry():
    found = [hit for path in NO_NAMES for hit in _name_comparisons(path)]
    assert not found, "branch on the family (megatron_md/mcore/families.py) instead:\n" + "\n".join(found)


def test_the_check_catches_a_name_comparison(tmp_path):
    """The check above can fail: branches of the old kind are found."""
    bad = tmp_path / "x.py"
    bad.write_text('if cfg.optimizer.optimizer in ("muon_md", "manifold_muon"):\n    pass\n'
                   'if o.optimizer.endswith("_md"):\n    pass\n'
                   'use = o.optimizer != "adam"\n')
    assert len(_name_comparisons(bad, tmp_path)) == 3


def test_every_optimizer_choice_has_a_family_and_a_description():
    assert list(FIELDS["optimizer"][1].metadata["choices"]) == list(FAMILIES)
    assert set(descriptions()) == set(FAMILIES) and all(descriptions().values())
    assert set(MD_OPTIMIZERS) == {n for n, f in FAMILIES.items() if f is FAMILIES["muon_md"]}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_applies_its_recipe_and_nothing_else(name):
    cfg = resolve("tiny-dense", None, {"optimizer": name})
    for key, value in family_of(cfg).recipe.items():
        assert setting(cfg, key) == value
    explicit = resolve("tiny-dense", None, {"optimizer": name, "weight_decay": 0.05})
    assert explicit.optimizer.weight_decay == 0.05  # a flag the user typed wins over the recipe


def test_importing_the_registry_imports_neither_torch_nor_megatron():
    """--help and `megatron-md plan` import the families; they must stay fast."""
    code = ("import sys; import megatron_md.mcore.families, megatron_md.training.config; "
            "print(any(m == 'torch' or m.startswith('megatron.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_config_knob_is_one_field_and_one_flag():
    """The train parser's flags are exactly the config fields (booleans also get --no-...), each declared once."""
    from megatron_md.training.arguments import train_parser
    from megatron_md.training.config import knobs, section_classes

    declared = [f.name for _, klass in section_classes() for f in knobs(klass)]
    assert len(declared) == len(set(declared)) == len(FIELDS)
    parser = train_parser()
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    extra = dests - set(FIELDS)
    assert set(FIELDS) <= dests, sorted(set(FIELDS) - dests)
    assert extra <= {"config", "model"}, sorted(extra)  # the two flags that are not settings: --config, --model


def test_megatron_configs_carry_the_sections_and_declare_no_knob_again():
    """MD's and Manifold Muon's megatron configs hold the run's typed sections (the same objects), not copies of
    their fields: no knob of ours is declared a second time there."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    from megatron_md.mcore.manifold_optimizer import ManifoldOptimizerConfig

    ours = {f.name for f in dataclasses.fields(ManifoldOptimizerConfig)} - {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert ours == {"md_base", "md_num_layers", "md", "lion", "soap", "ademamix", "manifold", "base_options"}
    cfg = resolve("tiny-dense", None, {"optimizer": "manifold_muon"})
    sections = FAMILIES["manifold_muon"]._sections(cfg)
    assert all(sections[n] is getattr(cfg.optimizer, n) for n in ours & set(sections) - {"base_options"})
    assert len(sections) == 6 and sections["base_options"] == {}  # no plugin base registered here


def test_policy_hooks_save_and_restore_the_auto_switches():
    """Manifold Muon's run hooks: switches made before a save are restored (and logged) after a resume."""
    from types import SimpleNamespace

    from megatron_md.mcore.families import PolicyHooks, RunHooks
    from megatron_md.optim.policy import AutoPolicy

    no_manifold_optimizer = SimpleNamespace()  # the switches are recorded by the policy; none to apply here

    assert RunHooks().state_dict() is None and RunHooks().load_state_dict({"x": 1}, None) == []
    before = PolicyHooks(AutoPolicy("all-dgram", sigma_max_threshold=2.0))
    assert before.observe(no_manifold_optimizer, {"diag/L0.attention.qkv/sigma_max": 1.0}) == []
    switched = before.observe(no_manifold_optimizer, {"diag/L0.attention.qkv/sigma_max": 3.0})
    assert switched == ["auto-geometry: layer 0 attention.qkv: dgram -> stiefel (sigma_max 3 > 2)"]
    after = PolicyHooks(AutoPolicy("all-dgram", sigma_max_threshold=2.0))
    assert after.load_state_dict(before.state_dict(), no_manifold_optimizer) == [f"(restored) {switched[0]}"]
    assert after.policy.assign("attention.qkv", 0).geometry == "stiefel"
    assert after.policy.assign("attention.qkv", 1).geometry == "dgram"


def test_manifold_muon_with_every_matrix_md_takes_md_s_recipe():
    """--geometry md runs every matrix as MD, so the run takes MD's recipe (no weight decay, no warmup, linear
    decay) unless set explicitly; it kept Manifold Muon's, and so Megatron-LM's weight decay 0.01. Mixed
    geometries keep the Manifold Muon recipe."""
    from megatron_md.training.config import resolve

    def run(geometry, **extra):
        o = resolve("tiny-dense", None, {"optimizer": "manifold_muon", "geometry": geometry, **extra}).optimizer
        return o.weight_decay, o.lr_warmup_iters, o.lr_decay_style

    assert run("md") == (0.0, 0, "linear") == run("md", weight_decay=0.0)
    assert run("md", weight_decay=0.1)[0] == 0.1  # an explicit value wins
    assert run("hetero") == run("hetero-md") == (0.01, 0, "cosine")
