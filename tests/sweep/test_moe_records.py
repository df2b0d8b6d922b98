"""megatron_md.sweep.moe_records (the MoE LR-transfer record's expert axis and diagnostics reruns) and its
rendering, on synthetic records written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_md.sweep import moe_records as M
from megatron_md.sweep import records as R
from megatron_md.sweep.results import RESULT_COLUMNS, write_csv

from test_records import _bowl, _load_renderer, _transfer_record


def _moe_record(tmp: Path, md_k_by_experts: dict, adamw_k: int = 8) -> Path:
    """A MoE record (newer than the dense one _transfer_record writes): widths 64 and 128, and an expert axis
    at width 128 with MuonMD's optimum at md_k_by_experts[n]."""
    rec = tmp / "records" / "2026-02-01-moe-lr-transfer"
    rec.mkdir(parents=True)
    rows = []
    for w in (64, 128):
        rows += _bowl("muon_md", w, 12, 4.7, range(9, 16))
        rows += _bowl("muon", w, 9, 4.8, range(6, 13), warmup=30, wd=0.1)
        rows += _bowl("adamw", w, 8, 4.9, range(4, 12), warmup=30, wd=0.1)
    write_csv(rec / "results.csv", rows, RESULT_COLUMNS)
    for n, k in md_k_by_experts.items():
        axis = _bowl("muon_md", 128, k, 4.7, range(9, 16)) + _bowl("adamw", 128, adamw_k + n // 8, 4.9, range(4, 12),
                                                                   warmup=30, wd=0.1)
        (rec / "experts" / str(n)).mkdir(parents=True)
        write_csv(rec / "experts" / str(n) / "results.csv", axis, RESULT_COLUMNS)
    return rec


def test_an_moe_record_is_its_own_kind(tmp_path):
    dense = _transfer_record(tmp_path, {64: 12, 128: 12})
    moe = _moe_record(tmp_path, {4: 12, 8: 12, 16: 12})
    assert R.kind_of(moe.name) == "moe-lr-transfer" and R.kind_of(dense.name) == "lr-transfer"
    assert R.latest(tmp_path, "lr-transfer") == dense  # the newer MoE record does not replace the dense one
    assert R.latest(tmp_path, "moe-lr-transfer") == moe
    assert _load_renderer().record_kind(moe.name) == "moe-lr-transfer"


@pytest.mark.parametrize("ks, verdict", [({4: 12, 8: 12, 16: 13}, R.HELD), ({4: 10, 8: 12, 16: 13}, R.NOT_HELD),
                                         ({4: 12, 8: 15}, R.INCONCLUSIVE)])  # 15: the grid's top edge
def test_expert_axis_is_judged_like_the_width_axis(tmp_path, ks, verdict):
    rec = _moe_record(tmp_path, ks)
    axis = M.expert_axis(rec)
    assert sorted(axis["muon_md"]) == sorted(ks) and axis["muon_md"][8].k == ks[8]
    ranking, width, experts = M.claims(rec, "rec")
    assert ranking.claim.startswith("MoE: MuonMD < Muon < AdamW") and width.claim.startswith("MoE: MuonMD's")
    assert experts.claim.endswith("across expert count (width 128)") and experts.verdict == verdict
    assert f"e8: k={ks[8]}" in experts.evidence and "adamw moves" in experts.evidence


def test_an_expert_sweep_runs_one_width(tmp_path):
    rec = _moe_record(tmp_path, {8: 12})
    (rec / "experts" / "4").mkdir()
    write_csv(rec / "experts" / "4" / "results.csv", _bowl("muon_md", 64, 12, 4.7, range(9, 16))
              + _bowl("muon_md", 128, 12, 4.7, range(9, 16)), RESULT_COLUMNS)
    with pytest.raises(ValueError, match="experts/4/results.csv: an expert-count sweep runs one width"):
        M.expert_axis(rec)


def _diag_cell(root: Path, family: str, opt: str, width: int, k: int, loss: float, warmup: int = 0,
               updates: dict | None = None) -> str:
    """A diagnostics rerun's cell: rel_update per matrix on steps 20..100 (step 20 inside a 30-step warmup
    logs 10x the later value, which the mean must leave out)."""
    name = f"{opt}-w{width}-k{k}-s1-wu{warmup}"
    cell = root / "records" / "2026-02-01-moe-lr-transfer" / "checks" / f"diagnostics-{family}" / "cells" / name
    cell.mkdir(parents=True)
    lines = []
    for it in (20, 40, 60, 80, 100):
        rec = {"iteration": it, "lm_loss": 5.0}
        for label, v in (updates or {}).items():
            rec[f"diag/{label}/rel_update"] = v * (10 if it <= warmup else 1)
            rec[f"diag/{label}/sigma_max"] = 1.0
        if family == "moe":
            rec.update(moe_expert_load_max=1.2 + it / 1000, moe_expert_load_min=0.8)
        lines.append(json.dumps(rec))
    lines.append(json.dumps({"iteration": 100, "eval_lm_loss": loss}))
    (cell / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (cell / "result.json").write_text(json.dumps({"cell": name, "optimizer": opt, "width": width, "k": k,
                                                  "warmup": warmup, "final_eval_loss": loss}))
    return name


def _source_cell(sweep_dir: Path, name: str, loss: float) -> None:
    (sweep_dir / "cells" / name).mkdir(parents=True)
    (sweep_dir / "cells" / name / "result.json").write_text(json.dumps({"cell": name, "final_eval_loss": loss}))


def test_diagnostics_reruns_group_their_updates_and_compare_with_their_cells(tmp_path):
    dense = _transfer_record(tmp_path, {64: 12, 128: 12})
    moe = _moe_record(tmp_path, {8: 12})
    name = _diag_cell(tmp_path, "moe", "adamw", 128, 8, 3.25, warmup=30,
                      updates={"L0.attention.qkv": 1e-3, "L0.attention.proj": 3e-3, "L0.router": 5e-3,
                               "L0.expert0.fc1": 2e-3, "L1.expert7.fc2": 4e-3})
    _source_cell(moe, name, 3.25)
    dname = _diag_cell(tmp_path, "dense", "muon_md", 64, 12, 3.5, updates={"L0.mlp.fc1": 0.01})
    _source_cell(dense, dname, 3.5000001)
    _diag_cell(tmp_path, "moe", "muon", 64, 9, 3.1)  # no cell of that name in the sweep
    got = {(d.family, d.optimizer): d for d in M.diagnostics(moe, dense)}
    a = got[("moe", "adamw")]
    assert a.rel_update == pytest.approx({"attention": 2e-3, "router": 5e-3, "experts": 3e-3})
    assert a.steps == [40, 60, 80, 100] and a.reproduces is True
    assert a.load_max == pytest.approx(1.26) and a.load_min == pytest.approx(0.8)
    d = got[("dense", "muon_md")]
    assert d.rel_update == {"mlp": 0.01} and d.load_max is None and d.reproduces is False
    assert got[("moe", "muon")].reproduces is None and got[("moe", "muon")].rel_update == {}


def test_render_the_moe_block_and_its_claims(tmp_path):
    render = _load_renderer()
    dense = _transfer_record(tmp_path, {64: 12, 128: 12})
    moe = _moe_record(tmp_path, {4: 12, 8: 12, 16: 13})
    (moe / "lr_transfer.png").write_bytes(b"png")
    (moe / "checks" / "probe").mkdir(parents=True)
    write_csv(moe / "checks" / "probe" / "results.csv", _bowl("muon_md", 64, 12, 4.7, range(10, 15, 2), seeds=(1, 2, 3),
                                                              curvature=0.01, noise=0.002), RESULT_COLUMNS)
    name = _diag_cell(tmp_path, "moe", "muon_md", 64, 12, 3.25, updates={"L0.router": 5e-3, "L0.expert1.fc1": 2e-3})
    _source_cell(moe, name, 3.25)
    _source_cell(dense, _diag_cell(tmp_path, "dense", "muon_md", 64, 12, 3.5, updates={"L0.mlp.fc1": 0.01}), 3.5000001)
    (moe / "experts.png").write_bytes(b"")
    names = ["records_claims", "records_lr_transfer", "records_moe_lr_transfer"]
    readme = tmp_path / "README.md"
    readme.write_text("".join(f"<!-- BEGIN {n} -->\nSTALE\n<!-- END {n} -->\n\n" for n in names))
    args = ["--file", str(readme), "--repo", str(tmp_path)] + [x for n in names for x in ("--block", n)]
    assert render.main(args) == 0
    text = readme.read_text()
    lr_block, moe_block = text.split("BEGIN records_lr_transfer")[1], text.split("BEGIN records_moe_lr_transfer")[1]
    assert f"`{dense.relative_to(tmp_path)}/results.csv`" in lr_block.split("END")[0]
    assert "| `muon_md` | k=12 (0.064): 4.7000 ± 0.0007 (n=2) | k=12 (0.064)" in moe_block
    assert "| moe | `muon_md` | 64 | 12 | – | – | 2.00e-03 | 5.00e-03 | 1.26/0.80 | 3.2500 (=) |" in moe_block
    assert "| dense | `muon_md` | 64 | 12 | – | 1.00e-02 | – | – | – | 3.5000 (cell +1.0e-07) |" in moe_block
    assert "over up to 3 seeds" in moe_block and "| muon_md | 64 | 0.064 | 4.7010 (3) | +0.0400 (" in moe_block
    assert "on the MoE model, optimum marked](records/2026-02-01-moe-lr-transfer/lr_transfer.png)" in moe_block
    assert "per number of experts at width 128](records/2026-02-01-moe-lr-transfer/experts.png)" in moe_block
    assert "`records/2026-02-01-moe-lr-transfer/experts/*/results.csv`" in moe_block
    claims = text.split("BEGIN records_claims")[1].split("END")[0]
    assert "MoE: MuonMD's best matrix LR stays within one √2 grid step across expert count (width 128) | **held**" \
        in claims
    assert "| MuonMD's best matrix LR stays within one √2 grid step across width |" in claims  # the dense one too


def test_expert_load_is_read_from_the_cells_at_the_best_lr(tmp_path):
    rec = _moe_record(tmp_path, {4: 12, 8: 12})
    for seed, (hi, lo) in ((1, (1.2, 0.8)), (2, (1.4, 0.6))):  # at the best k; k=11 is not the optimum
        for k in (12, 11):
            cell = rec / "experts" / "8" / "cells" / f"muon_md-w128-k{k}-s{seed}"
            cell.mkdir(parents=True)
            log = [{"iteration": 10, "lm_loss": 5.0}, {"iteration": 10, "moe_expert_load_max": hi + k - 12,
                                                        "moe_expert_load_min": lo}]
            (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    load = M.expert_load(rec)
    assert load["muon_md"][8] == pytest.approx((1.3, 0.7)) and 4 not in load["muon_md"] and "adamw" not in load
    block = _load_renderer().render_moe_lr_transfer(tmp_path, rec)
    assert "| `muon_md` | k=12 (0.064): 4.7000 ± 0.0007 (n=2) | k=12 (0.064): 4.7000 ± 0.0007 (n=2); load 1.30/0.70 |" \
        in block


def test_an_unfinished_moe_record_is_named_not_shown(tmp_path):
    render = _load_renderer()
    assert "No `records/*-moe-lr-transfer` yet" in render.render_moe_lr_transfer(tmp_path)
    moe = _moe_record(tmp_path, {8: 12})
    (moe / R.IN_PROGRESS).write_text("widths 128 and 256 left")
    text = render.render_moe_lr_transfer(tmp_path)
    assert text.startswith("_`records/2026-02-01-moe-lr-transfer` is in progress") and "| `muon_md` |" not in text
