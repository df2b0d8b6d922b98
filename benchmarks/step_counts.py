"""Dispatched ops and device→host syncs of one steady-state optimizer step, at the presets' structures.

On a GPU the optimizer step's time follows the number of launched kernels and host syncs more than its
FLOPs, so this benchmark counts them on the CPU runtime: a ``TorchDispatchMode`` sees every aten op that
``optimizer.step()`` (megatron's wrapper: grad norm, clipping, every inner optimizer, main→model copies)
and the LR scheduler's step dispatch, exactly as the trainer's ``train_step`` calls them.

The counted step is the third, after two warm-up steps (lazily made state exists by then), from the same
fixed random ``main_grad`` each time. Models are built through ``megatron_md.training.build`` as the
trainer builds them (bf16 parameters, fp32 master weights and the distributed optimizer, as the GPU
recipes train), world size 1 on the CPU runtime (gloo), at each preset's structure — layers, experts,
heads and query groups, SwiGLU, untied embeddings — but a reduced width and vocabulary: what is
counted is the number of dispatches, which depends on how many tensors there are, not on their sizes
(``--check-width`` runs the first preset again at another width and vocabulary to show it).

    python benchmarks/step_counts.py                          # or: make bench-counts
    python benchmarks/step_counts.py --presets dense-181m --optimizers muon_md,adam --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import optimizer_step  # noqa: E402
from optimizer_step import machine_info, single_process_world  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "step_counts_cpu.json"
OPTIMIZERS = ("adam", "muon", "muon_md", "adam_md", "manifold_muon")
# Not views by their schema, but they only relabel a fresh tensor's shape (a reshape that had to copy returns
# one): no kernel runs, so they are counted with the views.
METADATA_ONLY = ("aten._unsafe_view.default",)
OPTIMIZER_FLAGS = {"manifold_muon": {"geometry": "hetero"}}  # the geometry the trainer's examples use

# Counted models: the preset whose structure is kept, and experts per process. "moe-6.7b-ep8" is one rank
# of moe-6.7b's recipe (expert parallel 8): 64 / 8 = 8 local experts, see the README for what that leaves out.
# ``recipe``: the example whose model options (sandwich norm, layer scale, ...: more parameter tensors) are taken.
MODELS = {
    "dense-181m": {"preset": "dense-181m", "ep": 1, "recipe": "examples/md_paper/dense-181m_muon_md.yaml"},
    "moe-0.9b": {"preset": "moe-0.9b", "ep": 1, "recipe": None},
    "moe-6.7b-ep8": {"preset": "moe-6.7b", "ep": 8, "recipe": "examples/md_paper/moe-6.7b_muon_md.yaml"},
}

# Issue 30's targets: (model, optimizer) -> the most ops and syncs one step may take. "ops_vs" makes the ops
# bound relative: at most ``factor`` times the count of another (model, optimizer) of the same run.
TARGETS = {
    ("dense-181m", "muon_md"): {"ops": 400, "syncs": 2},
    ("moe-0.9b", "muon_md"): {"ops": 800, "syncs": 2},
    ("moe-6.7b-ep8", "muon_md"): {"ops_vs": ("moe-0.9b", "muon_md"), "factor": 1.5, "syncs": 2},
    ("dense-181m", "manifold_muon"): {"ops": 600, "syncs": 2},
    ("dense-181m", "adam"): {"ops": 150, "syncs": 2},
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                    help="comma-separated subset of " + ",".join(OPTIMIZERS))
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--vocab-size", type=int, default=1024,
                    help="reduced vocabulary (chosen so that no embedding shape equals a hidden matrix's)")
    ap.add_argument("--fp32", action="store_true", help="fp32 parameters and megatron's plain (non-distributed) "
                    "optimizer instead of bf16 + --use-distributed-optimizer")
    ap.add_argument("--no-recipe", action="store_true", help="the bare presets, without their example recipes' "
                    "model options (sandwich norm, layer scale: fewer 1-D tensors)")
    ap.add_argument("--check-width", type=int, default=48, metavar="HIDDEN",
                    help="count the first preset again at this width and twice the vocabulary; 0: skip")
    ap.add_argument("--warmup", type=int, default=2, help="uncounted steps before the counted one")
    ap.add_argument("--device-path", choices=("cuda", "cpu"), default="cuda",
                    help="where the code picks its path by device (DEVICE_PATHS), count the one CUDA takes "
                    "(default) or the CPU one")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timing-log-level", type=int, default=0, choices=(0, 1, 2),
                    help="megatron-core's timers at this level, handed to the optimizer as the trainer does")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON (a .md table is written beside it)")
    args = ap.parse_args(argv)
    args.presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    args.optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    bad = [p for p in args.presets if p not in MODELS] + [o for o in args.optimizers if o not in OPTIMIZERS]
    if bad or not args.presets or not args.optimizers:
        ap.error(f"unknown or empty --presets/--optimizers {bad}; presets: {','.join(MODELS)}; "
                 f"optimizers: {','.join(OPTIMIZERS)}")
    if args.warmup < 0 or args.threads < 1 or args.hidden_size < 1 or args.check_width < 0:
        ap.error("--warmup >= 0, --threads >= 1, --hidden-size >= 1, --check-width >= 0")
    return args


# ----------------------------------------------------------------------------- the counter

class OpCounter:
    """Counts the aten ops dispatched inside ``with counter:``.

    Rule: every dispatch of an op that is not a view counts once (``func.is_view``: the schema's first
    return aliases an input without writing it — view, reshape-as-view, t, slice, select, split, unbind,
    detach, alias ...; those launch no kernel), nor ``aten._unsafe_view`` (a reshape's relabelling of a fresh
    tensor, no kernel either), nor ``profiler::`` ops (``record_function`` annotations such as
    torch.optim's ``Optimizer.step#AdamW.step``). A ``torch._foreach_*`` op is one dispatch. A sync is an op
    tagged ``torch.Tag.data_dependent_output`` (``aten._local_scalar_dense``: ``.item()``, ``float(t)``,
    ``bool(t)``; ``aten.equal``), plus every call of ``Tensor.tolist``/``numpy``/``cpu``, which on the CPU
    runtime read memory without an aten dispatch and on a GPU copy to the host. Ops tagged
    ``dynamic_output_shape`` (``nonzero``, ``masked_select``, ``unique``) wait for the device too; they are
    counted apart. Syncs and dynamic-shape ops are ops as well (they are dispatches)."""

    HOST_READS = ("tolist", "numpy", "cpu")

    def __init__(self):
        self.ops: collections.Counter = collections.Counter()
        self.views = 0
        self.annotations = 0
        self.syncs = 0
        self.dynamic_shape = 0
        self.host_reads = 0
        self._mode = None
        self._saved = {}

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def _dispatch(self, func):
        import torch

        if func.is_view or str(func) in METADATA_ONLY:
            self.views += 1
            return
        if func.namespace == "profiler":
            self.annotations += 1
            return
        self.ops[str(func)] += 1
        if torch.Tag.data_dependent_output in func.tags:
            self.syncs += 1
        if torch.Tag.dynamic_output_shape in func.tags:
            self.dynamic_shape += 1

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter._dispatch(func)
                return func(*args, **(kwargs or {}))

        for name in self.HOST_READS:  # patched on torch.Tensor for the counted region only
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapped(t, *a, _original=original, **k):
                counter.host_reads += 1
                return _original(t, *a, **k)
            setattr(torch.Tensor, name, wrapped)
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        try:
            self._mode.__exit__(*exc)
        finally:
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)
            self._saved.clear()
        return False

    def summary(self, top: int = 10) -> dict:
        return {"ops": self.total, "syncs": self.syncs + self.host_reads, "local_scalar_dense":
                self.ops.get("aten._local_scalar_dense.default", 0), "host_reads": self.host_reads,
                "dynamic_shape": self.dynamic_shape, "views_skipped": self.views,
                "annotations_skipped": self.annotations,
                "collectives": sum(n for k, n in self.ops.items() if k.startswith("c10d.")),
                "distinct_ops": len(self.ops), "top_ops": [[k, n] for k, n in self.ops.most_common(top)],
                "by_op": dict(sorted(self.ops.items()))}


# ----------------------------------------------------------------------------- model + optimizer

def model_config(model: str, optimizer: str, hidden: int, vocab: int, args):
    """The RunConfig the trainer would resolve for ``model`` with ``optimizer``, at a reduced width: the
    preset's layers, heads, query groups, top-k and experts per process (an EP rank's share), and head width
    ``hidden / heads`` as at the real width, so every hidden matrix is the real one scaled by the same factor.
    Shapes that coincide at the real width coincide here too (at ``dense-181m`` the query block of QKV and
    the attention output are both hidden x hidden), which matters: matrices of one shape share a bucket."""
    from megatron_md.training.config import load_yaml, resolve

    spec = MODELS[model]
    use = spec["recipe"] and not args.no_recipe
    recipe = load_yaml(str(REPO / spec["recipe"])).get("model", {}) if use else {}
    real = resolve(spec["preset"], None, dict(recipe)).model
    if hidden % real.num_attention_heads or real.hidden_size != real.num_attention_heads * real.kv_channels:
        raise ValueError(f"{model}: hidden {hidden} must be a multiple of its {real.num_attention_heads} heads")
    cli = {**recipe, "optimizer": optimizer, "hidden_size": hidden, "kv_channels": hidden // real.num_attention_heads,
           "num_attention_heads": real.num_attention_heads, "num_query_groups": real.num_query_groups,
           "vocab_size": vocab, "mock_data": True, "wandb_mode": "disabled", "device": "cpu",
           "bf16": not args.fp32, "use_distributed_optimizer": not args.fp32, "seed": args.seed,
           **OPTIMIZER_FLAGS.get(optimizer, {})}
    if real.num_experts:
        if real.num_experts % spec["ep"]:
            raise ValueError(f"{model}: {real.num_experts} experts do not divide by EP {spec['ep']}")
        cli["num_experts"] = real.num_experts // spec["ep"]
        cli["moe_router_topk"] = min(real.moe_router_topk, cli["num_experts"])
    return resolve(spec["preset"], None, cli)


@contextlib.contextmanager
def device_path(kind: str):
    """Make the code that chooses by device take ``kind``'s path while counting on the CPU runtime: Manifold
    Muon branches on values only on CPU (``manifolds.host_branches``) and retracts DGram with fp64 eigh on CPU,
    GEMMs elsewhere (``manifold_muon.retraction_for``)."""
    import torch

    from megatron_md.optim import manifold_muon, manifolds

    if kind == "cpu" or not hasattr(manifolds, "host_branches"):  # (older code: one path everywhere)
        yield
        return
    saved = manifolds.host_branches, manifold_muon.retraction_for
    manifolds.host_branches = lambda device: False
    manifold_muon.retraction_for = lambda hp, device: saved[1](hp, torch.device("cuda"))
    try:
        yield
    finally:
        manifolds.host_branches, manifold_muon.retraction_for = saved


def count_step(model: str, optimizer: str, hidden: int, vocab: int, args) -> dict:
    """Build ``model`` with ``optimizer``, step ``--warmup`` times, count the next step (on the device path
    ``--device-path`` names)."""
    with device_path(getattr(args, "device_path", "cuda")):
        return _count_step(model, optimizer, hidden, vocab, args)


def _count_step(model: str, optimizer: str, hidden: int, vocab: int, args) -> dict:
    import torch

    from megatron_md.mcore.timing import make_timers, timed
    from megatron_md.training.build import build_optimizer_and_hooks, build_wrapped_model, global_batch_size
    from megatron_md.training.build import seed_everything, vocab_size_for

    cfg = model_config(model, optimizer, hidden, vocab, args)
    seed_everything(args.seed)
    ddp, tconfig = build_wrapped_model(cfg, vocab_size_for(cfg, None), cpu=True)
    # megatron-core's timers at --timing-log-level, handed over as the trainer hands them (default 0: all dummies)
    timers = make_timers(getattr(args, "timing_log_level", 0), "minmax")
    tconfig.timers = timers
    opt, scheduler, _ = build_optimizer_and_hooks(cfg, ddp, timers)
    params = list(ddp.module.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for _, p in sorted(ddp.module.named_parameters(), key=lambda kv: kv[0]):
            p.main_grad.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 1e-3)
    buffers = list(ddp.buffers) + list(ddp.expert_parallel_buffers)
    saved = [b.grad_data.clone() for b in buffers]
    gbs = global_batch_size(cfg)
    counter = OpCounter()
    for i in range(args.warmup + 1):
        opt.zero_grad()  # the trainer's order: zero, (backward fills main_grad), step, scheduler
        for b, g in zip(buffers, saved):
            b.grad_data.copy_(g)  # clipping scaled it in place
        with counter if i == args.warmup else contextlib.nullcontext(), timed(timers, "optimizer"):
            ok, _, _ = opt.step()
            scheduler.step(increment=gbs)
        if not ok:
            raise RuntimeError(f"{model} {optimizer}: optimizer.step() reported failure at step {i + 1}")
    m = cfg.model
    return {**counter.summary(), "cpu_only_paths": cpu_only_paths(ddp.module),
            "parameters": sum(p.numel() for p in params), "tensors": len(params),
            "matrices": sum(1 for p in params if p.dim() >= 2),
            "structure": {"layers": m.num_layers, "hidden_size": m.hidden_size, "heads": m.num_attention_heads,
                          "query_groups": m.num_query_groups, "kv_channels": m.kv_channels,
                          "ffn_hidden_size": m.ffn_hidden_size, "experts": m.num_experts or 0,
                          "moe_ffn_hidden_size": m.moe_ffn_hidden_size if m.num_experts else None,
                          "topk": m.moe_router_topk if m.num_experts else None,
                          "vocab_size": vocab_size_for(cfg, None)}}


def cpu_only_paths(module) -> list[str]:
    """Size rules that would make this CPU count differ from a GPU's at the same structure: the engine loops
    Newton-Schulz over a bucket of matrices above CPU_BATCH_MAX_ELEMENTS on CPU only, and MD's Adam base
    fuses matrices of COMPILE_MIN_ELEMENTS or more (on any device). Empty at the default width."""
    from megatron_md.optim.adam import COMPILE_MIN_ELEMENTS
    from megatron_md.parallel.orthogonalize import CPU_BATCH_MAX_ELEMENTS

    looped = compiled = 0
    for name, p in module.named_parameters():
        hidden = p.dim() >= 2 and "embedding" not in name and "output_layer" not in name
        looped += hidden and p.numel() > CPU_BATCH_MAX_ELEMENTS
        compiled += p.numel() >= COMPILE_MIN_ELEMENTS
    return ([f"{looped} hidden matrices above {CPU_BATCH_MAX_ELEMENTS} elements: Newton-Schulz loops on CPU"]
            if looped else []) + \
        ([f"{compiled} matrices of {COMPILE_MIN_ELEMENTS}+ elements: MD's Adam base is compiled"] if compiled else [])


# ----------------------------------------------------------------------------- targets

def judge(results: dict) -> dict:
    """Each target of TARGETS that this run measured: bound, value, met (ops and syncs + dynamic shapes)."""
    out = {}
    for (model, optimizer), t in TARGETS.items():
        r = results.get(model, {}).get(optimizer)
        if r is None:
            continue
        if "ops_vs" in t:
            ref = results.get(t["ops_vs"][0], {}).get(t["ops_vs"][1])
            if ref is None:
                continue
            max_ops, how = t["factor"] * ref["ops"], f"{t['factor']:g} x {t['ops_vs'][0]} {t['ops_vs'][1]}"
        else:
            max_ops, how = t["ops"], None
        syncs = r["syncs"] + r["dynamic_shape"]
        out[f"{model}/{optimizer}"] = {"max_ops": max_ops, "ops_bound": how, "max_syncs": t["syncs"],
                                       "ops": r["ops"], "syncs": syncs,
                                       "met": r["ops"] <= max_ops and syncs <= t["syncs"]}
    return out


def width_check(args, results: dict) -> dict | None:
    """The first preset again at ``--check-width`` and twice the vocabulary: the counts must not move."""
    if not args.check_width:
        return None
    model = args.presets[0]
    other = {}
    for name in args.optimizers:
        other[name] = count_step(model, name, args.check_width, 2 * args.vocab_size, args)
        print(f"  width check {model} {name} at hidden {args.check_width}: {other[name]['ops']} ops, "
              f"{other[name]['syncs']} syncs", flush=True)
    diffs = {}
    for n in args.optimizers:
        a, b = results[model][n], other[n]
        d = {k: [a[k], b[k]] for k in ("ops", "syncs", "dynamic_shape") if a[k] != b[k]}
        ops = {op: [a["by_op"].get(op, 0), b["by_op"].get(op, 0)] for op in sorted({*a["by_op"], *b["by_op"]})
               if a["by_op"].get(op, 0) != b["by_op"].get(op, 0)}
        diffs[n] = {**d, "by_op": ops} if ops else d
    return {"model": model, "hidden_sizes": [args.hidden_size, args.check_width],
            "vocab_sizes": [args.vocab_size, 2 * args.vocab_size],
            "same": not any(diffs.values()), "differences": {n: d for n, d in diffs.items() if d}}


# ----------------------------------------------------------------------------- run

def run(args) -> dict:
    import torch

    from megatron_md.training.build import setup_parallel

    t_start = time.perf_counter()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    results: dict[str, dict] = {}
    try:
        cfg0 = model_config(args.presets[0], args.optimizers[0], args.hidden_size, args.vocab_size, args)
        with single_process_world(cfg0):
            for model in args.presets:
                results[model] = {}
                for name in args.optimizers:
                    t0 = time.perf_counter()
                    r = results[model][name] = count_step(model, name, args.hidden_size, args.vocab_size, args)
                    print(f"{model:>13} {name:>14}: {r['ops']:6,} ops, {r['syncs']:4} syncs, "
                          f"{r['dynamic_shape']} dynamic-shape ({r['matrices']} matrices; "
                          f"{time.perf_counter() - t0:.1f}s)", flush=True)
                    for line in r["cpu_only_paths"]:
                        print(f"  warning: {line}", flush=True)
            widths = width_check(args, results)
        if widths is not None and not widths["same"]:
            print(f"warning: counts moved with the width: {widths['differences']}", flush=True)
        return {
            "benchmark": "step_counts",
            "schema": 1,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(args.threads),
            "settings": {
                "models": {m: {**MODELS[m], "recipe": None if args.no_recipe else MODELS[m]["recipe"],
                               "approximation": APPROXIMATION.get(m)} for m in args.presets},
                "optimizers": list(args.optimizers),
                "optimizer_flags": {o: OPTIMIZER_FLAGS[o] for o in args.optimizers if o in OPTIMIZER_FLAGS},
                "hidden_size": args.hidden_size, "vocab_size": args.vocab_size,
                "precision": ("fp32 parameters, megatron's plain optimizer" if args.fp32 else
                              "bf16 parameters, fp32 master weights, --use-distributed-optimizer"),
                "world_size": 1, "runtime": "cpu (gloo)", "warmup": args.warmup, "seed": args.seed,
                "device_path": args.device_path,
                "counted": f"step {args.warmup + 1}: optimizer.step() and the LR scheduler's step",
                "rule": OpCounter.__doc__.split("\n\n")[1].replace("\n    ", " ").strip(),
            },
            "results": results,
            "targets": judge(results),
            "width_check": widths,
            "wall_s": time.perf_counter() - t_start,
        }
    finally:
        torch.set_num_threads(prev_threads)


APPROXIMATION = {
    "moe-6.7b-ep8": "one EP8 rank's experts (64/8 = 8) on a single process; the router has 8 rows, not 64; "
                    "all dense matrices, embedding and LM head are counted although at DP8 the layer-wise "
                    "optimizer gives a rank about 1/8 of them, and DP/EP collectives of world 8 are absent",
}


def write_results(result: dict, out: Path) -> tuple[Path, Path]:
    return optimizer_step.write_results(result, out, table="step_counts_markdown")


def main(argv=None) -> int:
    args = parse_args(argv)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(k, None)
    result = run(args)
    out, md = write_results(result, Path(args.out))
    print()
    print(md.read_text())
    print(f"wrote {out} and {md} ({result['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
