"""`megatron-md lr-sweep` (and ``tools/lr_sweep.py``): argument parsing and the three modes
(run the grid, --dry-run / --slurm-grid, --coord-check)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megatron_md.sweep import grid as G

PROG = "megatron-md lr-sweep"

EPILOG = f"""
LR ladder: lr_k = 1e-3 * 2^(k/2) (k=7: 1.13e-2, k=12: 6.4e-2). Swept flag: adamw, muon -> --lr; muon_md,
adam_md, lion_md, soap_md, manifold_muon -> --matrix-lr, their other LRs fixed (MD: --lr 1e-3
--embedding-lr 3e-3; manifold_muon: --lr 6e-4; a value the base config sets wins).
Which LRs: --k-range OPT=LO:HI (the points LO..HI) wins, then explicit --lrs LRs, then --lrs N: N points
--k-step apart around a centre k, which is --k-center OPT=K, else the base config's own value of the swept
flag (when the config trains that optimizer and sets it: a GPU recipe is swept around its own LR, e.g.
examples/md_paper's --matrix-lr 1.13e-2 -> k 7), else the CPU-measured default:
{', '.join(f'{n} {r.k_center}' for n, r in G.RECIPES.items())}.
Recipes: adamw, muon warm up 10% of the steps with weight decay 0.1; MD optimizers neither; manifold_muon 2%
and 0.1.
Several comma-separated --config YAMLs make a model ladder: each trains at its own width (--widths omitted),
e.g. the md_paper recipes dense-181m .. dense-1.29b (slurm/width_ladder.sh writes and submits that grid).
GPUs: a local sweep runs each cell as `megatron-md train` (add -- --nproc-per-node N for N GPUs
a cell); --slurm-grid with --gpus-per-cell N makes each array task of slurm/lr_sweep.sbatch a cell on N GPUs
of one node (GPUS_PER_CELL).
Flags after '--' go to every cell's `megatron-md train` (e.g. -- --mock-data --seq-length 128).
Outputs: OUT/cells/<cell>/ (run dir + result.json), OUT/results.csv, OUT/optima.csv, OUT/lr_transfer.png;
--coord-check: OUT/coord_check.csv and .png. More: docs/sweeps.md.

  {PROG} --model tiny-dense --out runs/lrt --widths 64,128 --lrs 3 --steps 20 --optimizers adamw,muon_md -- --mock-data
  {PROG} --config examples/lr_transfer/dense_cpu.yaml --corpus runs/corpus --widths 64,128,256 --seeds 1,2
  {PROG} --config examples/md_paper/dense-181m_muon_md.yaml,examples/md_paper/dense-307m_muon_md.yaml \\
      --optimizers muon_md --lrs 5 --steps 2000 --gpus-per-cell 8 --slurm-grid runs/grids/ladder.tsv -- --data-path P --tokenizer-model T
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Zero-shot LR-transfer sweep over widths.", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    base = p.add_mutually_exclusive_group()
    base.add_argument("--config", help="Base YAML of every cell (`train --config`); several, comma-separated: a "
                      "model ladder, each YAML at its own width.")
    base.add_argument("--model", help="Base preset of every cell (`train --model`) [default: tiny-dense when "
                      "there is no --config].")
    p.add_argument("--out", default="runs/lr-sweep", help="Sweep directory; rerun with the same one to resume "
                   "[default: runs/lr-sweep].")
    p.add_argument("--corpus", metavar="DIR", help="Train on the embedded Python-docs corpus, tokenised into DIR "
                   "on first use (adds --data-path and --tokenizer-model to every cell).")
    p.add_argument("--corpus-vocab", type=int, default=4096, metavar="N",
                   help="--corpus: SentencePiece vocabulary size of its tokenizer [default: 4096].")
    p.add_argument("--widths", help="Comma-separated --hidden-size values (heads = width / --kv-channels, FFN = "
                   "ratio x width) [default with --config: the config's own width; required with --model].")
    p.add_argument("--optimizers", default="adamw,muon,muon_md", help="Comma-separated: " + ", ".join(G.RECIPES)
                   + " (adam = adamw). [default: adamw,muon,muon_md]")
    p.add_argument("--lrs", default="5", help="N (N ladder points around each optimizer's centre; even N: one "
                   "more above) or comma-separated LRs. [default: 5]")
    p.add_argument("--k-center", action="append", default=[], metavar="OPT=K",
                   help="Centre k of --lrs N for an optimizer (repeatable or comma-separated) [default: the base "
                   "config's own swept LR for that optimizer, else the CPU-measured centre; see below].")
    p.add_argument("--k-range", action="append", default=[], metavar="OPT=LO:HI",
                   help="Ladder points LO..HI (every --k-step) for an optimizer; wins over --lrs and --k-center.")
    p.add_argument("--k-step", type=int, default=1, metavar="N",
                   help="Ladder points N apart in k (2: each LR twice the last) for --lrs N, --k-range and "
                   "--extend-edges [default: 1, a factor sqrt(2)].")
    p.add_argument("--seeds", default="1", help="Comma-separated seeds. [default: 1]")
    p.add_argument("--steps", type=int, help="--train-iters of every cell [default: the base config's; "
                   "--coord-check: 5].")
    p.add_argument("--warmups", help="Comma-separated --lr-warmup-iters values, iterations or percent of the "
                   "steps (10%%) [default: the optimizer's recipe].")
    p.add_argument("--weight-decays", help="Comma-separated --weight-decay values [default: the recipe's].")
    p.add_argument("--log-interval", type=int, help="Cells' --log-interval [default: steps/50, at least 1].")
    p.add_argument("--extend-edges", type=int, default=0, metavar="N",
                   help="After the grid, add the next ladder LR (every seed) beyond each width x optimizer curve "
                   "whose best LR is its lowest or highest, and repeat, at most N times: every optimum ends "
                   "strictly inside its grid (or N more points were tried). Local runs only. [default: 0]")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="Run N cells at once, each with cores/N threads unless OMP_NUM_THREADS is set "
                   "[default: 1]. Two lr-sweeps on the same --out also share the work: each skips the cells "
                   "the other is running.")
    p.add_argument("--resume-cells", action="store_true",
                   help="Each cell checkpoints into OUT/cells/<cell>/checkpoint when the sweep is stopped "
                   "(SIGTERM, as a batch system's preemption sends, or Ctrl-C) and a rerun continues an unfinished cell from "
                   "there instead of restarting it (only with unchanged flags); the checkpoint is deleted once the "
                   "cell has its result. For long cells. Local runs only.")
    p.add_argument("--cell-save-interval", type=int, metavar="N",
                   help="With --resume-cells: also checkpoint every N steps, so a cell killed outright (SIGKILL, "
                   "power loss) loses at most N steps.")
    p.add_argument("--max-cells", type=int, help="Stop after running this many new cells (rerun to continue).")
    p.add_argument("--retry-failed", action="store_true", help="Rerun cells that failed (not diverged ones).")
    p.add_argument("--replace-changed", action="store_true", help="Rerun finished cells whose recorded train flags "
                   "differ from this sweep's, replacing their results (without it the sweep refuses to start).")
    p.add_argument("--dry-run", action="store_true", help="Print every cell's command; run nothing.")
    p.add_argument("--slurm-grid", metavar="FILE", help="Write the grid as slurm/lr_sweep.sbatch's TSV and print "
                   "the sbatch command; run nothing.")
    p.add_argument("--gpus-per-cell", type=int, metavar="N",
                   help="With --slurm-grid: each array task (one cell) trains on N GPUs of one node; the printed "
                   "sbatch command asks for them (GPUS_PER_CELL) [default: 1].")
    p.add_argument("--collect", metavar="SLURM_OUT", help="Gather the cells slurm/lr_sweep.sbatch trained into "
                   "SLURM_OUT/<cell>/run (its OUT) into --out's CSVs and plot; give the grid flags used for "
                   "--slurm-grid. Runs nothing.")
    p.add_argument("--no-plot", action="store_true", help="Skip OUT/lr_transfer.png.")
    p.add_argument("--coord-check", action="store_true", help="Coordinate check at each optimizer's centre LR "
                   "(in-process) instead of the sweep.")
    return p


def _check_numbers_and_modes(a) -> None:
    """The sweep's own numbers and the flags that only make sense with some modes (GridError, before any work)."""
    for name, value in (("--steps", a.steps), ("--log-interval", a.log_interval)):
        if value is not None and value < 1:
            raise G.GridError(f"{name} must be >= 1, got {value}")
    if getattr(a, "k_step", 1) < 1:
        raise G.GridError(f"--k-step must be >= 1, got {a.k_step}")
    if getattr(a, "jobs", 1) < 1:
        raise G.GridError(f"--jobs must be >= 1, got {a.jobs}")
    interval = getattr(a, "cell_save_interval", None)
    if interval is not None and (interval < 1 or not getattr(a, "resume_cells", False)):
        raise G.GridError(f"--cell-save-interval {interval}: give N >= 1, together with --resume-cells")
    if getattr(a, "resume_cells", False) and (a.slurm_grid or a.collect or a.coord_check):
        raise G.GridError("--resume-cells applies to cells this lr-sweep runs itself; drop it with "
                          "--slurm-grid/--collect/--coord-check (slurm/lr_sweep.sbatch requeues whole cells)")
    if a.max_cells is not None and a.max_cells < 0:
        raise G.GridError(f"--max-cells must be >= 0, got {a.max_cells}")
    if getattr(a, "extend_edges", 0) < 0:
        raise G.GridError(f"--extend-edges must be >= 0, got {a.extend_edges}")
    if getattr(a, "extend_edges", 0) and (a.dry_run or a.slurm_grid or a.collect or a.coord_check):
        raise G.GridError("--extend-edges needs the results of the grid, so it runs locally only; drop it with "
                          "--dry-run/--slurm-grid/--collect/--coord-check (rerun a wider --k-range instead)")
    if getattr(a, "gpus_per_cell", None) is not None and (a.gpus_per_cell < 1 or not a.slurm_grid):
        raise G.GridError(f"--gpus-per-cell {a.gpus_per_cell}: give N >= 1, together with --slurm-grid (a local "
                          "sweep's cells take -- --nproc-per-node N)")


def build_spec(a, extra: list[str]) -> G.SweepSpec:
    base = ["--config", a.config] if a.config else ["--model", a.model or "tiny-dense"]
    if getattr(a, "corpus", None):
        given = [f for f in ("--data-path", "--tokenizer-model", "--vocab-file", "--mock-data") if any(x.split("=")[0] == f for x in extra)]
        if given:
            raise G.GridError(f"--corpus and {given[0]} after '--' both choose the data; keep one")
        from megatron_md.training.data.datasets import prepare_demo_data

        vocab = getattr(a, "corpus_vocab", 4096)
        if not 64 <= vocab <= 65536:
            raise G.GridError(f"--corpus-vocab must be in [64, 65536], got {vocab}")
        prefix, tokenizer = prepare_demo_data(Path(a.corpus), vocab_size=vocab, log=None)
        extra = ["--data-path", prefix, "--tokenizer-model", tokenizer, *extra]
    optimizers = G.parse_optimizers(a.optimizers)
    G.check_extra(extra, optimizers)
    _check_numbers_and_modes(a)
    from megatron_md.sweep import runner
    from megatron_md.training import config as C

    explicit = runner.base_explicit(base)
    try:
        base_cfg = C.resolve(None if a.config else base[1], a.config, {})
    except ValueError as e:
        raise G.GridError(str(e)) from None
    steps = a.steps
    if steps is None:
        steps = 5 if a.coord_check else base_cfg.training.train_iters
    if a.widths is None:
        if not a.config:
            raise G.GridError("--widths is required with --model (with --config, the config's own width is the "
                              "default)")
        widths = [base_cfg.model.hidden_size]
    else:
        widths = G.parse_widths(a.widths)
    k_centers = G.parse_k_centers(a.k_center)
    k_ranges = G.parse_k_ranges(a.k_range)
    lrs = G.parse_lrs(a.lrs)
    unused = (set(k_centers) | set(k_ranges)) - set(optimizers)
    if unused:
        raise G.GridError(f"--k-center/--k-range for {', '.join(sorted(unused))}, which is not in --optimizers")
    notes = []
    for opt, (k, lr) in G.config_centers(optimizers, base_cfg, explicit).items():
        if opt in k_centers:
            continue
        k_centers[opt] = k
        if isinstance(lrs, int) and opt not in k_ranges:
            notes.append(f"{opt}: --lrs {lrs} centred on k={k} ({G.lr_of_k(k):.3g}), the ladder point of the base "
                         f"config's {G.flag(G.RECIPES[opt].lr_field)} {lr:g} (--k-center {opt}=K moves it)")
    spec = G.SweepSpec(
        base=base, widths=widths, optimizers=optimizers, lrs=lrs,
        seeds=G.parse_seeds(a.seeds), steps=steps, k_centers=k_centers,
        k_ranges=k_ranges, k_step=a.k_step, warmups=G.parse_warmups(a.warmups),
        weight_decays=G.parse_weight_decays(a.weight_decays), log_interval=a.log_interval, extra=extra,
        base_explicit=explicit, notes=notes,
    )
    data = runner.resolve_cell(spec, spec.cells()[0], validate=False).data
    if not data.mock_data and not data.data_path:
        # The cells could not start without data; random tokens at least exercise the whole chain.
        spec.extra = ["--mock-data", *spec.extra]
        spec.notes.append("no --data-path in the base config or after '--': the cells train on --mock-data "
                          "(random tokens: the losses say little about the optimal LR)")
    return spec


def build_specs(a, extra: list[str]) -> list[G.SweepSpec]:
    """One spec per base config: ``--config A,B,...`` (a model ladder, each config at its own width) gives
    several, anything else one."""
    configs = [c.strip() for c in (a.config or "").split(",") if c.strip()]
    if len(configs) <= 1:
        return [build_spec(a, extra)]
    if a.widths is not None:
        raise G.GridError("--widths with several --config files: each config trains at its own width; drop "
                          "--widths (or sweep one config over widths)")
    if a.coord_check:
        raise G.GridError("--coord-check takes one --config (it varies --widths of one model)")
    specs, seen = [], {}
    for config in configs:
        one = argparse.Namespace(**vars(a))
        one.config = config
        spec = build_spec(one, extra)
        width = spec.widths[0]
        if width in seen:
            raise G.GridError(f"--config {seen[width]} and {config} have the same width {width}: their cells "
                              "would share names; sweep them separately")
        seen[width] = config
        specs.append(spec)
    return specs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    a = parser().parse_args(argv)
    out = Path(a.out)

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        specs = build_specs(a, extra)
        notes = list(dict.fromkeys(n for spec in specs for n in spec.notes))
        for note in notes:
            print(f"[lr-sweep] note: {note}", file=sys.stderr, flush=True)
        if a.coord_check:
            from megatron_md.training.arguments import quiet_megatron
            from megatron_md.sweep.coord_check import run_coord_check

            quiet_megatron()
            run_coord_check(specs[0], out, specs[0].steps, log)
            return 0
        from megatron_md.sweep import runner

        if a.dry_run:
            for spec in specs:
                runner.dry_run(spec, out, log)
            return 0
        if a.slurm_grid:
            runner.write_slurm_grid(specs, Path(a.slurm_grid), log, gpus_per_cell=a.gpus_per_cell)
            return 0
        if a.collect:
            if not Path(a.collect).is_dir():
                raise G.GridError(f"--collect {a.collect}: no such directory (slurm/lr_sweep.sbatch's OUT)")
            collected = sum(runner.collect_slurm(spec, Path(a.collect), out, log)["collected"] for spec in specs)
            return _write_results(a, out, log) if collected else 1
        for spec in specs:  # every spec's cells before any runs
            runner.refuse_changed(spec, out, spec.cells(), a.replace_changed)
        rc = 0
        for spec in specs:
            rc = _sweep(spec, a, out, log) or rc
        return rc
    except (G.GridError, ValueError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def _sweep(spec: G.SweepSpec, a, out: Path, log) -> int:
    from megatron_md.sweep import results, runner

    cells = spec.cells()
    cfg0 = runner.resolve_cell(spec, cells[0], more=tuple(runner.local_flags(out, cells[0], a.resume_cells,
                                                                            a.cell_save_interval)))
    for w in runner.width_warnings(spec.base, spec.base_explicit):
        log(f"[lr-sweep] warning: {w}")
    m = cfg0.model
    log(f"[lr-sweep] {len(cells)} cells: widths {spec.widths} x optimizers {spec.optimizers} x seeds {spec.seeds}, "
        f"{spec.steps} steps; head dim {m.kv_channels} fixed (heads = width / {m.kv_channels}), "
        f"FFN = {m.ffn_hidden_size / m.hidden_size:g} x width")
    for opt in spec.optimizers:
        lrs = sorted({c.lr for c in cells if c.optimizer == opt})
        r = G.RECIPES[opt]
        log(f"[lr-sweep] {opt}: {G.flag(r.lr_field)} in " + ", ".join(f"{x:.3g}" for x in lrs))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({
        "argv": sys.argv, "base": spec.base, "widths": spec.widths, "optimizers": spec.optimizers,
        "seeds": spec.seeds, "steps": spec.steps, "extra": spec.extra, "cells": [c.name for c in cells],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=2))
    rc = 0
    try:
        counts = runner.run_sweep(spec, out, max_cells=a.max_cells, retry_failed=a.retry_failed,
                                  on_result=lambda: results.write_all(out), log=log, jobs=a.jobs,
                                  resume=a.resume_cells, save_interval=a.cell_save_interval,
                                  replace_changed=a.replace_changed)
        failed = counts["failed"]
        for round_ in range(1, a.extend_edges + 1):
            if counts["left"]:
                break  # --max-cells stopped the grid: its edges are not known yet
            new = spec.extend_edges(results.sweep_curves(spec, results.collect(out)))
            if not new:
                break
            log(f"[lr-sweep] extend-edges {round_}/{a.extend_edges}: optimum on the grid's edge; adding "
                + ", ".join(sorted({f"{c.optimizer} w{c.width} lr {c.lr:.3g}" for c in new})))
            counts = runner.run_sweep(spec, out, max_cells=a.max_cells, retry_failed=a.retry_failed,
                                      on_result=lambda: results.write_all(out), log=log, jobs=a.jobs,
                                      resume=a.resume_cells, save_interval=a.cell_save_interval,
                                      replace_changed=a.replace_changed)
            failed += counts["failed"]
        if failed:
            log(f"[lr-sweep] {failed} cells failed (recorded as diverged; --retry-failed reruns them)")
            rc = 1
    except (runner.SweepInterrupted, KeyboardInterrupt) as e:
        log(f"[lr-sweep] interrupted ({e or 'Ctrl-C'}): finished cells are kept; rerun the same command to resume")
        rc = 130
    return _write_results(a, out, log) or rc


def _write_results(a, out: Path, log) -> int:
    from megatron_md.sweep import results

    res, opt, rows = results.write_all(out, log)
    log(f"[lr-sweep] wrote {res} ({len(rows)} cells) and {opt}")
    if rows and not a.no_plot:
        from megatron_md.sweep.plot import plot_lr_transfer

        png = plot_lr_transfer(res, out / "lr_transfer.png")
        log(f"[lr-sweep] wrote {png}")
    return 0
