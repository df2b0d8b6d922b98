"""The `train` command line shared by the CLI, the LR sweep and the benchmarks: its parser, and the
quieting of megatron-core's import-time chatter. A home of its own so that ``cli.py`` and ``sweep/``
both import it instead of each other."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from megatron_md.training import config as C


def train_parser() -> argparse.ArgumentParser:
    """``megatron-md train``'s parser: ``--config``, ``--model`` and every typed config field's flag."""
    p = argparse.ArgumentParser(
        prog="megatron-md train",
        description="Train a megatron-core GPT/MoE model. Flags use Megatron-LM names.",
        allow_abbrev=False,  # as Megatron-LM: a prefix of one of our flags must not stand for it
    )
    p.add_argument("--config", help="YAML file of settings (sections or flat flag names).")
    p.add_argument("--model", help="Preset name (see `megatron-md params`).")
    C.add_arguments(p)
    return p


def parse_train_args(argv: list[str]) -> tuple[dict, dict[str, str]]:
    """``megatron-md train``'s settings as typed, and {accepted Megatron-LM flag: note}. A Megatron-LM flag we do
    not implement exits (argparse's exit 2) with one line naming every such flag; an unknown one as argparse does."""
    from megatron_md.training import megatron_compat

    p = train_parser()
    ns, unknown = p.parse_known_args(argv)
    accepted, refused, foreign = megatron_compat.screen(unknown)
    if foreign:
        p.error(f"unrecognized arguments: {' '.join(foreign)}")
    if refused:  # one line, no usage dump: the flags and the way out are the message
        print(f"{p.prog}: error: Megatron-LM flags not implemented here: " + "; ".join(refused)
              + " (docs/usage.md, 'Megatron-LM compatibility', lists what is)", file=sys.stderr)
        raise SystemExit(2)
    return vars(ns), accepted


def quiet_megatron() -> None:
    """Hide megatron-core's import-time chatter (deprecations, missing-Apex fallbacks)."""
    for cat in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=cat, module=r"megatron\.")
        warnings.filterwarnings("ignore", category=cat, module=r"torch\.")
    warnings.filterwarnings("ignore", message="Please use DTensor instead")
    for name in ("megatron.core.models.gpt.gpt_model", "megatron.core.datasets",
                 "megatron.core.dist_checkpointing.strategies.torch", "torch.utils.cpp_extension"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("WANDB_SILENT", "true")
