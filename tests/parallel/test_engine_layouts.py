"""The engine on megatron's real stack (gloo): one owner per matrix gives the duplicated path's update.

Each case is one run of ``_engine_probe.py`` on 2 or 4 ranks (in the suite's pooled worlds; the pp2-muon_md case
under torchrun, e2e): the same model and gradients stepped with
``--muon-tp-mode duplicated`` (every TP rank orthogonalises every matrix), ``layer_sharded`` (the engine,
batched by shape, with MD's batched step) and ``layer_sharded --md-ns-per-matrix``; the duplicated and
per-matrix runs take MD's per-matrix step (``--md-per-matrix-step``). Per-matrix must be bit-identical to
duplicated (same msign on the same gathered matrix, on another rank); batched (the engine's batches and MD's
stacked phases) may differ by fp32 rounding only.
"""

from __future__ import annotations

import json

import pytest

from mdtest import run_tool

pytestmark = pytest.mark.multirank

LAYOUTS = {
    "tp2": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "layerwise-dp2": (2, ["--distopt"]),
    "ep2xtp2": (4, ["--tp", "2", "--ep", "2", "--model", "tiny-moe"]),
}


def probe(nproc: int, args: list[str]) -> dict:
    out = run_tool("tests/parallel/_engine_probe.py", args, nproc=nproc, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    assert out.returncode == 0 and lines, f"probe failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return json.loads(lines[-1][len("PROBE "):])


E2E = ("pp2", "muon_md")  # runs under torchrun, as a user launches it (make test-all)


@pytest.mark.parametrize("layout,optimizer", [
    pytest.param(layout, optimizer, id=f"{layout}-{optimizer}", marks=pytest.mark.e2e if (layout, optimizer) == E2E else ())
    for optimizer in ("muon_md", "manifold_muon") for layout in sorted(LAYOUTS)])
def test_engine_matches_duplicated(layout, optimizer):
    nproc, args = LAYOUTS[layout]
    res = probe(nproc, [*args, "--optimizer", optimizer])
    assert res["max_param_change"] > 1e-3, res  # the steps moved the weights
    assert res["per_matrix_vs_duplicated"] == 0.0, res
    if "--distopt" in args:  # bf16 weights: the masters' fp32 rounding moves a weight by at most one bf16 unit
        assert res["batched_vs_duplicated_bf16_ulps"] <= 1.0, res
    else:
        assert res["batched_vs_duplicated"] <= 1e-5, res
    assert res["once_per_tp_group"], res
    assert res["owned"] * res["tp"] >= res["matrices"], res
    assert res["kernel_calls"] <= res["per_matrix_kernel_calls"], res
