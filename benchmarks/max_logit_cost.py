"""Cost of the per-head max-logit probe (QK-clip, the ``max_logit`` log fields) against the attention it measures.

For one attention layer of each preset (its heads and GQA groups on one rank, head dim 128, batch 1, fp32 on the
CPU), at each sequence length, interleaved repeats of:

- ``sdpa``: torch's scaled_dot_product_attention, causal, forward + backward (what the layer's core attention
  costs with ``--attention-backend sdpa``), against the probe's no-grad chunked Q·Kᵀ (``head_max_logits``);
- ``local``: megatron's unfused attention's score matrix and softmax, forward + backward, against the probe reading
  those scores (``head_max_from_scores``: a masked max, no matmul).

The ratio probe / attention is the probe's share of the attention's time in a step it runs: every step with
``--qk-clip``, one step in ``--log-interval`` without. The rest of the layer (projections, MLP) is not counted,
so the share of a whole step is smaller. Writes ``--out`` (JSON); the table in docs/qk_clip.md is generated from it.

    python benchmarks/max_logit_cost.py --threads 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from optimizer_step import machine_info  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from megatron_md.models.logits import head_max_from_scores, head_max_logits  # noqa: E402
from megatron_md.models.presets import PRESETS  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "max_logit_cost_cpu.json"


def _heads(preset: str) -> tuple[int, int, int]:
    p = PRESETS[preset]
    d = p["kv_channels"]
    heads = p["hidden_size"] // d
    return heads, max(1, int(heads * p.get("query_group_ratio", 1.0))), d


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(preset: str, seq: int, repeats: int) -> dict:
    heads, groups, d = _heads(preset)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, 1, heads, d, generator=gen)
    k = torch.randn(seq, 1, groups, d, generator=gen)
    v = torch.randn(seq, 1, groups, d, generator=gen)
    scale = d ** -0.5

    def sdpa():
        qq, kk, vv = (t.permute(1, 2, 0, 3).detach().requires_grad_() for t in
                      (q, k.repeat_interleave(heads // groups, 2), v.repeat_interleave(heads // groups, 2)))
        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale).sum().backward()

    def local():
        qq = q.permute(1, 2, 0, 3).reshape(heads, seq, d).detach().requires_grad_()
        kk = k.repeat_interleave(heads // groups, 2).permute(1, 2, 0, 3).reshape(heads, seq, d).detach().requires_grad_()
        vv = v.repeat_interleave(heads // groups, 2).permute(1, 2, 0, 3).reshape(heads, seq, d).detach()
        scores = torch.baddbmm(torch.empty(heads, seq, seq), qq, kk.transpose(1, 2), beta=0.0, alpha=scale)
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(mask, -10000.0).softmax(-1)
        (probs @ vv).sum().backward()
        return scores.detach().view(1, heads, seq, seq)

    scores = local()
    probe_qk = lambda: head_max_logits(q, k, scale, None, causal=True)  # noqa: E731
    probe_scores = lambda: head_max_from_scores(scores, None, causal=True)  # noqa: E731
    sdpa(), probe_qk(), probe_scores()  # warm-up
    times = {"sdpa": [], "probe_qk": [], "local": [], "probe_scores": []}
    for _ in range(repeats):  # interleaved: the machine's drift hits all four alike
        for name, fn in (("sdpa", sdpa), ("probe_qk", probe_qk), ("local", local), ("probe_scores", probe_scores)):
            times[name] += _timed(fn, 1)
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return {"preset": preset, "seq": seq, "heads": heads, "groups": groups, "head_dim": d, "ms": ms,
            "sdpa_share": ms["probe_qk"] / ms["sdpa"], "local_share": ms["probe_scores"] / ms["local"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="dense-181m,dense-1.29b")
    ap.add_argument("--seq-lengths", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    for preset in a.presets.split(","):
        for seq in map(int, a.seq_lengths.split(",")):
            r = measure(preset, seq, a.repeats)
            rows.append(r)
            print(f"{preset} seq {seq}: sdpa fwd+bwd {r['ms']['sdpa']:.1f} ms, probe {r['ms']['probe_qk']:.1f} ms "
                  f"({100 * r['sdpa_share']:.1f}%); local {r['ms']['local']:.1f} ms, probe on its scores "
                  f"{r['ms']['probe_scores']:.1f} ms ({100 * r['local_share']:.1f}%)", flush=True)
    out = {"date": datetime.date.today().isoformat(), "machine": machine_info(torch.get_num_threads()), "threads": torch.get_num_threads(),
           "repeats": a.repeats, "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if all(math.isfinite(r["sdpa_share"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
