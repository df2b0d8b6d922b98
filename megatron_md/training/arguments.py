"""The `train` command line shared by the CLI, the LR sweep and the benchmarks: its parser, and the
quieting of megatron-core's import-time chatter. A home of its own so that ``cli.py`` and ``sweep/``
both import it instead of each other."""

from __future__ import annotations

import argparse
import logging
import os
import warnings

from megatron_md.training import config as C


def train_parser() -> argparse.ArgumentParser:
    """``megatron-md train``'s parser: ``--config``, ``--model`` and every typed config field's flag."""
    p = argparse.ArgumentParser(
        prog="megatron-md train",
        description="Train a megatron-core GPT/MoE model. Flags use Megatron-LM names.",
    )
    p.add_argument("--config", help="YAML file of settings (sections or flat flag names).")
    p.add_argument("--model", help="Preset name (see `megatron-md params`).")
    C.add_arguments(p)
    return p


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
