"""The one table of megatron-core internals: each entry still exists and still looks as we use it, no other
private name is touched, and importing megatron_md changes no megatron-core global."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_md.mcore import compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("key", sorted(compat.INTERNALS))
def test_internal_still_looks_as_we_use_it(key):
    entry = compat.INTERNALS[key]
    try:
        obj = entry.resolve()
    except (ImportError, AttributeError) as e:
        pytest.fail(f"megatron-core no longer has {entry.module}.{entry.name} ({e}); we {entry.use} it because "
                    f"{entry.reason}. Checked against megatron-core {compat.CHECKED_AGAINST}.")
    assert entry.check(obj), (f"{entry.module}.{entry.name} changed: expected {entry.expected}. We {entry.use} it "
                              f"because {entry.reason}. Checked against megatron-core {compat.CHECKED_AGAINST}.")


NOT_MEGATRON = {"_option_string_actions": "argparse, on torchrun's parser (cli.py)",
                "_version": "torch.Tensor's in-place write counter (optim/md_batched.py: a stacked state was written)",
                "_base": "torch.Tensor's view base (optim/md_batched.py: msign outputs already stacked)"}


def _private_uses() -> set[str]:
    """``_names`` imported from megatron-core, or read as attributes, that megatron_md does not define itself
    (outside compat.py, and the CPU runtime, whose bridge table lists its own)."""
    trees = {p: ast.parse(p.read_text()) for p in (ROOT / "megatron_md").rglob("*.py")}
    ours = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                ours.add(node.asname)
    found = set()
    for path, tree in trees.items():
        if path.name == "compat.py" or "runtime" in path.parts:
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if not (isinstance(root, ast.Name) and root.id == "torch"):  # torch's own, not megatron's
                    names = [node.attr]
            for n in names:
                private = n.startswith("_") and not n.startswith("__")
                if private and (n not in ours or isinstance(node, ast.ImportFrom)) and n not in NOT_MEGATRON:
                    found.add(f"{path.relative_to(ROOT)}:{node.lineno}: {n}")
    return found


def test_every_private_megatron_name_we_use_is_in_the_table():
    known = {e.name.rsplit(".", 1)[-1] for e in compat.INTERNALS.values()}
    found = {f for f in _private_uses() if f.rsplit(": ", 1)[-1] not in known}
    assert not found, "megatron-core private names used outside mcore/compat.py's table:\n" + "\n".join(sorted(found))


def test_the_scan_finds_private_uses():
    """The scan above can fail: compat.py's own accesses are what it would report elsewhere."""
    tree = ast.parse((ROOT / "megatron_md/mcore/compat.py").read_text())
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
             and not n.attr.startswith("__")}
    assert {"_copy_main_params_to_model_params", "_set_main_param_and_optimizer_states"} <= attrs


def test_importing_megatron_md_changes_no_megatron_global():
    code = r"""
import copy, importlib, pkgutil
import megatron.core.tensor_parallel.layers as layers
import megatron.core.optimizer.emerging_optimizers as eo
import megatron.core.optimizer.clip_grads as cg
kernels = lambda: (cg.l2_norm_impl, cg.multi_tensor_scale_impl, cg.multi_tensor_scale_tensor_impl)
before = (copy.copy(layers._MODEL_PARALLEL_ATTRIBUTE_DEFAULTS), set(eo._EMERGING_OPTIMIZERS), kernels())
import megatron_md
for m in pkgutil.walk_packages(megatron_md.__path__, "megatron_md."):
    if m.name.endswith("__main__"):
        continue
    importlib.import_module(m.name)
after = (layers._MODEL_PARALLEL_ATTRIBUTE_DEFAULTS, set(eo._EMERGING_OPTIMIZERS), kernels())
print("same" if before == after else f"changed: {before} -> {after}")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "same"


def test_install_adds_our_param_attributes_once():
    defaults = compat.get("_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS")
    compat.install()
    compat.install()
    for attr, default in compat.PARAM_ATTRIBUTES.items():
        assert attr in defaults and defaults[attr] == default


def test_kernel_install_is_explicit_idempotent_and_undone():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from megatron_md.mcore import multi_tensor

    ours = (multi_tensor.l2_norm, multi_tensor.scale, multi_tensor.scale_by_tensor)
    compat.restore_multi_tensor_kernels()
    try:
        assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm  # this install has neither Apex nor TE
        assert compat.install_multi_tensor_kernels(*ours) and compat.install_multi_tensor_kernels(*ours)
        assert (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl,
                clip_grads.multi_tensor_scale_tensor_impl) == ours
    finally:
        compat.restore_multi_tensor_kernels()
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_tensor_impl is None


def test_source_checks_fail_on_other_code():
    """The behaviour checks read megatron's source: they refuse a function that does not hold it."""
    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        return sum(float(g.norm()) for g in grads_for_norm)

    for key in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32",
                "DistributedOptimizer._copy_main_params_to_model_params"):
        assert not compat.INTERNALS[key].check(get_grad_norm_fp32), key
