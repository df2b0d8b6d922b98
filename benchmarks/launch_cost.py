"""What one `megatron-md train` command costs the test suite, through the real CLI and in a pooled world.

The same tiny-dense command (sequence 32, global batch 4) on 1 and 2 ranks, in four variants: one step (process
groups, model and optimizer build, data, the step and the final evaluation), five steps, five steps with a checkpoint
save, and a resume from a checkpoint at step 4 for 2 more steps. Each runs REPEATS times through ``python -m megatron_md.cli``
(torchrun for 2 ranks) and in a warm pooled world (tests/harness/pool.py), medians reported. Their differences split
a CLI command's wall time into: interpreter start, imports and the launcher (CLI minus pool, same command), the build
with one step (pool), four more steps, and the save. Prints a table and writes ``benchmarks/results/launch_cost_cpu.json``
(``--out``); ``make readme`` puts its table (tools/test_profile.py) into docs/tests.md.

    python benchmarks/launch_cost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

BASE = ["train", "--model", "tiny-dense", "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "1", "--wandb-mode", "disabled",
        "--no-progress-bar"]
VARIANTS = ("one", "steps", "save", "resume")


def _args(variant: str, nproc: int, work: Path, tag: str) -> list[str]:
    run = ["--nproc-per-node", str(nproc), "--run-dir", str(work / f"run-{tag}")]
    ck = work / f"ck-{nproc}"
    if variant == "one":
        return [*BASE, *run, "--train-iters", "1"]
    if variant == "steps":
        return [*BASE, *run, "--train-iters", "5"]
    if variant == "save":
        return [*BASE, *run, "--train-iters", "5", "--save", str(work / f"ck-{tag}")]
    return [*BASE, *run, "--train-iters", "6", "--load", str(ck)]


def _cli(args: list[str]) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        env.pop(k, None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megatron_md.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"megatron-md {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def measure(repeats: int) -> dict:
    from harness.pool import Pool

    work = Path(tempfile.mkdtemp(prefix="launch-cost-"))
    pool = Pool(work / "pool")
    out: dict = {}
    try:
        for nproc in (1, 2):
            # the checkpoint the resume variant loads (saved at step 4 of 6)
            pool.run([*BASE, "--nproc-per-node", str(nproc), "--train-iters", "6", "--exit-interval", "4", "--save",
                      str(work / f"ck-{nproc}"), "--run-dir", str(work / f"seed-{nproc}")], nproc)
            # neither the world's first job nor the first CLI launch (cold file cache) is timed
            pool.run(_args("steps", nproc, work, "warm"), nproc)
            _cli(_args("steps", nproc, work, "cli-warm"))
            for variant in VARIANTS:
                cli, pooled = [], []
                for r in range(repeats):
                    tag = f"{nproc}-{variant}-{r}"
                    cli.append(_cli(_args(variant, nproc, work, f"cli-{tag}")))
                    t0 = time.perf_counter()
                    proc = pool.run(_args(variant, nproc, work, f"pool-{tag}"), nproc)
                    pooled.append(time.perf_counter() - t0)
                    assert proc.returncode == 0, proc.stderr[-3000:]
                out[f"{nproc}/{variant}"] = {"cli_s": round(statistics.median(cli), 2),
                                             "pool_s": round(statistics.median(pooled), 2)}
                print(f"{nproc} rank(s) {variant:7s} cli {out[f'{nproc}/{variant}']['cli_s']:6.2f} s   "
                      f"pool {out[f'{nproc}/{variant}']['pool_s']:6.2f} s", flush=True)
    finally:
        pool.close()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "launch_cost_cpu.json")
    a = p.parse_args(argv)
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d"),
           "repeats": a.repeats, "cases": measure(a.repeats)}
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    sys.path.insert(0, str(REPO / "tools"))
    from test_profile import launch_cost_markdown

    print(launch_cost_markdown(res))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
