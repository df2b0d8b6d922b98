"""The input pipeline on CPU: tokens per second the DataLoader delivers to one rank at seq 4096 with 0, 1 and 2
workers, and the share of a training iteration the trainer waits for data.

- ``delivered``: the DataLoader alone (megatron_md's sampler and collate over a GPTDataset of the embedded corpus,
  memory-mapped), one micro-batch of 1 x 4096 tokens at a time, consumed as fast as it comes: the rate after
  the first batch, and the time to the first batch (the workers' start-up).
- ``in training``: ``megatron-md train`` (tiny-dense at seq 4096, 1 rank, the corpus) with
  ``--timing-log-level 2``; the share is the ``batch-generator`` timer (the forward step's wait for its batch)
  over the iteration time, averaged over the steps after the first log interval.

Small shapes flatter the loader: the tiny model's step is short, so a wait shows as a large share; on a real
model the same wait is a smaller share of a longer step. Writes ``--out`` (JSON); docs/performance.md's table is
generated from it (tools/render_readme_tables.py).

    python benchmarks/loader.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "loader_cpu.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def delivered(prefix: str, tokenizer: str, seq: int, workers: int, batches: int) -> tuple[float, float]:
    """(tokens per second the DataLoader hands over once running, ms to the first batch: the workers' start-up)."""
    from megatron_md.training.data.datasets import build_gpt_datasets
    from megatron_md.training.data.loader import GlobalBatchSampler, loader
    from megatron_md.training.data.tokenizer import build_tokenizer

    tok = build_tokenizer("SentencePieceTokenizer", tokenizer)
    train, _, _ = build_gpt_datasets([prefix], "98,2,0", seq, 1234, tok, batches, 0, 0)
    sampler = GlobalBatchSampler(len(train), 0, lambda _c: 1, 1, 0, 1, limit=batches)
    t0 = time.perf_counter()
    it = iter(loader(train, sampler, workers, pin=False))
    next(it)
    t1 = time.perf_counter()
    n = sum(b["tokens"].numel() for b in it)
    return n / (time.perf_counter() - t1), 1000.0 * (t1 - t0)


def in_training(prefix: str, tokenizer: str, seq: int, workers: int, iters: int, out: Path) -> dict:
    run = out / f"train-w{workers}"
    cmd = [sys.executable, "-m", "megatron_md.cli", "train", "--model", "tiny-dense", "--data-path", prefix,
           "--tokenizer-model", tokenizer, "--split", "98,2,0", "--seq-length", str(seq), "--max-position-embeddings",
           str(seq), "--micro-batch-size", "1", "--train-iters", str(iters), "--log-interval", str(iters // 2),
           "--eval-iters", "0", "--timing-log-level", "2", "--num-workers", str(workers), "--wandb-mode", "disabled",
           "--no-progress-bar", "--run-dir", str(run)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"lm_loss"' in x][-1]
    wait = last.get("time/batch-generator", 0.0)
    return {"iter_ms": last["iter_time_ms"], "batch_wait_ms": wait, "wait_share": wait / last["iter_time_ms"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--batches", type=int, default=48, help="micro-batches the loader alone delivers")
    ap.add_argument("--iters", type=int, default=8, help="training steps (the second half is measured)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    a = ap.parse_args(argv)
    import torch
    from optimizer_step import machine_info

    from megatron_md.training.data.datasets import prepare_demo_data

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        prefix, tokenizer = prepare_demo_data(Path(tmp) / "data", vocab_size=4096, log=None)
        rows = []
        for w in (int(x) for x in a.workers.split(",")):
            rate, first_ms = delivered(prefix, tokenizer, a.seq_length, w, a.batches)
            row = {"workers": w, "tokens_per_s": rate, "first_batch_ms": first_ms,
                   **in_training(prefix, tokenizer, a.seq_length, w, a.iters, Path(tmp))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    doc = {"benchmark": "loader", "created": datetime.date.today().isoformat(), "machine": machine_info(torch.get_num_threads()),
           "settings": {"seq_length": a.seq_length, "micro_batch": 1, "batches": a.batches, "iters": a.iters,
                        "model": "tiny-dense", "data": "embedded corpus, SentencePiece 4096"},
           "results": rows, "wall_s": round(time.time() - t0, 1)}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
