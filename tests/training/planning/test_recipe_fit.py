"""Every shipped recipe states the hardware it is sized for, and fits it.

Each ``examples/**/*.yaml`` has a ``target:`` section (``target_device``, ``target_world_size`` and, for a CPU,
``target_device_memory``) and a ``# Target:`` line in its leading comment that names the same device. Its
plan (``megatron-md plan --config RECIPE --json``, in this process: the planner only computes) must fit that
target with the default 5% of the device's memory spare, in the recipe's own recomputation mode and for the
attention kernel the run will use there (Transformer Engine's flash attention on a GPU target; on a CPU
torch's SDPA, or megatron-core's unfused attention where a recipe pins --attention-backend local).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_md.cli import main
from megatron_md.training.planning.report import DEFAULT_HEADROOM, find_device

EXAMPLES = Path(__file__).resolve().parents[3] / "megatron_md" / "examples"
RECIPES = sorted(EXAMPLES.rglob("*.yaml"))


def _rel(p: Path) -> str:
    return p.relative_to(EXAMPLES).as_posix()


def plan_of(capsys, recipe: Path) -> dict:
    capsys.readouterr()
    rc = main(["plan", "--config", str(recipe), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


@pytest.mark.parametrize("recipe", RECIPES, ids=_rel)
def test_recipe_fits_its_stated_target(capsys, recipe):
    data = yaml.safe_load(recipe.read_text())
    target = data.get("target") or {}
    device, world = target.get("target_device"), target.get("target_world_size")
    assert device and world, f"{_rel(recipe)}: no target section (target_device, target_world_size)"
    head = [ln for ln in recipe.read_text().splitlines() if ln.startswith("#")]
    stated = next((ln for ln in head if ln.startswith("# Target:")), "")
    name = "CPU" if device == "cpu" else find_device(device).name
    assert name in stated, f"{_rel(recipe)}: its '# Target:' comment does not name {name}: {stated!r}"
    on_cpu = device == "cpu"

    plan = plan_of(capsys, recipe)
    mode = plan["per_device"]["recompute"]
    assert plan["layout"]["world"] == world
    assert plan["headroom"] == DEFAULT_HEADROOM and plan["device"]["on_cpu"] is on_cpu
    pinned = (data.get("model") or {}).get("attention_backend")  # the record recipes pin local
    assert plan["attention"]["kernel"] == ("flash" if not on_cpu else "unfused" if pinned == "local" else "sdpa")
    spare = plan["spare_fraction"][mode]
    assert plan["fits"][mode] and spare >= DEFAULT_HEADROOM, (
        f"{_rel(recipe)} on {world} x {device}: {plan['per_device']['total'][mode] / 2**30:.2f} GiB of "
        f"{plan['device_memory'] / 2**30:.2f} GiB, {spare:.1%} spare (recompute {mode})")


def test_every_recipe_is_checked():
    assert len(RECIPES) >= 20 and (EXAMPLES / "tiny_moe_cpu_demo.yaml") in RECIPES
