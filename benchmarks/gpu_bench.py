"""GPU benchmark of the trainer on one device: throughput, MFU, optimizer-step time, memory, MoE, resume.

Sections, each in its own process (a crash or an out-of-memory loses that section only), each
written to the JSON as soon as it ends (a run cut short keeps what finished):

- ``gemm``: a large bf16 matrix product, the achieved peak that MFU is also quoted against;
- ``train_<optimizer>``: ``--preset`` (default ``dense-181m``, vocab 131072) at ``--seq-length`` 4096,
  bf16, mock data, through ``megatron_md.training.trainer.Trainer`` built from ``megatron-md train``
  flags; forward+backward and ``optimizer.step()`` are timed apart with ``torch.cuda.synchronize``
  (the trainer's metrics.jsonl logs only whole iterations);
- ``save_resume``: ``megatron-md train`` three times (2N straight; N then save; resume N more) and the
  resumed losses compared with the straight run's;
- ``moe_<optimizer>``: a small MoE (``--moe-preset``) with ``--moe-grouped-gemm`` (TE's TEGroupedMLP;
  without Transformer Engine megatron-core 0.19 builds SequentialMLP: recorded, not hidden);
- ``retraction``: the DGram retraction micro-benchmark (``gpu_bench_sections.py``);
- ``moe_whole``: ``--moe-whole-preset`` (``moe-6.7b``) whole on one device, a few steps at micro-batch 1,
  peak memory against what ``megatron-md plan`` predicts for the same flags.

Every training section runs once per ``--attention-backends`` entry (``--transformer-impl local
--attention-backend B``) and ends with a torch.profiler pass over ``--profile-steps`` optimizer steps
(launches, host syncs, GPU-busy fraction; not in the medians). ``--part 1`` runs the headline sections
(the GEMM, ``adam`` and ``muon_md`` under each backend), ``--part 2`` the rest, ``--merge`` adds a previous
part's sections to this run's JSON; ``--dry-run`` prints the sections and their commands without a GPU.

A time guard keeps the whole run inside ``--budget-s``: each section gets a timeout (its cap, less
what later sections need at least), a training worker stops iterating before its timeout, and
SIGTERM writes the JSON before exiting.

    bash tools/gpu_bench.sh                                  # wheels, CUDA/TE checks, then this script
    python benchmarks/gpu_bench.py --out runs/gpu_bench/gpu_bench.json --steps 30
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench_workers import FLOPS_FORMULA, flops_per_token, run_worker  # noqa: E402,F401 (re-exported)
from gpu_bench_options import (  # noqa: E402,F401 (re-exported for tests and tools)
    BEST_EFFORT, BUDGET, DEFAULT_BUDGET_S, DENSE_OPTIMIZERS, HEADLINE_OPTIMIZERS, KNOB_VARIANTS, OPTIMIZER_FLAGS,
    PACKED_EXPERTS, SCHEMA, SECTIONS, machine_info, peak_for,
)
from gpu_bench_options import parse_args as _parse_args  # noqa: E402


class Interrupted(Exception):
    """SIGTERM (the outer timeout): write what we have and stop."""


def parse_args(argv=None):
    return _parse_args(argv, __doc__)


# ----------------------------------------------------------------------------- the driver

class Bench:
    def __init__(self, args, cuda: bool):
        self.args, self.cuda = args, cuda
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + args.budget_s
        self.out = Path(args.out)
        self.log_path = Path(args.log) if args.log else self.out.with_name("gpu_bench.log")
        self.own_work = args.work_dir is None
        if args.dry_run:  # writes nothing
            self.log, self.work = open(os.devnull, "w"), Path(args.work_dir or tempfile.gettempdir()) / "gpu_bench-dry"
        else:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.log = open(self.log_path, "a", buffering=1)
            self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_bench-"))
            self.work.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        machine = machine_info(cuda and not args.dry_run)
        peak = args.peak_tflops or (peak_for(machine["device"]) if cuda else None)
        self.result = {
            "benchmark": "gpu_bench", "schema": SCHEMA, "status": "running",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine,
            "settings": {"budget_s": args.budget_s, "steps": args.steps, "warmup": args.warmup,
                         "precision": "bf16 parameters, fp32 master weights and gradients (megatron DDP)"
                         if cuda else "fp32 (CPU testing aid, not a benchmark)",
                         "device": "cuda" if cuda else "cpu", "sections": args.sections, "part": args.part,
                         "attention_backends": _backends(args), "profile_steps": args.profile_steps,
                         "timing": "torch.cuda.synchronize before and after the iteration, forward+backward "
                                   "and optimizer.step(); tokens/s over the timed iterations' total time; "
                                   "milliseconds are medians over the timed iterations"},
            "flops": {"formula": FLOPS_FORMULA},
            "peak": {"spec_tflops": peak, "spec_source": None if peak is None else
                     ("--peak-tflops" if args.peak_tflops else f"NVIDIA data sheet, dense bf16 without sparsity, "
                      f"for '{machine['device']}'"), "measured_gemm_tflops": None},
            "sections": {},
        }
        if args.merge:
            self.merge(Path(args.merge))

    def merge(self, path: Path) -> None:
        """Keep a previous part's sections (and its measured GEMM peak) in this run's JSON."""
        prev = json.loads(path.read_text())
        if prev.get("benchmark") != "gpu_bench":
            raise SystemExit(f"--merge {path}: not a gpu_bench result")
        self.result["sections"].update(prev.get("sections", {}))
        for k in ("measured_gemm_tflops", "measured_gemm"):
            if prev.get("peak", {}).get(k) is not None:
                self.result["peak"][k] = prev["peak"][k]
        self.result["merged_from"] = {"file": path.name, "created": prev.get("created"),
                                      "part": prev.get("settings", {}).get("part"),
                                      "sections": sorted(prev.get("sections", {}))}

    # -- plumbing

    def write(self) -> None:
        tmp = self.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1) + "\n")
        os.replace(tmp, self.out)

    def say(self, msg: str) -> None:
        line = f"[gpu_bench {time.perf_counter() - self.t0:5.0f}s] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def timeout_for(self, kind: str, later: list[str]) -> float:
        cap, floor = BUDGET[kind]
        reserved = sum(BUDGET[k][1] for k in later if k not in BEST_EFFORT)
        return max(min(cap, self.remaining() - reserved), min(floor, self.remaining()))

    def spawn(self, cmd: list[str], timeout: float) -> tuple[int | None, str]:
        """Run ``cmd`` with its output in the log; (exit code or None on timeout, its output's tail)."""
        self.log.write(f"$ {' '.join(cmd)}\n")
        self.log.flush()
        start = self.log_path.stat().st_size
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            rc = self.proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if self.proc.poll() is None:
                self.kill()
            self.proc = None
        self.log.flush()
        with open(self.log_path) as f:
            f.seek(start)
            tail = f.read()[-3000:]
        return rc, tail

    def kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):  # short: the outer timeout kills us soon
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue

    def worker(self, kind: str, spec: dict, timeout: float) -> dict:
        result_path = self.work / f"result-{len(self.result['sections'])}.json"
        result_path.unlink(missing_ok=True)
        # Wall-clock time at which a training worker stops iterating: room left for its final eval and exit.
        spec = dict(spec, device="cuda" if self.cuda else "cpu", stop_at=time.time() + max(timeout - 20, timeout * 0.6))
        rc, tail = self.spawn([sys.executable, str(Path(__file__).resolve()), "--worker", kind,
                               "--spec", json.dumps(spec), "--result", str(result_path)], timeout)
        if result_path.exists():
            return json.loads(result_path.read_text())
        if rc is None:
            return {"status": "timeout", "error": f"killed after its {timeout:.0f} s timeout", "log_tail": tail}
        return {"status": "failed", "error": f"worker exited {rc} without a result", "log_tail": tail}

    def section(self, name: str, budget: str, later: list[str], fn, meta: dict) -> dict:
        if self.remaining() < 15:
            sec = {"status": "skipped", "error": "out of time (--budget-s)", **meta}
            self.result["sections"][name] = sec
            self.say(f"{name}: skipped, out of time")
            return sec
        timeout = self.timeout_for(budget, later)
        self.result["sections"][name] = {"status": "running", "timeout_s": timeout, **meta}
        self.write()
        self.say(f"{name}: starting (timeout {timeout:.0f} s)")
        t0 = time.perf_counter()
        try:
            sec = fn(timeout)
        except Interrupted:
            sec = {"status": "interrupted", "error": "SIGTERM (outer timeout) during this section"}
            raise
        except Exception as e:  # noqa: BLE001 (one section's failure must not lose the others)
            sec = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        finally:
            if "sec" in locals():
                sec = {**meta, **sec, "timeout_s": timeout, "wall_s": time.perf_counter() - t0}
                self.result["sections"][name] = sec
                self.write()
        extra = f" ({sec.get('error', '')[:300]})" if sec["status"] != "ok" else ""
        self.say(f"{name}: {sec['status']} in {sec['wall_s']:.0f} s{extra}")
        return sec

    # -- sections

    def train_argv(self, preset, optimizer, seq, mbs, iters, run_dir, extra=()) -> list[str]:
        return ["--model", preset, "--optimizer", optimizer, *OPTIMIZER_FLAGS.get(optimizer, []), "--mock-data",
                "--device", "cuda" if self.cuda else "cpu", *(["--bf16"] if self.cuda else []),
                "--seq-length", str(seq), "--micro-batch-size", str(mbs), "--train-iters", str(iters),
                "--log-interval", "10", "--eval-iters", "1", "--diagnostics-interval", "0", "--no-progress-bar",
                "--wandb-mode", "disabled", "--run-dir", str(run_dir), *extra]

    def train(self, name, preset, optimizer, seq, mbs, steps, extra=(), warmup=None, **spec_extra):
        argv = self.train_argv(preset, optimizer, seq, mbs, steps, self.work / name, extra)
        spec = {"argv": argv, "steps": steps, "warmup": self.args.warmup if warmup is None else warmup,
                "profile_steps": self.args.profile_steps, **spec_extra}

        def fn(timeout):
            r = self.worker("train", spec, timeout)
            self.add_mfu(r)
            return {"command": "megatron-md train " + " ".join(argv), **r}
        fn.command, fn.argv = "megatron-md train " + " ".join(argv), argv
        return fn

    def retraction(self, timeout):
        # dense-181m's fc1 [4096, 512] and fc2 (tall: [2048, 512]), one per layer; small on the CPU testing aid
        shapes = [[12, 4096, 512], [12, 2048, 512]] if self.cuda else [[2, 64, 16]]
        return self.worker("retraction", {"shapes": shapes, "reps": self.args.retraction_reps}, timeout)

    def add_mfu(self, r: dict) -> None:
        if r.get("status") != "ok":
            return
        peak = self.result["peak"]
        r["mfu_spec"] = r["model_tflops"] / peak["spec_tflops"] if peak["spec_tflops"] else None
        gemm = peak["measured_gemm_tflops"]
        r["mfu_gemm"] = r["model_tflops"] / gemm if gemm else None

    def gemm(self, timeout):
        sizes = [int(s) for s in self.args.gemm_sizes.split(",")] if self.cuda else [256, 512]
        r = self.worker("gemm", {"sizes": sizes, "reps": 20}, timeout)
        if r.get("status") == "ok":
            self.result["peak"]["measured_gemm_tflops"] = r["best_tflops"]
            self.result["peak"]["measured_gemm"] = f"{r['dtype']} {r['best_n']}^3 torch.matmul, mean of {r['reps']}"
        return r

    def save_resume(self, timeout):
        a, n = self.args, self.args.resume_iters
        stop = time.perf_counter() + timeout
        root = self.work / "save_resume"
        ck = root / "checkpoint"
        shutil.rmtree(root, ignore_errors=True)
        mbs = a.micro_batch_size
        plan = [("straight", []), ("saved", ["--save", str(ck), "--exit-interval", str(n)]),
                ("resumed", ["--load", str(ck)])]
        sec = {"optimizer": a.resume_optimizer, "preset": a.preset, "seq_length": a.resume_seq_length,
               "micro_batch_size": mbs, "iters_before_save": n, "iters_after_resume": n, "runs": {}}
        losses = {}
        try:
            for name, extra in plan:
                argv = self.train_argv(a.preset, a.resume_optimizer, a.resume_seq_length, mbs, 2 * n, root / name,
                                       ["--log-interval", "1", *extra])
                t0 = time.perf_counter()
                rc, tail = self.spawn([sys.executable, "-m", "megatron_md.cli", "train", *argv],
                                      stop - time.perf_counter())
                sec["runs"][name] = {"rc": rc, "wall_s": time.perf_counter() - t0,
                                     "command": "megatron-md train " + " ".join(argv)}
                if rc != 0:
                    status = "timeout" if rc is None else "failed"
                    last = (tail.strip().splitlines() or [""])[-1][:500]
                    return {**sec, "status": status, "error": f"{name} run: " + (
                        "timed out" if rc is None else f"exit {rc}: {last}"), "log_tail": tail}
                metrics = (root / name / "metrics.jsonl").read_text().splitlines()
                losses[name] = {r["iteration"]: r["lm_loss"] for r in map(json.loads, metrics)
                                if r.get("lm_loss") is not None}
                if name == "saved":
                    sec["checkpoint_bytes"] = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())
        finally:
            shutil.rmtree(ck, ignore_errors=True)  # gigabytes at the real shape
        its = list(range(n + 1, 2 * n + 1))
        straight = [losses["straight"].get(i) for i in its]
        resumed = [losses["resumed"].get(i) for i in its]
        sec.update(losses_straight=straight, losses_resumed=resumed,
                   saved_last_iteration=max(losses["saved"], default=None))
        if None in straight or None in resumed or sec["saved_last_iteration"] != n:
            return {**sec, "status": "failed", "error": f"expected losses of iterations {its} and a save at {n}; "
                    f"got saved run up to {sec['saved_last_iteration']}, resumed {sorted(losses['resumed'])}"}
        diffs = [abs(x - y) for x, y in zip(straight, resumed)]
        sec.update(max_abs_diff=max(diffs), max_rel_diff=max(d / max(abs(x), 1e-12) for d, x in zip(diffs, straight)),
                   bit_identical=straight == resumed, tolerance_rel=1e-3)
        sec["losses_match"] = sec["max_rel_diff"] <= sec["tolerance_rel"]
        if not sec["losses_match"]:
            return {**sec, "status": "mismatch",
                    "error": f"resumed losses differ from the straight run's by rel {sec['max_rel_diff']:.2e}"}
        return {**sec, "status": "ok"}

    def moe(self, name, optimizer):
        a = self.args
        train = self.train(name, a.moe_preset, optimizer, a.moe_seq_length, a.moe_micro_batch_size, a.moe_steps,
                           ["--moe-grouped-gemm"])

        def fn(timeout):
            stop = time.perf_counter() + timeout
            r = train(timeout)
            if optimizer in ("muon_md", "adam_md") and PACKED_EXPERTS in r.get("error", ""):
                fallback = self.train(name + "_muon", a.moe_preset, "muon", a.moe_seq_length, a.moe_micro_batch_size,
                                      a.moe_steps, ["--moe-grouped-gemm"])(stop - time.perf_counter())
                return {**fallback, "optimizer": "muon", "note": f"{optimizer} refused the packed experts "
                        f"({r['error'][:300]}); ran muon instead"}
            return r
        return fn

    # -- the run

    def trains(self, optimizers) -> list:
        """One training section per optimizer and attention backend."""
        a, out = self.args, []
        for opt in optimizers:
            for backend in _backends(a) or [None]:
                name = f"train_{opt}" + (f"_{backend}" if backend else "")
                flags = ["--transformer-impl", "local", "--attention-backend", backend] if backend else []
                out.append((name, "train", self.train(name, a.preset, opt, a.seq_length, a.micro_batch_size,
                                                      a.steps, flags),
                            {"kind": "train", "preset": a.preset, "optimizer": opt, "attention_backend": backend}))
        return out

    def plan(self) -> list:
        """(name, budget kind, fn, meta) of every section of this --part, in the order they run."""
        a = self.args
        optimizers = [o for o in a.optimizers.split(",") if o]
        first = [o for o in optimizers if o in HEADLINE_OPTIMIZERS]
        part1, part2 = [], []
        if "gemm" in a.sections:
            part1.append(("gemm", "gemm", self.gemm, {"kind": "gemm"}))
        if "train" in a.sections:
            part1 += self.trains(first)
            part2 += self.trains([o for o in optimizers if o not in first])
        if "retraction" in a.sections:
            part2.append(("retraction", "retraction", self.retraction, {"kind": "retraction"}))
        if "moe_whole" in a.sections:
            backend = a.moe_whole_backend
            fn = self.train("moe_whole", a.moe_whole_preset, a.moe_whole_optimizer, a.moe_whole_seq_length, 1,
                            a.moe_whole_steps, ["--transformer-impl", "local", "--attention-backend", backend],
                            warmup=min(2, a.moe_whole_steps - 1), plan=True)
            part2.append(("moe_whole", "moe_whole", fn, {"kind": "moe_whole", "preset": a.moe_whole_preset,
                                                          "optimizer": a.moe_whole_optimizer,
                                                          "attention_backend": backend}))
        if "save_resume" in a.sections:
            part2.append(("save_resume", "save_resume", self.save_resume, {"kind": "save_resume"}))
        if "moe" in a.sections:
            for opt in [o for o in a.moe_optimizers.split(",") if o]:
                part2.append((f"moe_{opt}", "moe", self.moe(f"moe_{opt}", opt),
                              {"kind": "moe", "preset": a.moe_preset, "optimizer": opt}))
        if "knobs" in a.sections:
            for key, (label, flags) in KNOB_VARIANTS.items():
                part2.append((f"knobs_{key}", "knobs",
                              self.train(f"knobs_{key}", a.preset, a.knobs_optimizer, a.seq_length,
                                         a.micro_batch_size, a.knobs_steps, flags),
                              {"kind": "train", "preset": a.preset, "optimizer": a.knobs_optimizer, "variant": label}))
        return {"1": part1, "2": part2, "all": part1 + part2}[a.part]

    def dry_run(self) -> list[dict]:
        """What a run would do: each section's name, timeout (from the full budget) and command, and for the
        whole MoE the memory ``megatron-md plan`` predicts (computed here: it needs no GPU)."""
        from gpu_bench_sections import planned_memory

        plan, rows = self.plan(), []
        for i, (name, kind, fn, meta) in enumerate(plan):
            later = [k for _, k, _, _ in plan[i + 1:]]
            row = {"name": name, "kind": kind, "timeout_s": self.timeout_for(kind, later),
                   "best_effort": kind in BEST_EFFORT, "command": getattr(fn, "command", None), **meta}
            if kind == "moe_whole":
                try:
                    row["plan"] = planned_memory(fn.argv)
                except BaseException as e:  # noqa: BLE001 (argparse exits on an unknown --attention-backend)
                    row["plan"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
        return rows

    def run(self) -> dict:
        plan = self.plan()
        try:
            for i, (name, kind, fn, meta) in enumerate(plan):
                self.section(name, kind, [k for _, k, _, _ in plan[i + 1:]], fn, meta)
        except Interrupted:
            self.kill()
            self.say("SIGTERM: writing the sections finished so far")
        finally:
            secs = self.result["sections"]
            for name, _, _, meta in plan:
                secs.setdefault(name, {**meta, "status": "skipped", "error": "not reached (interrupted)"})
                if secs[name]["status"] == "running":
                    secs[name].update(status="interrupted", error="the run stopped during this section")
            ok = all(s["status"] == "ok" for s in secs.values())
            self.result["status"] = "ok" if ok else "partial"
            self.result["wall_s"] = time.perf_counter() - self.t0
            self.write()
            self.log.close()
            if self.own_work:
                shutil.rmtree(self.work, ignore_errors=True)
        return self.result


def _backends(args) -> list[str]:
    return [b.strip() for b in (args.attention_backends or "").split(",") if b.strip()]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_readme_tables", REPO / "tools" / "render_readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.dry_run:
        rows = Bench(args, cuda=not args.allow_cpu).dry_run()  # the commands a GPU run would spawn
        for r in rows:
            extra = f"; plan: {r['plan']}" if "plan" in r else ""
            print(f"[part {args.part}] {r['name']:<28} {r['kind']:<12} timeout {r['timeout_s']:4.0f} s"
                  f"{' (best effort)' if r['best_effort'] else ''}{': ' + r['command'] if r['command'] else ''}{extra}")
        print(f"dry run: {len(rows)} sections in --part {args.part}, budget {args.budget_s:.0f} s; nothing ran")
        return 0
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_bench: error: no CUDA device is visible (torch.cuda.is_available() is False); this benchmark "
              "measures a GPU: run `bash tools/gpu_bench.sh` on a machine with one (--allow-cpu is only a "
              "testing aid with tiny presets)", file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise Interrupted()

    signal.signal(signal.SIGTERM, on_term)
    bench = Bench(args, cuda)
    result = bench.run()
    print()
    try:
        print(_renderer().gpu_bench_markdown(result))
    except Exception as e:  # noqa: BLE001 (the JSON is written; the table is a courtesy)
        print(f"(table not rendered: {type(e).__name__}: {e})")
    print(f"\nwrote {bench.out} ({result['status']}, {result['wall_s']:.0f} s); log {bench.log_path}")
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
