"""What an MoE LR-transfer record (``records/<date>-moe-lr-transfer``) adds to the dense one's table and claims.

- **The expert-count axis**, ``experts/<n>/results.csv``: one ``lr-sweep`` per number of experts ``n`` at one
  width (MuonMD and AdamW), judged like the width axis: does MuonMD's optimum stay within one √2 step as the
  experts multiply (each then sees fewer tokens)?
- **The diagnostics reruns**, ``checks/diagnostics-<family>/`` (``moe`` and ``dense``): the cell at each
  width's optimum (seed 1) rerun with ``--diagnostics-interval`` and ``--log-update-norms``. Their per-group
  relative update (attention, dense MLP, experts, router) and expert load say which matrices an LR moves most,
  and the rerun's final loss equal to its cell's says the diagnostics changed nothing.

Standard library only, like ``records.py`` (the README renderer uses it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Optional

from megatron_md.sweep.records import Best, Claim, best_per_curve, drift_claim, lr_transfer_claims
from megatron_md.sweep.results import read_csv

GROUPS = ("attention", "mlp", "experts", "router")  # diag/L<i>.<role> -> group, by the role's first word


def group_of(label: str) -> Optional[str]:
    """``L3.attention.qkv`` -> attention, ``L0.mlp.fc1`` -> mlp (a dense layer's), ``L1.expert5.fc2`` -> experts,
    ``L2.router`` -> router; None for anything else."""
    role = label.split(".", 1)[1] if "." in label else ""
    if role.startswith("expert"):
        return "experts"
    head = role.split(".", 1)[0]
    return head if head in GROUPS else None


def expert_axis(record: Path) -> dict[str, dict[int, Best]]:
    """optimizer -> number of experts -> Best, from ``experts/<n>/results.csv`` (one width each)."""
    out: dict[str, dict[int, Best]] = {}
    for csv_path in sorted(Path(record).glob("experts/*/results.csv"), key=lambda p: int(p.parent.name)):
        n = int(csv_path.parent.name)
        widths = {r["width"] for r in read_csv(csv_path)}
        if len(widths) != 1:
            raise ValueError(f"{csv_path}: an expert-count sweep runs one width, found {sorted(widths)}")
        for (opt, _, _, _), b in best_per_curve(read_csv(csv_path)).items():
            if n in out.setdefault(opt, {}):
                raise ValueError(f"{csv_path}: several warmup/weight-decay recipes for {opt}")
            out[opt][n] = b
    return out


def expert_load(record: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """optimizer -> number of experts -> the mean (busiest, idlest) expert load over the mean load, averaged over
    the logged steps and the seeds of its best LR: every MoE cell logs the load, so this needs no rerun."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for opt, per in expert_axis(record).items():
        for n, best in per.items():
            sweep = Path(record) / "experts" / str(n)
            logs = [sweep / "cells" / row["cell"] / "metrics.jsonl" for row in read_csv(sweep / "results.csv")
                    if row["optimizer"] == opt and row["k"] == best.k]
            loads = [(r["moe_expert_load_max"], r["moe_expert_load_min"]) for log in logs if log.exists()
                     for r in _read_metrics(log) if "moe_expert_load_max" in r]
            if loads:
                out.setdefault(opt, {})[n] = (fmean(hi for hi, _ in loads), fmean(lo for _, lo in loads))
    return out


def claims(record: Path, rel: str) -> list[Claim]:
    """The width claims on the MoE model, then the expert-count one."""
    out = lr_transfer_claims(record, rel, scope="MoE: ")
    axis = expert_axis(record)
    if axis:
        width = {r["width"] for p in Path(record).glob("experts/*/results.csv") for r in read_csv(p)}
        drift = drift_claim(f"MoE: MuonMD's best matrix LR stays within one √2 grid step across expert count "
                            f"(width {min(width)})", axis, "e", rel)
        out += [drift] if drift else []
    return out


@dataclass
class Diagnosed:
    """One diagnostics rerun: the mean relative update per group over its diagnostics steps after the warmup,
    the mean expert load over its logged steps, and its final loss beside its cell's."""

    family: str  # moe or dense
    optimizer: str
    width: int
    k: float
    rel_update: dict[str, float]  # group -> mean over steps and matrices
    load_max: Optional[float]  # mean over logged steps of the busiest expert's load / the mean load
    load_min: Optional[float]
    final_eval_loss: Optional[float]
    cell_eval_loss: Optional[float]  # the same cell in the record's own sweep, if it ran there
    steps: list = field(default_factory=list)

    @property
    def reproduces(self) -> Optional[bool]:
        if self.final_eval_loss is None or self.cell_eval_loss is None:
            return None
        return self.final_eval_loss == self.cell_eval_loss


def _read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _eval_loss(result: Path) -> Optional[float]:
    return json.loads(result.read_text()).get("final_eval_loss") if result.exists() else None


def diagnose_cell(cell: Path, family: str, source: Optional[Path]) -> Optional[Diagnosed]:
    """A diagnostics rerun's summary (``source``: the sweep directory holding the same cell without
    diagnostics), or None when it has not finished (no result.json)."""
    res_path = cell / "result.json"
    if not res_path.exists():
        return None
    res = json.loads(res_path.read_text())
    per_group: dict[str, list[float]] = {g: [] for g in GROUPS}
    steps, loads = [], []
    for r in _read_metrics(cell / "metrics.jsonl"):
        if "moe_expert_load_max" in r:
            loads.append((r["moe_expert_load_max"], r["moe_expert_load_min"]))
        if "lm_loss" not in r or r["iteration"] <= res["warmup"]:  # a warmup step says nothing of the LR
            continue
        found = False
        for key, v in r.items():
            g = group_of(key.split("/")[1]) if key.startswith("diag/") and key.endswith("/rel_update") else None
            if g and math.isfinite(v):
                per_group[g].append(v)
                found = True
        if found:
            steps.append(r["iteration"])
    return Diagnosed(family, res["optimizer"], int(res["width"]), float(res["k"]),
                     {g: fmean(v) for g, v in per_group.items() if v},
                     fmean(a for a, _ in loads) if loads else None, fmean(b for _, b in loads) if loads else None,
                     res.get("final_eval_loss"),
                     _eval_loss(Path(source) / "cells" / res["cell"] / "result.json") if source else None, steps)


def diagnostics(record: Path, dense_record: Optional[Path] = None) -> list[Diagnosed]:
    """Every finished rerun under ``checks/diagnostics-<family>/cells``, each compared with its cell in the MoE
    record's own sweep (family moe) or in ``dense_record``'s (family dense)."""
    sources = {"moe": Path(record), "dense": dense_record}
    out = []
    for fam_dir in sorted(Path(record).glob("checks/diagnostics-*")):
        family = fam_dir.name.removeprefix("diagnostics-")
        for cell in sorted(fam_dir.glob("cells/*")):
            d = diagnose_cell(cell, family, sources.get(family))
            if d is not None:
                out.append(d)
    out.sort(key=lambda d: (d.family != "moe", d.optimizer, d.width))
    return out
