"""plot_spectra draws a PNG from diagnostics in metrics.jsonl and explains a missing stat."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_spectra.py"


def _tool():
    spec = importlib.util.spec_from_file_location("plot_spectra", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plot_from_metrics(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for it in (10, 20, 30):
            rec = {"iteration": it, "lm_loss": 5.0}
            for layer in (0, 1):
                rec[f"diag/L{layer}.attention.qkv/sigma_max"] = 1.0 + it / 100
                rec[f"diag/L{layer}.mlp.fc1/sigma_max"] = 2.0
                rec[f"diag/L{layer}.expert3.fc1/sigma_max"] = 1.5
                rec[f"diag/L{layer}.max_logit"] = 3.0 + layer
            f.write(json.dumps(rec) + "\n")
            f.write(json.dumps({"iteration": it, "eval_lm_loss": 5.0}) + "\n")
    tool = _tool()
    mats, logits = tool.load(run)
    assert [v for _, v in mats["sigma_max"]["attention.qkv"]] == [[1.1, 1.1], [1.2, 1.2], [1.3, 1.3]]
    assert set(mats["sigma_max"]) == {"attention.qkv", "mlp.fc1", "experts.fc1"}
    assert logits[1] == [(10, 4.0), (20, 4.0), (30, 4.0)]
    out = tmp_path / "s.png"
    assert tool.main([str(run), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert tool.main([str(run), "--out", str(out), "--stat", "gain_row_mean"]) == 2
