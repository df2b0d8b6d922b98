"""megatron_md.sweep.qk_clip_records (the tables and verdicts of a ``*-qk-clip`` record) on synthetic records
written here, and its blocks in tools/render_readme_tables.py."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from megatron_md.sweep import qk_clip_records as Q
from megatron_md.sweep import records as R
from megatron_md.sweep.grid import lr_of_k
from megatron_md.sweep.results import RESULT_COLUMNS, write_csv

REPO = Path(__file__).resolve().parents[2]
SET = "lr0.1-15k-of-50k"
STEPS = 500


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_readme_tables", REPO / "tools" / "render_readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(opt, width, seed, loss, k=11, steps=300, cell=None):
    return {"optimizer": opt, "width": width, "params": 4198784, "lr": lr_of_k(k), "k": k, "seed": seed,
            "warmup": 0, "weight_decay": 0.0, "steps": steps, "final_train_loss": loss, "final_eval_loss": loss,
            "diverged": False, "wall_s": 1.0, "cell": cell or f"{opt}-w{width}-k{k}-s{seed}-wu0-wd0", "status": "ok"}


def _write(path: Path, lines: list[dict]):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def _manifold_cell(d: Path, sigma_end: float, logit_end: float, tau=None):
    """A cell whose attention σ_max goes 1 → sigma_end and diag max logit 2 → logit_end between its first and
    last diagnostics (layer 0; layer 1 lower)."""
    lines = []
    for it in range(50, STEPS + 1, 50):
        lines.append({"iteration": it, "lm_loss": 6.0 - it / STEPS, "lr": 0.003})
        if it % 100 == 0:
            t = (it - 100) / (STEPS - 100)
            rec = {"iteration": it}
            for layer in (0, 1):
                rec[f"diag/L{layer}.attention.qkv/sigma_max"] = (1.0 + (sigma_end - 1.0) * t) / (1 + layer)
                rec[f"diag/L{layer}.max_logit"] = (2.0 + (logit_end - 2.0) * t) / (1 + layer)
            lines[-1].update(rec)
    lines.append({"iteration": STEPS, "eval_lm_loss": 5.0})
    _write(d / "metrics.jsonl", lines)
    if tau is not None:
        (d / "config.yaml").write_text(f"optimizer:\n  optimizer: manifold_muon\n  qk_clip: true\n"
                                       f"  qk_clip_threshold: {tau}\n  qk_clip_alpha: 0.5\n")


def _preset(rec: Path, preset: str, loss: float, sigma_end: float, logit_end: float, tau=None):
    d = rec / SET / preset
    rows = []
    for seed in (1, 2):
        r = _row("manifold_muon", 64, seed, loss + 0.002 * (seed - 1.5), steps=STEPS,
                 cell=f"manifold_muon-w64-lr0.1-s{seed}-wu1000-wd0.1")
        r["lr"], r["k"] = 0.1, None  # as the manifold records write them
        rows.append(r)
        _manifold_cell(d / "cells" / r["cell"], sigma_end, logit_end, tau)
    write_csv(d / "results.csv", rows, RESULT_COLUMNS)


def _part_a(repo: Path, clipped_loss=4.90, clipped_logit=150.0, tau=100.0) -> Path:
    base = repo / "records" / "2026-01-01-manifold-geometry"
    _preset(base, "all-dgram", 5.03, 60.0, 10000.0)
    _preset(base, "hetero", 4.83, 1.0, 20.0)
    rec = repo / "records" / "2026-01-02-qk-clip"
    _preset(rec, "all-dgram-qk-clip", clipped_loss, 30.0, clipped_logit, tau)
    return rec


TRANSFER = [2.542388528585434, 2.534451398998499, 2.557996928691864]  # muon_md w256 k11, seeds 1-3


def _tau_curve(rec: Path, tau: int, losses: list[float], clips_per_log: int, logit_end: float):
    d = rec / "muon_md-w256" / f"tau{tau}"
    rows = [_row("muon_md", 256, s, loss) for s, loss in enumerate(losses, 1)]
    for r in rows:
        lines = [{"iteration": 10, "lm_loss": 6.0, "max_logit": None, "qk_clip_layers": 0}]  # no logit that step
        for it in range(20, 301, 10):
            logit = 5.0 + (logit_end - 5.0) * it / 300
            lines.append({"iteration": it, "lm_loss": 3.0, "max_logit": logit, "max_logit/L0": logit,
                          "max_logit/L1": logit / 2, "qk_clip_layers": clips_per_log})
        lines.append({"iteration": 300, "eval_lm_loss": r["final_eval_loss"]})
        _write(d / "cells" / r["cell"] / "metrics.jsonl", lines)
    write_csv(d / "results.csv", rows, RESULT_COLUMNS)


def _part_b(repo: Path, idle=TRANSFER, clipped=(2.60, 2.59, 2.61), idle_clips=0, transfer=True,
            control=None) -> Path:
    rec = repo / "records" / "2026-01-02-qk-clip"
    _tau_curve(rec, 100, list(idle), idle_clips, 8.0)
    _tau_curve(rec, 4, list(clipped), 2, 4.5)
    if control is not None:  # the "off" arm: no clip, no probe, on the same code
        d = rec / "muon_md-w256" / "off"
        d.mkdir(parents=True)
        write_csv(d / "results.csv", [_row("muon_md", 256, s, x) for s, x in enumerate(control, 1)], RESULT_COLUMNS)
    if transfer:  # the same cells run before QK-clip existed, beside another LR
        t = repo / "records" / "2026-01-01-lr-transfer"
        t.mkdir(parents=True, exist_ok=True)
        rows = [_row("muon_md", 256, s, x) for s, x in enumerate(TRANSFER, 1)]
        rows += [_row("muon_md", 256, s, 2.65, k=9) for s in (1, 2, 3)]
        write_csv(t / "results.csv", rows, RESULT_COLUMNS)
    return rec


def _claims(rec: Path, repo: Path) -> dict:
    return {c.claim.split(" (")[0]: c for c in Q.claims(rec, "rec", repo)}


def _table_row(text: str, first_cell: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(f"| {first_cell} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_clip_threshold_from_config_or_args(tmp_path):
    cell = tmp_path / "c"
    cell.mkdir()
    assert Q.clip_threshold(cell) is None
    (cell / "result.json").write_text(json.dumps({"args": ["--seed", "1", "--qk-clip"]}))
    assert Q.clip_threshold(cell) == Q.DEFAULT_TAU
    (cell / "result.json").write_text(json.dumps({"args": ["--qk-clip", "--qk-clip-threshold", "4"]}))
    assert Q.clip_threshold(cell) == 4.0
    (cell / "config.yaml").write_text("optimizer:\n  qk_clip: true\n  qk_clip_threshold: 25.0\n")
    assert Q.clip_threshold(cell) == 25.0  # the resolved config wins over the args
    (cell / "config.yaml").write_text("optimizer:\n  qk_clip: false\n  qk_clip_threshold: 25.0\n")
    assert Q.clip_threshold(cell) is None


def test_part_a_table_and_claims_held(tmp_path):
    rec = _part_a(tmp_path)
    text = Q.render(tmp_path, rec)
    assert "`records/2026-01-01-manifold-geometry/lr0.1-15k-of-50k/`" in text
    assert "matrix LR 0.1, 500 steps, 2 seed(s)" in text
    assert [x.split(" |")[0] for x in text.splitlines() if x.startswith("| ") and "preset" not in x] == \
        ["| all-dgram", "| all-dgram-qk-clip", "| hetero"]
    assert _table_row(text, "all-dgram") == ["all-dgram", "DGram", "–", "5.0300 ± 0.0014", "1.00 → 60.00 (60.00)",
                                             "2.00 → 10000.00 (10000.00)", "0/2"]
    clipped = _table_row(text, "all-dgram-qk-clip")
    assert clipped[:4] == ["all-dgram-qk-clip", "DGram", "τ 100", "4.9000 ± 0.0014"]
    assert clipped[5] == "2.00 → 150.00 (150.00)"
    assert _table_row(text, "hetero")[1:3] == ["Stiefel", "–"]
    claims = _claims(rec, tmp_path)
    gap = claims["QK-clip recovers DGram attention's loss gap"]
    assert gap.verdict == R.HELD and gap.claim.endswith(f"({SET})")
    assert "ALL-DGRAM−CLIPPED +0.1300" in gap.evidence and "CLIPPED−HETERO +0.0700" in gap.evidence, gap.evidence
    bound = claims["QK-clip bounds DGram attention's max logit"]
    assert bound.verdict == R.HELD, bound.evidence
    assert "2·τ = 200" in bound.evidence and "clipped ≤ 150.0" in bound.evidence and "≥ 10000.0" in bound.evidence
    assert "clipped 30.0×, unclipped 60.0×" in bound.evidence, bound.evidence


def test_part_a_claims_not_held(tmp_path):
    # clipped is worse than unclipped DGram, and its logit passes 2·τ (τ 4 from the config: bound 8)
    rec = _part_a(tmp_path, clipped_loss=5.20, clipped_logit=9.0, tau=4.0)
    claims = _claims(rec, tmp_path)
    assert claims["QK-clip recovers DGram attention's loss gap"].verdict == R.NOT_HELD
    bound = claims["QK-clip bounds DGram attention's max logit"]
    assert bound.verdict == R.NOT_HELD and "2·τ = 8" in bound.evidence, bound.evidence
    # a bound the unclipped runs never reach either shows nothing
    rec = _part_a(tmp_path / "b", clipped_logit=150.0, tau=1e5)
    assert _claims(rec, tmp_path / "b")["QK-clip bounds DGram attention's max logit"].verdict == R.INCONCLUSIVE


def test_part_a_without_a_baseline_record(tmp_path):
    rec = tmp_path / "records" / "2026-01-02-qk-clip"
    _preset(rec, "all-dgram-qk-clip", 4.9, 30.0, 150.0, 100.0)
    assert "no manifold-geometry record" in Q.render(tmp_path, rec)
    assert Q.claims(rec, "rec", tmp_path) == []


def test_part_b_table(tmp_path):
    rec = _part_b(tmp_path)
    text = Q.render(tmp_path, rec)
    assert "`muon_md` width 256, LR 0.04525 (k=11)" in text and "seeds 1, 2, 3" in text
    idle, clipped = _table_row(text, "τ 100"), _table_row(text, "τ 4")
    assert text.index("| τ 100 |") < text.index("| τ 4 |")
    assert idle[1] == f"{sum(TRANSFER) / 3:.4f} ± 0.0120"
    assert idle[2:4] == ["5.20 → 8.00 (8.00)", "0"]  # the null logit of step 10 is skipped
    assert idle[4] == "same as `records/2026-01-01-lr-transfer` (3/3 equal)"
    assert clipped[1] == "2.6000 ± 0.0100" and clipped[2:4] == ["4.97 → 4.50 (4.97)", "58"]  # 29 logs × 2
    assert clipped[4] == "not the same as `records/2026-01-01-lr-transfer` (0/3 equal)"


@pytest.mark.parametrize("clipped,verdict,way", [
    ((2.60, 2.59, 2.61), R.HELD, "τ 4 ends higher"),
    ((2.50, 2.49, 2.51), R.HELD, "τ 4 ends lower"),
    ((2.55, 2.53, 2.54), R.INCONCLUSIVE, "no difference beyond the noise"),
])
def test_claim_that_clipping_changes_the_loss(tmp_path, clipped, verdict, way):
    claim = _claims(_part_b(tmp_path, clipped=clipped), tmp_path)["QK-clip at τ 4 changes MuonMD's final loss"]
    assert claim.verdict == verdict and claim.evidence.endswith(way), claim.evidence
    assert claim.claim.endswith("(muon_md w256)")


def test_idle_clip_is_bit_identical_to_the_lr_transfer_cells(tmp_path):
    name = "An idle QK-clip and max-logit logging leave training bit-identical"
    claim = _claims(_part_b(tmp_path), tmp_path)[name]
    assert claim.verdict == R.HELD and claim.claim.endswith("(muon_md w256, τ 100)")
    assert "3/3 τ 100 runs clipped no layer-step" in claim.evidence and "in 3/3" in claim.evidence, claim.evidence
    # one loss off in its last digit
    off = [TRANSFER[0], math.nextafter(TRANSFER[1], 3.0), TRANSFER[2]]
    assert off[1] != TRANSFER[1] and f"{off[1]:.12f}" == f"{TRANSFER[1]:.12f}"
    rec = _part_b(tmp_path / "b", idle=off)
    claim = _claims(rec, tmp_path / "b")[name]
    assert claim.verdict == R.NOT_HELD and "in 2/3" in claim.evidence and "seed 2" in claim.evidence, claim.evidence
    assert "(2/3 equal)" in _table_row(Q.render(tmp_path / "b", rec), "τ 100")[4]
    # the idle threshold fired: not idle
    claim = _claims(_part_b(tmp_path / "c", idle_clips=1), tmp_path / "c")[name]
    assert claim.verdict == R.NOT_HELD and "0/3 τ 100 runs clipped no layer-step" in claim.evidence
    # nothing to compare with
    claim = _claims(_part_b(tmp_path / "d", transfer=False), tmp_path / "d")[name]
    assert claim.verdict == R.INCONCLUSIVE and "no lr-transfer record" in claim.evidence


def test_idle_clip_is_judged_against_the_control_arm_when_there_is_one(tmp_path):
    name = "An idle QK-clip and max-logit logging leave training bit-identical"
    # the control equals the idle runs; the older lr-transfer cells differ in the last digits (other code)
    idle = [x * (1 + 1e-7) for x in TRANSFER]
    rec = _part_b(tmp_path, idle=idle, control=idle)
    claim = _claims(rec, tmp_path)[name]
    assert claim.verdict == R.HELD, claim.evidence
    assert "equal to `muon_md-w256/off`'s in 3/3" in claim.evidence, claim.evidence
    assert "`records/2026-01-01-lr-transfer`'s cells (older code): 0/3 equal, largest relative difference 1.0e-07" \
        in claim.evidence, claim.evidence
    text = Q.render(tmp_path, rec)
    assert _table_row(text, "τ 100")[4] == "same as `muon_md-w256/off` (3/3 equal)"
    assert _table_row(text, "τ 4")[4] == "not the same as `muon_md-w256/off` (0/3 equal)"
    assert _table_row(text, "off, no probe")[1] == _table_row(text, "τ 100")[1]
    assert "the control `off`" in text
    # one seed of the control differs: not held, whatever the older record says
    control = [idle[0], math.nextafter(idle[1], 3.0), idle[2]]
    rec = _part_b(tmp_path / "b", idle=TRANSFER, control=control)
    claim = _claims(rec, tmp_path / "b")[name]
    assert claim.verdict == R.NOT_HELD and "seed 1" in claim.evidence and "seed 2" in claim.evidence
    assert "(older code): 3/3 equal" in claim.evidence, claim.evidence


def test_render_blocks_and_record_readme(tmp_path):
    render = _load_renderer()
    rec = _part_a(tmp_path)
    _part_b(tmp_path)
    assert render.record_kind(rec.name) == "qk-clip"
    (rec / "README.md").write_text("# qk\n\n<!-- BEGIN record_summary -->\nSTALE\n<!-- END record_summary -->\n\n"
                                   "<!-- BEGIN record_claims -->\nSTALE\n<!-- END record_claims -->\n")
    main = tmp_path / "README.md"
    main.write_text("".join(f"<!-- BEGIN {n} -->\n<!-- END {n} -->\n" for n in render.BLOCKS))
    args = ["--file", str(main), "--repo", str(tmp_path)]
    assert render.main(args) == 0 and render.main(args + ["--check"]) == 0
    own, page = (rec / "README.md").read_text(), main.read_text()
    assert "STALE" not in own and "| all-dgram-qk-clip | DGram | τ 100 |" in own and "| τ 4 |" in own
    assert "| QK-clip bounds DGram attention's max logit (lr0.1-15k-of-50k) | **held** |" in own
    block = page.split("<!-- BEGIN records_qk_clip -->")[1].split("<!-- END records_qk_clip -->")[0]
    assert "| τ 100 |" in block
    assert "bit-identical (muon_md w256, τ 100) | **held** |" in page.split("records_claims")[1]
    # in progress: neither shown nor judged
    (rec / R.IN_PROGRESS).write_text("cells running\n")
    assert render.render_qk_clip(tmp_path) == "_No `records/*-qk-clip` yet._"
    assert "QK-clip" not in render.render_claims(tmp_path)


def test_real_pages_are_current():
    render = _load_renderer()
    assert render.main(["--check"]) == 0
    assert render.record_kind("2026-12-06-qk-clip") == "qk-clip"
