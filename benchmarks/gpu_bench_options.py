"""What a GPU benchmark run is (``gpu_bench.py``): its sections, their time budgets, the command line, and the
description of the machine written into the results."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEMA = 1
DENSE_OPTIMIZERS = ("adam", "muon", "muon_md", "manifold_muon")
OPTIMIZER_FLAGS = {"manifold_muon": ["--geometry", "hetero"]}
# Seconds: (cap, floor). A section's timeout is its cap, cut to leave later sections their floors.
BUDGET = {"gemm": (45, 20), "train": (90, 45), "save_resume": (150, 90), "moe": (80, 45), "knobs": (60, 30),
          "retraction": (60, 20), "moe_whole": (240, 150)}
# Sections run last and only with the time left: no earlier section is cut short to keep their floors. The
# knobs compare variants against a train_ row; a lost knob row costs less than a train row squeezed to its floor;
# save/resume and the small MoE re-measure what the stored run already holds.
BEST_EFFORT = ("knobs", "save_resume", "moe")
SECTIONS = ("gemm", "train", "save_resume", "moe", "knobs", "retraction", "moe_whole")
HEADLINE_OPTIMIZERS = ("adam", "muon_md")  # --part 1: these under each attention backend, and the GEMM
DEFAULT_BUDGET_S = {"1": 300.0, "2": 480.0, "all": 780.0}
# ``knobs_<variant>``: --knobs-optimizer on --preset with one of issue 16's GPU knobs changed, against its
# ``train_`` row: what the default-on CUDA fusions buy, and what recomputation costs in time and saves in memory.
KNOB_VARIANTS = {
    "fusions_off": ("fusions off", ["--no-rope-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                                    "--no-gradient-accumulation-fusion", "--no-cross-entropy-loss-fusion"]),
    "recompute_selective": ("selective recompute", ["--recompute-granularity", "selective"]),
    "recompute_full": ("full recompute", ["--recompute-granularity", "full"]),
}
PACKED_EXPERTS = "packs every local expert"  # MD's refusal of packed expert weights (mcore/naming.py)



def parse_args(argv=None, doc: str = "GPU benchmark.\n\n") -> argparse.Namespace:
    """``gpu_bench.py``'s command line; ``doc``: its docstring (description, then the epilog)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc.split("\n\n", 1)[1])
    a = ap.add_argument
    a("--out", default="runs/gpu_bench/gpu_bench.json", help="results JSON (rewritten after every section)")
    a("--log", help="every section's output (default: gpu_bench.log beside --out)")
    a("--work-dir", help="run directories and the checkpoint (default: a temporary directory, removed)")
    a("--budget-s", type=float, help="wall-clock budget of all sections together (save/resume, the small MoE and "
      "the knobs get what the others leave; default by --part: "
      + ", ".join(f"{k} {v:.0f} s" for k, v in DEFAULT_BUDGET_S.items()) + ")")
    a("--part", choices=sorted(DEFAULT_BUDGET_S), default="all", help="1: the headline sections (GEMM; "
      + " and ".join(HEADLINE_OPTIMIZERS) + " under each attention backend, with their profiles), about 6 "
      "minutes; 2: the rest; all: both")
    a("--merge", help="a previous run's JSON (another --part) whose sections this run's JSON keeps")
    a("--dry-run", action="store_true", help="print the sections, their timeouts and commands; run nothing "
      "(no GPU needed)")
    a("--attention-backends", default="local,sdpa", help="each training section once per --attention-backend "
      "(with --transformer-impl local); empty: the trainer's default, no flag")
    a("--profile-steps", type=int, default=2, help="optimizer steps under torch.profiler after each training "
      "section (0: no profile)")
    a("--retraction-reps", type=int, default=10)
    a("--moe-whole-preset", default="moe-6.7b")
    a("--moe-whole-optimizer", default="muon_md")
    a("--moe-whole-backend", default="sdpa")
    a("--moe-whole-seq-length", type=int, default=4096)
    a("--moe-whole-steps", type=int, default=6)
    a("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    a("--steps", type=int, default=30, help="training iterations per optimizer, warmup included")
    a("--warmup", type=int, default=5, help="first iterations left out of the medians")
    a("--preset", default="dense-181m")
    a("--seq-length", type=int, default=4096)
    a("--micro-batch-size", type=int, default=4)
    a("--optimizers", default=",".join(DENSE_OPTIMIZERS))
    a("--moe-preset", default="moe-0.9b")
    a("--moe-seq-length", type=int, default=4096)
    a("--moe-micro-batch-size", type=int, default=2)
    a("--moe-steps", type=int, default=20)
    a("--moe-optimizers", default="adam,muon_md", help="muon_md falls back to muon if MD refuses packed experts")
    a("--resume-optimizer", default="muon_md")
    a("--knobs-optimizer", default="muon_md")
    a("--knobs-steps", type=int, default=15)
    a("--resume-iters", type=int, default=3, help="N: iterations before the save and after the resume")
    a("--resume-seq-length", type=int, default=1024)
    a("--gemm-sizes", default="4096,8192,16384")
    a("--peak-tflops", type=float, help="bf16 dense peak to quote MFU against (default: from the device name)")
    a("--allow-cpu", action="store_true", help="testing aid: run the sections on the CPU runtime (fp32); "
      "pair with tiny presets; the numbers are no benchmark")
    a("--worker", choices=["gemm", "train", "retraction"], help=argparse.SUPPRESS)
    a("--spec", help=argparse.SUPPRESS)
    a("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown {bad}; choose from {','.join(SECTIONS)}")
    if args.steps < 2 or not 0 <= args.warmup < args.steps or args.resume_iters < 1:
        ap.error("--steps >= 2, 0 <= --warmup < --steps, --resume-iters >= 1")
    if args.moe_whole_steps < 2 or args.profile_steps < 0 or args.retraction_reps < 1:
        ap.error("--moe-whole-steps >= 2, --profile-steps >= 0, --retraction-reps >= 1")
    if args.budget_s is None:
        args.budget_s = DEFAULT_BUDGET_S[args.part]
    return args



def peak_for(name: str) -> float | None:
    """Dense bf16 peak of a device name: the trainer's table (megatron_md.training.observability.throughput)."""
    from megatron_md.training.observability.throughput import peak_tflops_for_name

    return peak_tflops_for_name(name)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(cuda: bool) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "megatron_core": _version("megatron-core"), "emerging_optimizers": _version("emerging-optimizers"),
            "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
            "transformer_engine_found": importlib.util.find_spec("transformer_engine") is not None,
            "hostname": platform.node(), "cpus": os.cpu_count()}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, device_count=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}",
                    memory_gib=p.total_memory / 2**30, multiprocessors=p.multi_processor_count)
    else:
        info.update(device="cpu", device_count=0)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        info["repo_commit"] = {"commit": head, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        info["repo_commit"] = None
    return info

