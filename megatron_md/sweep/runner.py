"""Run the grid's cells one after another, each a `megatron-md train` subprocess, resumably.

A cell is finished when ``OUT/cells/<cell>/result.json`` exists (written atomically after the run)
and records the same train flags as now; finished cells are skipped, so a rerun continues where an
interrupted sweep stopped. A cell that exits 3 (too many non-finite steps), ends with a non-finite
loss or fails is recorded (``diverged``), so it is not retried on every rerun (``--retry-failed``
reruns the failed ones). An unfinished cell's directory is wiped before it runs again: the trainer
appends to ``metrics.jsonl``. With ``resume=True`` (``--resume-cells``) each cell checkpoints into its own
directory when the sweep is stopped (the trainer saves on SIGTERM) and every ``save_interval`` steps; a rerun
resumes an unfinished cell from that checkpoint (if its flags are unchanged) instead of restarting it, and the
checkpoint is deleted once the cell has its result.

``--jobs N`` runs N cells at once. Each running cell holds an exclusive lock (``OUT/locks/<cell>.lock``,
released by the kernel when its sweep dies), so two sweeps on the same OUT, or a sweep started while another
still runs, skip each other's running cells instead of wiping them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Optional

from megatron_md.sweep.grid import Cell, GridError, SweepSpec

RESULT = "result.json"
LOCKS = "locks"
CHECKPOINT = "checkpoint"  # a resumable cell's checkpoint root, inside the cell's directory
ATTEMPTS = "attempts.json"  # a resumable cell's train flags and each attempt's wall time
ELSEWHERE = "finished elsewhere"  # a cell another sweep finished while this one waited to start it
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT")


class SweepInterrupted(RuntimeError):
    """The sweep was stopped (signal, or a cell that stopped early); finished cells are kept."""


def cell_dir(out: Path, cell: Cell) -> Path:
    return Path(out) / "cells" / cell.name


# ----------------------------------------------------------------------------- configs


def resolve_cell(spec: SweepSpec, cell: Cell, validate: bool = True, more: tuple = ()):
    """The cell's resolved RunConfig, checked like `megatron-md train` checks it (no training); ``more``: flags
    the launcher adds (slurm/lr_sweep.sbatch's --save/--load)."""
    from megatron_md.training.arguments import train_parser
    from megatron_md.training import config as C
    from megatron_md.training.validate import validate_config

    flags = [*spec.train_args(cell), *more]
    try:
        args = vars(train_parser().parse_args(flags))
    except SystemExit:
        raise GridError(f"cell {cell.name}: `megatron-md train` rejects its flags: {shlex.join(flags)}")
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
    from megatron_md.training.data.tokenizer import tokenizer_for_data

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
    # Keyed by iteration, the last record winning: a cell resumed from a checkpoint older than its last logged
    # step logs those steps again (the resumed values are the ones the result continues from).
    train_by, evals_by, skipped = {}, {}, 0
    if path.exists():
        for n, line in enumerate(path.read_text().splitlines()):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a run killed mid-write
            it = rec.get("iteration", n)
            if "eval_lm_loss" in rec:
                evals_by[it] = rec["eval_lm_loss"]
            elif "lm_loss" in rec:
                train_by[it] = (rec["lm_loss"], rec.get("skipped_total"))
    train = [train_by[i][0] for i in sorted(train_by)]
    evals = [evals_by[i] for i in sorted(evals_by)]
    last_it = max(train_by, default=0)
    if train_by:
        skipped = train_by[last_it][1] or 0
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


@contextlib.contextmanager
def cell_lock(out: Path, cell: Cell):
    """Yield True while this process holds the cell's lock, False when another process holds it."""
    d = Path(out) / LOCKS
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{cell.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        except OSError:
            yield True  # a file system without locks (some NFS mounts): run unguarded, as before locks existed
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class _Stop:
    """What a sweep stopping (signal, Ctrl-C) tells its running cells: terminate, and record nothing."""

    def __init__(self):
        self.event = threading.Event()
        self.procs: set = set()
        self.lock = threading.Lock()

    def start(self, proc) -> None:
        with self.lock:
            self.procs.add(proc)
            if self.event.is_set():
                proc.send_signal(signal.SIGTERM)

    def done(self, proc) -> None:
        with self.lock:
            self.procs.discard(proc)

    def all(self) -> None:
        """SIGTERM every running cell (the trainer exits after its step); kill those still there after 60 s."""
        with self.lock:
            self.event.set()
            procs = list(self.procs)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def resumable_from(d: Path, args: list[str]) -> Optional[int]:
    """The iteration an unfinished cell can resume from: its checkpoint's, when the cell was started with the
    same train flags and has no result yet; None otherwise (the cell starts over)."""
    from megatron_md.training.checkpoints.integrity import LATEST

    try:
        attempts = json.loads((d / ATTEMPTS).read_text())
        latest = int((d / CHECKPOINT / LATEST).read_text().strip())
    except (OSError, ValueError, json.JSONDecodeError):
        return None
    if (d / RESULT).exists() or attempts.get("args") != args:
        return None
    return latest


def local_flags(out: Path, cell: Cell, resume: bool = False, save_interval: Optional[int] = None) -> list[str]:
    """The flags a local cell runs with beside the grid's: with ``resume`` its own checkpoint directory (saved on
    SIGTERM and every ``save_interval`` steps); without, no periodic saves (``--save-interval 0``), so a recipe
    written for a cluster run that saves every N steps (examples/md_paper) sweeps locally without a --save."""
    if not resume:
        return ["--save-interval", "0"]
    ckpt = str(cell_dir(out, cell) / CHECKPOINT)
    flags = ["--save", ckpt, "--load", ckpt, "--keep-last-n-checkpoints", "1"]  # resuming needs the newest
    return flags + (["--save-interval", str(save_interval)] if save_interval else [])


def run_cell(spec: SweepSpec, cell: Cell, out: Path, params: int, stop: Optional[_Stop] = None,
             threads: Optional[int] = None, resume: bool = False, save_interval: Optional[int] = None) -> dict:
    """Train one cell (``threads``: its OMP_NUM_THREADS); return its result record (written to result.json)
    or raise SweepInterrupted. ``resume``: checkpoint the cell (on SIGTERM, and every ``save_interval``
    steps) and continue an unfinished one from its checkpoint."""
    stop = stop or _Stop()
    d = cell_dir(out, cell)
    args = spec.train_args(cell)
    start = resumable_from(d, args) if resume else None
    if d.exists() and start is None:
        shutil.rmtree(d)  # a run that never finished: its metrics would be appended to
    d.mkdir(parents=True, exist_ok=True)
    run_args = args + ["--run-dir", str(d)] + local_flags(out, cell, resume, save_interval)
    attempts = {"args": args, "attempts": []}
    if resume:
        if start is not None:
            attempts = json.loads((d / ATTEMPTS).read_text())
        attempts["attempts"].append({"from_iteration": start or 0, "wall_s": None})
        write_json_atomic(d / ATTEMPTS, attempts)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.setdefault("WANDB_SILENT", "true")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    with open(d / "cell.log", "a" if start is not None else "w") as log:
        log.write("$ megatron-md train " + shlex.join(run_args) + "\n")
        log.flush()
        # A resumable cell has its own session, so a terminal's Ctrl-C reaches only the sweep, which then stops the
        # cell with SIGTERM: the trainer saves on SIGTERM, not on SIGINT.
        proc = subprocess.Popen(_train_command(run_args), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=resume)
        stop.start(proc)
        try:
            rc = proc.wait()
        except BaseException:
            stop.all()
            raise
        finally:
            stop.done(proc)
    wall = time.perf_counter() - t0
    if resume:
        attempts["attempts"][-1]["wall_s"] = round(wall, 3)
        write_json_atomic(d / ATTEMPTS, attempts)
        wall = sum(a["wall_s"] or 0.0 for a in attempts["attempts"])
    if stop.event.is_set():
        raise SweepInterrupted(f"cell {cell.name} stopped with the sweep")  # not a result: rerun it on resume
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
    if resume:
        result["attempts"] = len(attempts["attempts"])
    write_json_atomic(d / RESULT, result)
    shutil.rmtree(d / CHECKPOINT, ignore_errors=True)  # the result is what the sweep keeps; checkpoints are large
    return result


def finished(spec: SweepSpec, cell: Cell, out: Path, retry_failed: bool) -> Optional[dict]:
    res = load_result(cell_dir(out, cell) / RESULT)
    if res is None or res.get("args") != spec.train_args(cell):
        return None
    if retry_failed and res.get("status") == "failed":
        return None
    return res


def _flag_diff(then: list, now: list) -> str:
    """What changed between two flag lists, as ``was X; now Y``."""
    import difflib

    parts = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=then, b=now, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            parts.append("was " + shlex.join(then[i1:i2]))
        if op in ("insert", "replace"):
            parts.append("now " + shlex.join(now[j1:j2]))
    return "; ".join(parts)


def refuse_changed(spec: SweepSpec, out: Path, cells: list[Cell], replace: bool = False) -> None:
    """GridError when a cell of this sweep already holds a result made with other train flags: running would
    replace it (a cell's name carries its grid point, not the flags after ``--``). ``replace``: allowed."""
    changed = []
    for cell in cells:
        res = load_result(cell_dir(out, cell) / RESULT)
        if res is not None and res.get("args") != spec.train_args(cell):
            changed.append(f"{cell.name} ({_flag_diff(list(res.get('args') or []), spec.train_args(cell))})")
    if changed and not replace:
        raise GridError(f"{len(changed)} finished cell(s) in {out} were run with other train flags, and this sweep "
                        f"would replace their results: {changed[0]}" + (f" and {len(changed) - 1} more" if
                                                                         len(changed) > 1 else "")
                        + ". Give this sweep its own --out (a value after -- is not part of a cell's name), or "
                        "pass --replace-changed to rerun them.")


def run_sweep(spec: SweepSpec, out: Path, *, max_cells: Optional[int] = None, retry_failed: bool = False,
              on_result: Optional[Callable[[], None]] = None, log: Callable[[str], None] = print,
              jobs: int = 1, resume: bool = False, save_interval: Optional[int] = None,
              replace_changed: bool = False) -> dict:
    """Run every unfinished cell in order, ``jobs`` at a time; stop after ``max_cells`` new ones. A cell another
    sweep is running (its lock is held) is skipped and counted as ``busy``. ``resume``/``save_interval``: as
    run_cell's. A finished cell made with other flags is refused (``refuse_changed``) unless ``replace_changed``.
    Returns counts."""
    printing = threading.Lock()

    def log_line(msg: str, _log=log) -> None:  # whole lines, whichever cell's thread logs
        with printing:
            _log(msg)

    log = log_line
    cells = spec.cells()
    refuse_changed(spec, out, cells, replace_changed)
    # every cell's flags checked before any runs, as the cell will run them
    configs = {c.name: resolve_cell(spec, c, more=tuple(local_flags(out, c, resume, save_interval))) for c in cells}
    params = {}
    counts = {"cells": len(cells), "skipped": 0, "ran": 0, "ok": 0, "diverged": 0, "failed": 0, "left": 0, "busy": 0}
    todo = []
    for i, cell in enumerate(cells, 1):
        tag = f"[lr-sweep] {i}/{len(cells)} {cell.name}"
        if finished(spec, cell, out, retry_failed):
            counts["skipped"] += 1
            log(f"{tag}: skipped (finished)")
        elif max_cells is not None and len(todo) >= max_cells:
            counts["left"] += 1
        else:
            todo.append((tag, cell))
    for _, cell in todo:
        if cell.width not in params:
            params[cell.width] = param_count(configs[cell.name])
    stop = _Stop()
    # N cells at once share the cores (unless the user chose OMP_NUM_THREADS): torch would give each all of them
    threads = None if jobs <= 1 or "OMP_NUM_THREADS" in os.environ else max(1, (os.cpu_count() or 1) // jobs)

    def one(tag: str, cell: Cell):
        with cell_lock(out, cell) as mine:
            if not mine:
                return None
            if finished(spec, cell, out, retry_failed):
                return ELSEWHERE
            start = resumable_from(cell_dir(out, cell), spec.train_args(cell)) if resume else None
            log(f"{tag}: running ({params[cell.width]:,} parameters)"
                + (f", resumed from its iteration {start}" if start is not None else ""))
            return run_cell(spec, cell, out, params[cell.width], stop, threads, resume, save_interval)

    def signalled(signum, frame):
        raise SweepInterrupted(f"received signal {signum}")

    previous = signal.signal(signal.SIGTERM, signalled) if _main_thread() else None
    pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="lr-sweep-cell")
    try:
        pending = {pool.submit(one, tag, cell): (tag, cell) for tag, cell in todo}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: pending[f][0]):
                tag, cell = pending.pop(fut)
                res = fut.result()  # a cell's SweepInterrupted stops the sweep here
                if _count_result(res, tag, cell_dir(out, cell), counts, log) and on_result is not None:
                    on_result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        stop.all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if counts["left"]:
        log(f"[lr-sweep] stopped after {max_cells} new cells (--max-cells); {counts['left']} left: rerun to continue")
    if counts["busy"]:
        log(f"[lr-sweep] {counts['busy']} cells were running in another lr-sweep: rerun when it is done to "
            "include them")
    return counts


def _count_result(res, tag: str, d: Path, counts: dict, log: Callable[[str], None]) -> bool:
    """One cell's outcome into ``counts`` and the log; True when the cell ran here (a new result)."""
    if res is None:
        counts["busy"] += 1
        log(f"{tag}: skipped (another lr-sweep on this --out is running it)")
        return False
    if res is ELSEWHERE:
        counts["skipped"] += 1
        log(f"{tag}: skipped (finished by another lr-sweep)")
        return False
    counts["ran"] += 1
    counts[res["status"]] += 1
    loss = res["final_eval_loss"] if res["final_eval_loss"] is not None else res["final_train_loss"]
    shown = f"loss {loss:.4f}" if loss is not None else "no finite loss"
    log(f"{tag}: {res['status']} ({shown}, {res['wall_s']:.1f}s)"
        + (f"; see {d / 'cell.log'}" if res["status"] == "failed" else ""))
    return True


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# ----------------------------------------------------------------------------- dry run, SLURM grid


def dry_run(spec: SweepSpec, out: Path, log: Callable[[str], None] = print) -> None:
    for cell in spec.cells():
        resolve_cell(spec, cell, more=tuple(local_flags(out, cell)))
        done = "# finished: " if finished(spec, cell, out, False) else ""
        log(done + "megatron-md train " + shlex.join(spec.train_args(cell, cell_dir(out, cell)) + local_flags(out, cell)))


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


def write_slurm_grid(specs, path: Path, log: Callable[[str], None] = print,
                     gpus_per_cell: Optional[int] = None) -> Path:
    """The grid as slurm/lr_sweep.sbatch's TSV (name width lr optimizer seed config extra_args).

    The script sets --config, --hidden-size, --lr, --optimizer and --seed from the columns; the rest of each
    cell's flags (swept --matrix-lr, warmup, weight decay, steps, extra train flags) go in extra_args. One
    spec per base config (``--config A,B,...``: a model ladder); a ``--model`` base gets a one-line YAML
    naming the preset next to the grid. Prints the sbatch command (OUT pinned, so --collect knows it) and the
    --collect command.
    """
    if isinstance(specs, SweepSpec):
        specs = [specs]
    path = Path(path)
    stem = path.name.rsplit(".", 1)[0]
    slurm_out = Path("runs") / "sweeps" / stem
    rows = ["name\twidth\tlr\toptimizer\tseed\tconfig\textra_args"]
    written = []
    n = 0
    for spec in specs:
        if spec.base[0] == "--config":
            config = spec.base[1]
        else:  # the script needs a CONFIG file: one that names the preset
            config = str(path.with_suffix(".yaml"))
            written.append(config)
        for cell in spec.cells():
            cfg = resolve_cell(spec, cell, more=("--save", str(slurm_out / cell.name), "--load", str(slurm_out / cell.name)))
            flags = spec.optimizer_flags(cell)
            extra = []
            i = 0
            while i < len(flags):  # --optimizer and --lr are columns
                if flags[i] not in ("--optimizer", "--lr"):
                    extra += flags[i:i + 2]
                i += 2
            extra += ["--train-iters", str(cell.steps), "--log-interval", str(spec.log_every()), *spec.extra]
            for a in [config, *extra]:
                if not a or any(ch.isspace() for ch in a):
                    raise GridError(f"--slurm-grid: {a!r} is empty or has whitespace; the grid's cells are split on "
                                    "tabs and extra_args on whitespace: put it in the --config YAML instead")
            rows.append("\t".join([cell.name, str(cell.width), repr(cfg.optimizer.lr), cell.recipe.optimizer,
                                   str(cell.seed), config, " ".join(extra)]))
            n += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    for config in dict.fromkeys(written):
        Path(config).write_text(f"preset: {specs[0].base[1]}\n")
    path.write_text("\n".join(rows) + "\n")
    log(f"wrote {path} ({n} cells)" + (f" and {written[0]}" if written else ""))
    gpus = gpus_per_cell or 1
    sbatch = ["sbatch", f"--array=0-{n - 1}"]
    if gpus > 1:
        sbatch += [f"--gpus-per-node={gpus}", f"--cpus-per-task={8 * gpus}"]
    env = [f"GRID={shlex.quote(str(path))}", f"OUT={shlex.quote(str(slurm_out))}"]
    if gpus > 1:
        env.append(f"GPUS_PER_CELL={gpus}")
    log("submit with (from this directory; add --array=...%K to run at most K cells at once):")
    log(f"  mkdir -p logs && {' '.join(env)} {' '.join(sbatch)} slurm/lr_sweep.sbatch")
    log("collect with: the same lr-sweep flags, --collect " + shlex.quote(str(slurm_out)) + " in place of --slurm-grid")
    return path
