"""``megatron-md`` command line: train, params, plan, score, generate, eval, convert, lr-sweep, demo,
recipes.

Importing this module imports no torch: checkpoint saving starts a spawn-mode helper process that imports the
launching script's module again (this one, under ``python -m megatron_md.cli``), and a light import keeps that, and
``--help``, fast. Commands import what they need when they run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The config classes are imported by the commands, after --plugin modules were loaded: a plugin's base may bring
# a config section of its own, which must be registered before those classes are built.


def under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def relaunch(nproc: int, argv: list[str]) -> int:
    """Re-run this command under torch's elastic launcher with ``nproc`` local processes.

    ``--standalone``: the launcher's rendezvous store binds port 0 and hands its port to the workers, so two runs
    started on one node at the same moment cannot pick the same port (a port probed free, then bound later, can).

    SIGTERM/SIGUSR1/SIGINT sent to this process go to the launcher, which forwards them to the workers
    (SIGUSR1 too, where this torch's launcher can: ``--signals-to-handle``); the workers then save and exit.
    """
    from torch.distributed.run import get_args_parser

    from megatron_md.training.checkpoints.preemption import PREEMPT_MARKER_ENV

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
    if "--signals-to-handle" in get_args_parser()._option_string_actions:
        cmd += ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout", "600"]
    cmd += ["-m", "megatron_md.cli", *argv]
    marker = Path(tempfile.mkdtemp(prefix="megatron-md-")) / "preempted"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env[PREEMPT_MARKER_ENV] = str(marker)
    child = subprocess.Popen(cmd, env=env)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        rc = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # torch's launcher exits non-zero after forwarding a signal even when every worker saved and exited
    # 0; the workers' marker says whether they did.
    if received and marker.exists():
        print(f"megatron-md train: {marker.read_text().strip()}", file=sys.stderr)
        rc = 0
    shutil.rmtree(marker.parent, ignore_errors=True)
    return rc


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        out.append(a)
    return out


def cmd_train(argv: list[str]) -> int:
    from megatron_md.training import config as C
    from megatron_md.training import megatron_compat
    from megatron_md.training.arguments import parse_train_args, quiet_megatron

    quiet_megatron()
    args, accepted = parse_train_args(argv)
    yaml_path = args.pop("config", None)
    try:
        sources: dict = {}
        cfg = C.resolve(None, yaml_path, args, sources=sources)
        notes = [*accepted.values(), *megatron_compat.normalise(
            cfg, {k for k, where in sources.items() if where.startswith(("command line", "--config"))}, accepted)]
        from megatron_md.training.validate import ConfigError, validate_config

        nproc = cfg.training.nproc_per_node
        world = int(os.environ.get("WORLD_SIZE", nproc))
        validate_config(cfg, world)
        from megatron_md.training.checkpoints.resume_check import check_checkpoint_fits

        check_checkpoint_fits(cfg)  # a checkpoint of another model is refused here, by flag
        if not cfg.data.mock_data:
            from megatron_md.training.data.datasets import validate_data

            d = cfg.data
            splits = [(d.data_path, d.split)] if d.data_path else [(p, "1,0,0") for p in (
                d.train_data_path, d.valid_data_path, d.test_data_path) if p]
            for path, split in splits:
                validate_data(path, split, cfg.model.seq_length, d.tokenizer_model, False)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-md train: error: {e}", file=sys.stderr)
        return 2
    if nproc > 1 and not under_launcher():
        return relaunch(nproc, ["train", *_strip_nproc(argv)])
    if int(os.environ.get("RANK", "0")) == 0:
        for line in [*notes, *C.describe_sources(sources)]:
            print(f"megatron-md train: {line}", file=sys.stderr)
    from megatron_md.training.checkpoints.checkpointing import CheckpointMismatch
    from megatron_md.training.checkpoints.integrity import CheckpointCorrupted
    from megatron_md.training.trainer import TrainingStopped, run

    try:
        run(cfg)
    except TrainingStopped as e:
        print(f"megatron-md train: {e}", file=sys.stderr)
        return 3
    except (ConfigError, CheckpointCorrupted, CheckpointMismatch) as e:
        print(f"megatron-md train: error: {e}", file=sys.stderr)
        return 2
    finally:
        from megatron_md.runtime.distributed import destroy_distributed

        destroy_distributed()
    return 0


def cmd_params(argv: list[str]) -> int:
    from megatron_md.training import config as C

    p = argparse.ArgumentParser(prog="megatron-md params", description="Parameter counts of presets.")
    p.add_argument("--model", help="One preset (default: all).")
    p.add_argument("--hidden-size", type=int, help="Rescale the preset's width.")
    a = p.parse_args(argv)
    from megatron_md.models.presets import count_parameters, human, preset_names

    names = [a.model] if a.model else preset_names()
    rows = []
    for name in names:
        cli = {"hidden_size": a.hidden_size} if a.hidden_size else {}
        try:
            cfg = C.resolve(name, None, cli)
        except ValueError as e:
            print(f"megatron-md params: error: {e}", file=sys.stderr)
            return 2
        m = cfg.model
        n = count_parameters(m)
        shape = f"L{m.num_layers} h{m.hidden_size} heads{m.num_attention_heads}/{m.num_query_groups}"
        shape += f" E{m.num_experts}top{m.moe_router_topk}" if m.num_experts else f" ffn{m.ffn_hidden_size}"
        rows.append((name, human(n.total), human(n.active), human(n.embedding), shape))
    header = ("preset", "total", "active", "embedding", "shape")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(5)]
    for r in [header] + rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


def _plan_device_argv(argv: list[str]) -> list[str]:
    """``plan --device H100-80GB``: a device name (anything but train's auto/cuda/cpu) is the target device."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--device" and i + 1 < len(argv) and argv[i + 1].lower() not in ("auto", "cuda", "cpu"):
            out += ["--target-device", argv[i + 1]]
            i += 2
            continue
        if a.startswith("--device=") and a.split("=", 1)[1].lower() not in ("auto", "cuda", "cpu"):
            a = "--target-device=" + a.split("=", 1)[1]
        out.append(a)
        i += 1
    return out


def cmd_plan(argv: list[str]) -> int:
    """Per-device memory, FLOPs and communication of a run, from its config (``train``'s flags)."""
    from megatron_md.training import config as C
    from megatron_md.training.arguments import quiet_megatron, train_parser

    quiet_megatron()
    from megatron_md.training.planning.report import (DEFAULT_HEADROOM, DEVICES, format_plan, make_plan,
                                                  parse_headroom, resolve_target)

    p = train_parser()
    p.prog, p.description = "megatron-md plan", (
        "Plan a run without launching it: per-device bytes of parameters, gradients, master weights, "
        "optimizer state and activations (per recomputation mode, for the attention kernel the run will use), "
        "FLOPs and communication per step, and whether it fits the target device with --headroom to spare. "
        "Takes train's flags (--model, layout, optimizer) or --config; a recipe's target section gives the "
        "device and the world size.")
    g = p.add_argument_group("plan")
    g.add_argument("--world-size", "--num-gpus", dest="target_world_size", type=int, default=argparse.SUPPRESS,
                   metavar="N",
                   help="Devices in the job (default: --nodes x --gpus-per-node, else the config's "
                        "target_world_size, else --nproc-per-node).")
    g.add_argument("--nodes", type=int, default=1, help="Nodes (with --gpus-per-node).")
    g.add_argument("--gpus-per-node", type=int, help="Devices per node.")
    g.add_argument("--device-memory", dest="target_device_memory", default=argparse.SUPPRESS, metavar="SIZE",
                   help="Memory of one device, with a unit: 79GiB, 81082MiB (MiB as nvidia-smi and torch print "
                        "them) or 80GB (10^9 bytes); a bare number is refused. Beats the memory of --device NAME.")
    g.add_argument("--headroom", default=f"{DEFAULT_HEADROOM:.0%}",
                   help="Share of device memory a fitting plan leaves spare for what it does not count (CUDA "
                        "context, NCCL buffers, fragmentation, the optimizer step's temporaries): 5%% or 0.05 "
                        f"[default: {DEFAULT_HEADROOM:.0%}%].")
    g.add_argument("--list-devices", action="store_true",
                   help="List the device names --device takes (besides auto/cuda/cpu) and their memory.")
    g.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    p.epilog = ("--device NAME (e.g. H100-80GB, H200, A100-40GB; case-insensitive) is the target device, the "
                "same as --target-device; --device auto/cuda/cpu keeps train's meaning.")
    args = vars(p.parse_args(_plan_device_argv(argv)))
    plan_args = {k: args.pop(k, None) for k in ("nodes", "gpus_per_node", "headroom", "list_devices", "json")}
    if plan_args["list_devices"]:
        for d in DEVICES:
            also = f"  (also {', '.join(d.aliases)})" if d.aliases else ""
            print(f"{d.name:16s} {d.mib:>8,} MiB  {'CUDA' if d.source == 'cuda' else 'nvidia-smi'}: {d.note}{also}")
        print(f"{'cpu':16s} {'':>12s}  host memory per rank: give it with --device-memory")
        return 0
    yaml_path = args.pop("config", None)
    if plan_args["gpus_per_node"] and "target_world_size" not in args:
        args["target_world_size"] = plan_args["nodes"] * plan_args["gpus_per_node"]
    memory_from_cli, device_from_cli = "target_device_memory" in args, "target_device" in args

    try:
        cfg = C.resolve(None, yaml_path, args)
        world = cfg.target.target_world_size or cfg.training.nproc_per_node
        if world < 1:
            raise ValueError(f"--world-size {world}: must be at least 1")
        target = resolve_target(cfg.target.target_device, cfg.target.target_device_memory,
                                "--device-memory" if memory_from_cli else "target_device_memory (--config)",
                                "--device" if device_from_cli else "target_device (--config)")
        headroom = parse_headroom(plan_args["headroom"])
        from megatron_md.training.planning.memory import layout_of
        from megatron_md.training.validate import validate_config

        layout_of(cfg, world)  # the layout's own errors name --world-size, not --nproc-per-node
        # A plan reads no data and writes nothing: validate model, layout and optimizer only.
        checked = dataclasses.replace(cfg, data=C.DataConfig(mock_data=True), checkpoint=C.CheckpointConfig())
        validate_config(checked, world)
        plan = make_plan(cfg, world, target, headroom)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-md plan: error: {e}", file=sys.stderr)
        return 2
    if plan_args["json"]:
        import json

        print(json.dumps(plan, indent=2))
    else:
        print(format_plan(plan))
    return 0


def _inference_flags(p: argparse.ArgumentParser) -> None:
    """The flags score, generate and eval share: where the model runs, and the checkpoint's checksum check."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--no-verify-checkpoint", action="store_true",
                   help="Load without checking the files against the checkpoint's checksums.json.")


def cmd_score(argv: list[str]) -> int:
    from megatron_md.training.arguments import quiet_megatron

    quiet_megatron()
    p = argparse.ArgumentParser(
        prog="megatron-md score", description="Mean token loss of text under a checkpoint."
    )
    p.add_argument("--load", required=True, help="Checkpoint directory (with latest_checkpointed_iteration.txt).")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", help="Text to score.")
    g.add_argument("--text-file", help="File whose text to score.")
    g.add_argument(
        "--validation", action="store_true",
        help="Score the run's validation batches (reproduces the trainer's final eval loss).",
    )
    _inference_flags(p)
    a = p.parse_args(argv)
    from megatron_md.training.evaluation.score import score_main

    try:
        return score_main(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-md score: error: {e}", file=sys.stderr)
        return 2


def cmd_generate(argv: list[str]) -> int:
    from megatron_md.training.arguments import quiet_megatron

    quiet_megatron()
    p = argparse.ArgumentParser(prog="megatron-md generate", description="Continue a prompt under a checkpoint.")
    p.add_argument("--load", required=True, help="Checkpoint directory (with latest_checkpointed_iteration.txt).")
    p.add_argument("--prompt", required=True, help="Text to continue.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample.")
    p.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely tokens (0: all).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (1: off).")
    p.add_argument("--seed", type=int, default=1234, help="Sampling seed.")
    p.add_argument("--ignore-eos", action="store_true", help="Keep going past the end-of-document token.")
    p.add_argument("--ids", action="store_true", help="Print the new token ids instead of text.")
    _inference_flags(p)
    a = p.parse_args(argv)
    from megatron_md.training.evaluation.generate import generate_main

    try:
        return generate_main(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-md generate: error: {e}", file=sys.stderr)
        return 2


def cmd_eval(argv: list[str]) -> int:
    from megatron_md.training.arguments import quiet_megatron

    quiet_megatron()
    p = argparse.ArgumentParser(
        prog="megatron-md eval",
        description="lm-evaluation-harness tasks on a checkpoint, in this process (needs the eval extra: "
                    "pip install 'megatron-md[eval]').",
        epilog="Results: lm-eval's results as JSON in RUN_DIR/eval/lm_eval_iter_<iteration>.json (or --output) "
               "and one record per task metric appended to RUN_DIR/metrics.jsonl.")
    p.add_argument("--load", required=True, help="Checkpoint directory (with latest_checkpointed_iteration.txt).")
    p.add_argument("--tasks", required=True, help="Comma-separated lm-eval task names (globs such as arc_* too).")
    p.add_argument("--include-path", metavar="DIR", help="Directory of custom task YAMLs.")
    p.add_argument("--num-fewshot", type=int, help="Few-shot examples per prompt (default: each task's own).")
    p.add_argument("--limit", help="Examples per task: a count, or a fraction below 1 (default: all).")
    p.add_argument("--batch-size", type=int, default=8, help="Log-likelihood requests per forward pass.")
    p.add_argument("--run-dir", help="Where eval/ and metrics.jsonl go (default: the checkpoint's run directory, "
                                     "when it exists here).")
    p.add_argument("--output", metavar="FILE", help="The results JSON (default RUN_DIR/eval/lm_eval_iter_N.json).")
    p.add_argument("--log-samples", action="store_true",
                   help="Also write every request and the model's answers beside the results "
                        "(<output stem>_samples_<task>.jsonl).")
    p.add_argument("--seed", type=int, default=1234, help="Seed of lm-eval's few-shot sampling and RNGs.")
    _inference_flags(p)
    a = p.parse_args(argv)
    try:
        from megatron_md.training.evaluation.lm_eval import eval_main

        return eval_main(a)
    except (ImportError, ValueError, FileNotFoundError) as e:
        if isinstance(e, ImportError) and "megatron-md[eval]" not in str(e):
            raise  # only the missing extra is the user's to fix
        print(f"megatron-md eval: error: {e}", file=sys.stderr)
        return 2


def cmd_demo(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="megatron-md demo", description="Train tiny-moe with EP=2 on 2 CPU ranks.",
        epilog="Other options go to `megatron-md train` (e.g. --train-iters 2 for a quick check of an install; "
               "the loss verdict then needs two logged steps, and is skipped with fewer).")
    p.add_argument("--work-dir", default="runs/demo", help="Where data, checkpoint and run go.")
    p.add_argument("--config", default=None, help="Demo config (default examples/tiny_moe_cpu_demo.yaml).")
    a, rest = p.parse_known_args(argv)
    from megatron_md.training.config import EXAMPLES_DIR
    from megatron_md.training.data.datasets import prepare_demo_data

    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"[demo] preparing the embedded corpus and its tokenizer in {work / 'data'}", flush=True)
    prefix, tok = prepare_demo_data(work / "data")
    cfg_path = a.config or str(EXAMPLES_DIR / "tiny_moe_cpu_demo.yaml")
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = work / f"run-{stamp}"
    save = work / f"checkpoints-{stamp}"
    args = [
        "--config", cfg_path, "--data-path", prefix, "--tokenizer-model", tok,
        "--run-dir", str(run_dir), "--save", str(save), *rest,
    ]
    print(f"[demo] megatron-md train {' '.join(args)}", flush=True)
    rc = cmd_train(args)
    if rc == 0:
        import json

        recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        train = [r["lm_loss"] for r in recs if r.get("lm_loss") is not None]
        evals = [r["eval_lm_loss"] for r in recs if "eval_lm_loss" in r]
        val = f" (validation {evals[-1]:.3f})" if evals else ""
        if len(train) >= 2:  # the verdict compares the first and the last logged step
            verdict = "falls" if train[-1] < train[0] else "DID NOT FALL"
            print(f"[demo] lm loss {verdict}: {train[0]:.3f} -> {train[-1]:.3f}{val}")
            if train[-1] >= train[0]:
                rc = 1
        else:  # a short run (e.g. --train-iters 2 to check an install): nothing to compare
            last = f"{train[-1]:.3f}" if train else "not logged"
            print(f"[demo] lm loss {last}{val}; {len(train)} logged step(s), too few to judge whether it falls")
        print(f"[demo] run directory: {run_dir.resolve()}")
        print(f"[demo] metrics:       {(run_dir / 'metrics.jsonl').resolve()}")
        print(f"[demo] checkpoint:    {save.resolve()}")
        print(f"[demo] try: megatron-md score --load {save} --text 'The for statement in Python'")
    return rc


def cmd_convert(argv: list[str]) -> int:
    from megatron_md.convert.command import main as convert_main

    return convert_main(argv)


def cmd_lr_sweep(argv: list[str]) -> int:
    from megatron_md.sweep import main as sweep_main

    return sweep_main(argv)


def cmd_recipes(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="megatron-md recipes",
        description="List the recipes shipped with the package (usable as --config examples/NAME from any "
                    "directory), or copy them out to edit.")
    p.add_argument("--copy", metavar="DIR", help="Copy every shipped recipe into DIR (existing files are kept).")
    a = p.parse_args(argv)
    from megatron_md.training.config import EXAMPLES_DIR

    recipes = sorted(EXAMPLES_DIR.rglob("*.yaml"))
    if a.copy:
        out = Path(a.copy)
        kept = 0
        for r in recipes:
            dst = out / r.relative_to(EXAMPLES_DIR)
            if dst.exists():
                kept += 1
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(r, dst)
        print(f"copied {len(recipes) - kept} recipes into {out}" + (f" ({kept} already there, kept)" if kept else ""))
        return 0
    for r in recipes:
        first = next((ln.lstrip("# ").strip() for ln in r.read_text().splitlines() if ln.startswith("#")), "")
        print(f"examples/{r.relative_to(EXAMPLES_DIR).as_posix():48s} {first}")
    return 0


COMMANDS = {"train": cmd_train, "params": cmd_params, "plan": cmd_plan, "score": cmd_score,
            "generate": cmd_generate, "eval": cmd_eval, "convert": cmd_convert, "demo": cmd_demo,
            "lr-sweep": cmd_lr_sweep, "recipes": cmd_recipes}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--plugin" or a.startswith("--plugin=") or a == "--config" or a.startswith("--config=") for a in argv):
        from megatron_md.plugins import PluginError, load_plugins, plugin_names

        try:  # before any flag is read: what they register is an --optimizer choice everywhere
            load_plugins(plugin_names(argv))
        except PluginError as e:
            print(f"megatron-md: error: {e}", file=sys.stderr)
            return 2
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: megatron-md {train,params,plan,score,generate,eval,convert,lr-sweep,demo,recipes} "
              "[options]   (megatron-md CMD --help)")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
