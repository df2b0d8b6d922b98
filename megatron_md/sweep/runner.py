"""Run the grid's cells one after another, each a `megatron-md train` subprocess, resumably.

A cell is finished when ``OUT/cells/<cell>/result.json`` exists (written atomically after the run)
and records the same train flags as now; finished cells are skipped, so a rerun continues where an
interrupted sweep stopped. A cell that exits 3 (too many non-finite steps), ends with a non-finite
loss or fails is recorded (``diverged``), so it is not retried on every rerun (``--retry-failed``
reruns the failed ones). An unfinished cell's directory is wiped before it runs again: the trainer
appends to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from megatron_md.sweep.grid import Cell, GridError, SweepSpec

RESULT = "result.json"
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT")


class SweepInterrupted(RuntimeError):
    """The sweep was stopped (signal, or a cell that stopped early); finished cells are kept."""


def cell_dir(out: Path, cell: Cell) -> Path:
    return Path(out) / "cells" / cell.name


# ----------------------------------------------------------------------------- configs


def resolve_cell(spec: SweepSpec, cell: Cell, validate: bool = True):
    """The cell's resolved RunConfig, checked like `megatron-md train` checks it (no training)."""
    from megatron_md.training.arguments import train_parser
    from megatron_md.training import config as C
    from megatron_md.training.validate import validate_config

    try:
        args = vars(train_parser().parse_args(spec.train_args(cell)))
    except SystemExit:
        raise GridError(f"cell {cell.name}: `megatron-md train` rejects its flags: {shlex.join(spec.train_args(cell))}")
    yaml_path = args.pop("config", None)
    try:
        cfg = C.resolve(None, yaml_path, args)
        if validate:
            validate_config(cfg, cfg.training.nproc_per_node)
    except ValueError as e:
        where = f"--widths {cell.width}" if "hidden-size" in str(e) else f"cell {cell.name}"
        raise GridError(f"{where}: {e}") from None
    return cfg


def base_explicit(base: list[str]) -> set[str]:
    """Config fields the base YAML sets (the recipe's fixed LRs do not override them)."""
    if base[:1] != ["--config"]:
        return set()
    from megatron_md.training import config as C

    try:
        return C._keys(C.load_yaml(base[1]))
    except ValueError as e:
        raise GridError(str(e)) from None


def param_count(cfg) -> int:
    """Total parameters of the cell's model, with the vocabulary padded as the trainer pads it."""
    import copy

    from megatron_md.models.presets import count_parameters

    raw = cfg.model.vocab_size
    from megatron_md.training.tokenizer import tokenizer_for_data

    tok = tokenizer_for_data(cfg.data)  # None: mock data / NullTokenizer
    if tok is not None:
        raw = tok.vocab_size
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size
    m = copy.copy(cfg.model)
    m.vocab_size = int(math.ceil(raw / multiple) * multiple)  # models.builder.padded_vocab_size, without torch
    return count_parameters(m).total


def width_warnings(base: list[str], explicit: set[str]) -> list[str]:
    """What does not follow --hidden-size (pinned by the base config)."""
    out = []
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "moe_ffn_hidden_size"):
        if name in explicit:
            out.append(f"{' '.join(base)} sets {name}: it stays fixed while --hidden-size changes")
    return out


# ----------------------------------------------------------------------------- results of one run


def summarize_metrics(run_dir: Path) -> dict:
    """Final train loss (mean of the last ~10% logged losses), final eval loss, iterations reached."""
    path = Path(run_dir) / "metrics.jsonl"
    train, evals, last_it, skipped = [], [], 0, 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a run killed mid-write
            if "eval_lm_loss" in rec:
                evals.append(rec["eval_lm_loss"])
            elif "lm_loss" in rec:
                last_it = max(last_it, rec.get("iteration", 0))
                skipped = rec.get("skipped_total", skipped)
                train.append(rec["lm_loss"])
    tail = train[-max(1, math.ceil(0.1 * len(train))):] if train else []
    final_train = _finite_mean(tail)
    final_eval = evals[-1] if evals and _finite(evals[-1]) else None
    return {"final_train_loss": final_train, "final_eval_loss": final_eval, "iterations": last_it,
            "skipped_total": skipped, "logged": len(train), "eval_nonfinite": bool(evals) and final_eval is None}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _finite_mean(xs: list) -> Optional[float]:
    if not xs or not all(_finite(x) for x in xs):
        return None
    return sum(xs) / len(xs)


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_result(path: Path) -> Optional[dict]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ----------------------------------------------------------------------------- running


def _train_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_md.cli", "train", *args]


def run_cell(spec: SweepSpec, cell: Cell, out: Path, params: int) -> dict:
    """Train one cell; return its result record (written to result.json) or raise SweepInterrupted."""
    d = cell_dir(out, cell)
    if d.exists():
        shutil.rmtree(d)  # a run that never finished: its metrics would be appended to
    d.mkdir(parents=True)
    args = spec.train_args(cell)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.setdefault("WANDB_SILENT", "true")
    t0 = time.perf_counter()
    with open(d / "cell.log", "w") as log:
        log.write("$ megatron-md train " + shlex.join(args + ["--run-dir", str(d)]) + "\n")
        log.flush()
        proc = subprocess.Popen(_train_command(args + ["--run-dir", str(d)]), stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait()
        except BaseException:
            # Ctrl-C / SIGTERM of the sweep: stop the cell too (the trainer exits after its step).
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    wall = time.perf_counter() - t0
    m = summarize_metrics(d)
    if rc == 0 and m["iterations"] < cell.steps:
        raise SweepInterrupted(f"cell {cell.name} stopped at iteration {m['iterations']} of {cell.steps} "
                               f"(preempted?); see {d / 'cell.log'}")
    if rc == 0 and m["final_train_loss"] is not None and not m["eval_nonfinite"]:
        status = "ok"
    elif rc in (0, 3):
        status = "diverged"  # exit 3: --max-consecutive-skips non-finite steps in a row
    else:
        status = "failed"
    result = {
        "cell": cell.name, "optimizer": cell.optimizer, "width": cell.width, "params": params,
        "lr": cell.lr, "k": cell.k, "seed": cell.seed, "warmup": cell.warmup,
        "weight_decay": cell.weight_decay, "steps": cell.steps,
        "final_train_loss": m["final_train_loss"], "final_eval_loss": m["final_eval_loss"],
        "diverged": status != "ok", "status": status, "returncode": rc, "wall_s": round(wall, 3),
        "iterations": m["iterations"], "skipped_total": m["skipped_total"], "args": args,
    }
    write_json_atomic(d / RESULT, result)
    return result


def finished(spec: SweepSpec, cell: Cell, out: Path, retry_failed: bool) -> Optional[dict]:
    res = load_result(cell_dir(out, cell) / RESULT)
    if res is None or res.get("args") != spec.train_args(cell):
        return None
    if retry_failed and res.get("status") == "failed":
        return None
    return res


def run_sweep(spec: SweepSpec, out: Path, *, max_cells: Optional[int] = None, retry_failed: bool = False,
              on_result: Optional[Callable[[], None]] = None, log: Callable[[str], None] = print) -> dict:
    """Run every unfinished cell in order; stop after ``max_cells`` new ones. Returns counts."""
    cells = spec.cells()
    configs = {c.name: resolve_cell(spec, c) for c in cells}  # every cell's flags checked before any runs
    params = {}
    counts = {"cells": len(cells), "skipped": 0, "ran": 0, "ok": 0, "diverged": 0, "failed": 0, "left": 0}

    def stop(signum, frame):
        raise SweepInterrupted(f"received signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop) if _main_thread() else None
    try:
        for i, cell in enumerate(cells, 1):
            tag = f"[lr-sweep] {i}/{len(cells)} {cell.name}"
            if finished(spec, cell, out, retry_failed):
                counts["skipped"] += 1
                log(f"{tag}: skipped (finished)")
                continue
            if max_cells is not None and counts["ran"] >= max_cells:
                counts["left"] += 1
                continue
            if cell.width not in params:
                params[cell.width] = param_count(configs[cell.name])
            log(f"{tag}: running ({params[cell.width]:,} parameters)")
            res = run_cell(spec, cell, out, params[cell.width])
            counts["ran"] += 1
            counts[res["status"]] += 1
            loss = res["final_eval_loss"] if res["final_eval_loss"] is not None else res["final_train_loss"]
            shown = f"loss {loss:.4f}" if loss is not None else "no finite loss"
            log(f"{tag}: {res['status']} ({shown}, {res['wall_s']:.1f}s)"
                + (f"; see {cell_dir(out, cell) / 'cell.log'}" if res["status"] == "failed" else ""))
            if on_result is not None:
                on_result()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if counts["left"]:
        log(f"[lr-sweep] stopped after {max_cells} new cells (--max-cells); {counts['left']} left: rerun to continue")
    return counts


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# ----------------------------------------------------------------------------- dry run, SLURM grid


def dry_run(spec: SweepSpec, out: Path, log: Callable[[str], None] = print) -> None:
    for cell in spec.cells():
        resolve_cell(spec, cell)
        done = "# finished: " if finished(spec, cell, out, False) else ""
        log(done + "megatron-md train " + shlex.join(spec.train_args(cell, cell_dir(out, cell))))


def collect_slurm(spec: SweepSpec, src: Path, out: Path, log: Callable[[str], None] = print) -> dict:
    """Record the cells that slurm/lr_sweep.sbatch trained into ``src/<cell>/run`` as finished cells of
    ``out`` (``result.json`` + a copy of ``metrics.jsonl``), so results.csv, optima.csv and the plot
    cover them. Cells still running or never started are counted and left out."""
    counts = {"collected": 0, "unfinished": 0, "missing": 0}
    for cell in spec.cells():
        run = Path(src) / cell.name / "run"
        if not (run / "metrics.jsonl").exists():
            counts["missing"] += 1
            continue
        m = summarize_metrics(run)
        nonfinite = m["final_train_loss"] is None and m["logged"] > 0
        if m["iterations"] < cell.steps and not nonfinite:
            counts["unfinished"] += 1
            log(f"[lr-sweep] {cell.name}: at iteration {m['iterations']} of {cell.steps}: not collected yet")
            continue
        d = cell_dir(out, cell)
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run / "metrics.jsonl", d / "metrics.jsonl")
        status = "ok" if not nonfinite and not m["eval_nonfinite"] else "diverged"
        write_json_atomic(d / RESULT, {
            "cell": cell.name, "optimizer": cell.optimizer, "width": cell.width, "params": None,
            "lr": cell.lr, "k": cell.k, "seed": cell.seed, "warmup": cell.warmup,
            "weight_decay": cell.weight_decay, "steps": cell.steps,
            "final_train_loss": m["final_train_loss"], "final_eval_loss": m["final_eval_loss"],
            "diverged": status != "ok", "status": status, "returncode": None, "wall_s": None,
            "iterations": m["iterations"], "skipped_total": m["skipped_total"], "args": spec.train_args(cell),
            "collected_from": str(run),
        })
        counts["collected"] += 1
    log(f"[lr-sweep] collected {counts['collected']} cells from {src}; {counts['unfinished']} unfinished, "
        f"{counts['missing']} without metrics.jsonl")
    return counts


def write_slurm_grid(spec: SweepSpec, path: Path, log: Callable[[str], None] = print) -> Path:
    """The grid as slurm/lr_sweep.sbatch's TSV (name width lr optimizer seed extra_args).

    The script sets --hidden-size, --lr, --optimizer and --seed from the columns; the rest of each
    cell's flags (swept --matrix-lr, warmup, weight decay, steps, extra train flags) go in extra_args.
    """
    path = Path(path)
    cells = spec.cells()
    rows = ["name\twidth\tlr\toptimizer\tseed\textra_args"]
    for cell in cells:
        cfg = resolve_cell(spec, cell)
        flags = spec.optimizer_flags(cell)
        extra = []
        i = 0
        while i < len(flags):  # --optimizer and --lr are columns
            if flags[i] not in ("--optimizer", "--lr"):
                extra += flags[i:i + 2]
            i += 2
        extra += ["--train-iters", str(cell.steps), "--log-interval", str(spec.log_every()), *spec.extra]
        for a in extra:
            if not a or any(ch.isspace() for ch in a):
                raise GridError(f"--slurm-grid: the train flag {a!r} is empty or has whitespace; the grid's "
                                "extra_args are split on whitespace: put it in the --config YAML instead")
        rows.append("\t".join([cell.name, str(cell.width), repr(cfg.optimizer.lr), cell.recipe.optimizer,
                               str(cell.seed), " ".join(extra)]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")
    if spec.base[0] == "--config":
        config = spec.base[1]
    else:  # the script needs a CONFIG file: one that names the preset
        config = str(path.with_suffix(".yaml"))
        Path(config).write_text(f"preset: {spec.base[1]}\n")
    log(f"wrote {path} ({len(cells)} cells)" + (f" and {config}" if spec.base[0] != "--config" else ""))
    log("submit with:")
    log(f"  mkdir -p logs && GRID={shlex.quote(str(path))} CONFIG={shlex.quote(config)} "
        f"sbatch --array=0-{len(cells) - 1} slurm/lr_sweep.sbatch")
    return path
