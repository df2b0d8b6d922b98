"""``megatron-md convert``: checkpoints to and from Hugging Face (``tools/convert_checkpoint.py`` is an alias), and
from Megatron-LM.

    megatron-md convert export --load RUN_CKPT_DIR [--iteration N] --output HF_DIR [--verify]
    megatron-md convert import --hf HF_DIR --output CKPT_DIR [--config RUN.yaml]
    megatron-md convert megatron-lm --load MLM_CKPT_DIR --output CKPT_DIR

Export reads a checkpoint saved at any TP/PP/EP layout in one CPU process; import takes the Hugging Face
families of convert/README.md (dense and MoE). Errors are one line and exit 2; a ``--verify`` above
``--tolerance`` exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings


def _quiet() -> None:
    for cat in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=cat)
    for name in ("megatron.core", "torch.utils.cpp_extension", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def parser(prog: str = "megatron-md convert") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Convert checkpoints to and from Hugging Face, and from Megatron-LM (see megatron_md/convert/README.md).", allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="our checkpoint -> Hugging Face directory", allow_abbrev=False)
    e.add_argument("--load", required=True, help="Checkpoint root (holds latest_checkpointed_iteration.txt).")
    e.add_argument("--iteration", type=int, help="Which iter_ to export (default: the latest).")
    e.add_argument("--output", required=True, help="HF directory to write (empty or new).")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="Tensor dtype written (default: the run's, bfloat16 for --bf16 runs, else float32).")
    e.add_argument("--max-shard-size", default="5GB", help="Largest safetensors shard, e.g. 5GB, 500MB.")
    e.add_argument("--verify", action="store_true",
                   help="Load the result with transformers and compare its logits with ours on sample tokens.")
    e.add_argument("--tolerance", type=float, default=1e-4,
                   help="--verify fails above this max|a-b|/max|b| of the logits.")
    e.add_argument("--dump-logits", help="--verify: also save our tokens and logits (torch.save) here.")
    e.add_argument("--no-verify-checkpoint", action="store_true",
                   help="Read the checkpoint without checking its files against its checksums.json.")
    i = sub.add_parser("import", help="Hugging Face directory (Qwen3, Llama, Qwen3-MoE, Mixtral) -> our checkpoint",
                       allow_abbrev=False)
    i.add_argument("--hf", required=True, help="HF directory (config.json + safetensors).")
    i.add_argument("--output", required=True, help="Checkpoint root to write (empty or new).")
    i.add_argument("--config", help="YAML of training settings for run_config.yaml (model comes from config.json).")
    m = sub.add_parser("megatron-lm", help="Megatron-LM torch_dist checkpoint -> our checkpoint with a run_config.yaml "
                       "from its saved args", allow_abbrev=False)
    m.add_argument("--load", required=True, help="Megatron-LM checkpoint root (holds latest_checkpointed_iteration.txt).")
    m.add_argument("--output", required=True, help="Checkpoint root to write (empty or new).")
    return p


def main(argv: list[str] | None = None, prog: str = "megatron-md convert") -> int:
    args = parser(prog).parse_args(argv)
    _quiet()
    from megatron_md.convert.mappings import ConversionError

    try:
        if args.cmd == "export":
            from megatron_md.convert.hf_export import export_checkpoint

            report = export_checkpoint(
                args.load, args.output, iteration=args.iteration, dtype=args.dtype,
                max_shard_size=args.max_shard_size, verify=args.verify or bool(args.dump_logits),
                dump_logits=args.dump_logits, check_integrity=not args.no_verify_checkpoint,
            )
        elif args.cmd == "megatron-lm":
            from megatron_md.convert.megatron_lm import convert

            report = convert(args.load, args.output, log=lambda line: print(line, file=sys.stderr))
        else:
            from megatron_md.convert.hf_import import import_checkpoint

            report = import_checkpoint(args.hf, args.output, config=args.config)
    except (ConversionError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"{prog} {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    err = report.get("max_rel_error")
    if err is not None and not err <= args.tolerance:
        print(f"{prog} export: logits differ: {err:.3e} > --tolerance {args.tolerance}", file=sys.stderr)
        return 1
    return 0
