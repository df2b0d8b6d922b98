"""The probe's curvature measure: rises either side of the optimum against seed standard errors."""

from __future__ import annotations

import math
import statistics

from megatron_md.sweep.curvature import curvature


def _rows(losses: dict[float, list[float]], optimizer="muon_md", width=64):
    return [{"optimizer": optimizer, "width": width, "warmup": 0, "weight_decay": 0.0, "lr": lr, "seed": s + 1,
             "final_eval_loss": v, "final_train_loss": v, "diverged": False, "status": "ok"}
            for lr, vals in losses.items() for s, v in enumerate(vals)]


def test_a_sharp_curve_bends_and_its_standard_errors_are_the_textbook_ones():
    losses = {0.05: [3.10, 3.12, 3.08], 0.1: [3.00, 3.03, 2.99], 0.2: [3.20, 3.21, 3.17]}
    (e,) = curvature(_rows(losses))
    assert e["best_lr"] == 0.1 and e["bends"]
    lo = e["lower"]
    a, b = losses[0.1], losses[0.05]
    assert math.isclose(lo["rise"], statistics.fmean(b) - statistics.fmean(a))
    assert math.isclose(lo["se"], math.sqrt(statistics.variance(a) / 3 + statistics.variance(b) / 3))
    diffs = [y - x for x, y in zip(a, b)]
    assert math.isclose(lo["se_paired"], statistics.stdev(diffs) / math.sqrt(3))


def test_a_flat_curve_within_seed_noise_does_not_bend():
    losses = {0.05: [3.01, 3.05, 2.98], 0.1: [3.00, 3.04, 2.97], 0.2: [3.02, 3.00, 3.05]}
    (e,) = curvature(_rows(losses))
    assert not e["bends"]


def test_an_optimum_on_the_edge_does_not_bend():
    (e,) = curvature(_rows({0.05: [3.3, 3.31], 0.1: [3.2, 3.21], 0.2: [3.1, 3.12]}))
    assert e["best_lr"] == 0.2 and e["upper"] is None and not e["bends"]


def test_lrs_not_every_seed_ran_are_not_optima():
    rows = _rows({0.05: [3.2, 3.2], 0.1: [3.1, 3.12], 0.2: [3.3, 3.31]}) + _rows({0.4: [2.0]})
    (e,) = curvature(rows)
    assert e["best_lr"] == 0.1 and e["upper"]["rise"] > 0


def test_the_rise_is_measured_a_factor_2_away_even_with_finer_points_near_the_optimum():
    # √2 points between the factor-2 ones: the optimum may move to one of them, the neighbours stay a factor 2 away
    r2 = math.sqrt(2)
    losses = {0.05: [3.30, 3.31], 0.05 * r2: [3.05, 3.06], 0.1: [3.00, 3.01], 0.1 * r2: [3.04, 3.05],
              0.2: [3.25, 3.26]}
    (e,) = curvature(_rows(losses))
    assert e["best_lr"] == 0.1 and math.isclose(e["lower"]["rise"], 0.30) and math.isclose(e["upper"]["rise"], 0.25)
    del losses[0.05]
    (e,) = curvature(_rows(losses))
    assert e["lower"] is None and not e["bends"]  # the √2 neighbour below does not stand in for the factor 2
