"""The run directory and everything written to it: config, versions, host, log, metrics.

Only the logging rank (last pipeline stage, first TP/DP rank) writes; the others stay quiet.
``metrics.jsonl`` holds one JSON object per log interval (and one per evaluation); other tools
and the tests read it.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import socket
import sys
import time
from pathlib import Path

import torch

VERSIONED = ["torch", "megatron-core", "emerging-optimizers", "transformer-engine", "sentencepiece", "numpy", "wandb"]


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    import megatron_md

    out["megatron-md"] = megatron_md.__version__
    out["python"] = sys.version.split()[0]
    return out


def host_info(runtime_desc: str, world_size: int) -> dict:
    info = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "runtime": runtime_desc,
        "world_size": world_size,
        "argv": sys.argv,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def fmt_log_line(rec: dict, train_iters: int) -> str:
    parts = [
        f"iteration {rec['iteration']:8d}/{train_iters:8d}",
        f"consumed samples: {rec['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {rec['iter_time_ms']:.1f}",
        f"throughput (tokens/s): {rec['tokens_per_s']:.0f}",
    ]
    if rec.get("tflops_per_device") is not None:
        parts.append(f"TFLOP/s per device: {rec['tflops_per_device']:.3g}")
    if rec.get("mfu") is not None:
        parts.append(f"MFU: {100 * rec['mfu']:.3g}%")
    if rec.get("optimizer_ms") is not None:
        parts.append(f"optimizer (ms): {rec['optimizer_ms']:.1f}")
    if rec.get("peak_memory_gib") is not None:
        parts.append(f"peak memory (GiB): {rec['peak_memory_gib']:.2f}")
    parts += [
        f"learning rate: {rec['lr']:.6E}",
        f"global batch size: {rec['global_batch_size']:5d}",
        f"lm loss: {rec['lm_loss']:.6E}" if rec["lm_loss"] is not None else "lm loss: n/a",
    ]
    for key, label in (("moe_load_balancing_loss", "load balancing loss"),
                       ("moe_seq_load_balancing_loss", "seq load balancing loss"), ("moe_z_loss", "z loss")):
        if rec.get(key) is not None:
            parts.append(f"{label}: {rec[key]:.6E}")
    if rec.get("moe_expert_load_max") is not None:
        parts.append(f"expert load max/min vs mean: {rec['moe_expert_load_max']:.2f}/{rec['moe_expert_load_min']:.2f}")
    if rec.get("max_logit") is not None:
        parts.append(f"max logit: {rec['max_logit']:.4g}")
    if rec.get("qk_clip_layers") is not None:
        parts.append(f"qk-clipped layer-steps: {rec['qk_clip_layers']}")
    parts += [
        f"grad norm: {rec['grad_norm']:.3f}" if rec["grad_norm"] is not None else "grad norm: n/a",
        f"number of skipped iterations: {rec['skipped']:3d}",
        f"number of nan iterations: {rec['nan']:3d}",
    ]
    return " " + " | ".join(parts) + " |"


WANDB_ID_FILE = "wandb_run_id.txt"
WANDB_MODE_ALIASES = {"dryrun": "offline", "run": "online"}  # W&B's older names


def wandb_settings(lg, run_dir: Path, env=None) -> dict:
    """``wandb.init`` arguments: each flag when given, else W&B's own environment variable, else ours.

    - mode: ``--wandb-mode``, else ``WANDB_MODE`` (``WANDB_DISABLED=true``: disabled), else online when there is a
      project (``--wandb-project`` or ``WANDB_PROJECT``), else offline;
    - project: ``--wandb-project``, else ``WANDB_PROJECT``, else ``megatron_md``;
    - name: ``--wandb-exp-name``, else ``WANDB_NAME``, else the run directory's name;
    - dir: ``--wandb-save-dir``, else ``WANDB_DIR``, else the run directory.

    Settings without a flag (``WANDB_ENTITY``, ``WANDB_RUN_GROUP``, ``WANDB_TAGS``, ``WANDB_NOTES``, ``WANDB_RUN_ID``,
    ``WANDB_API_KEY``, ...) are not passed, so W&B reads them itself.
    """
    env = os.environ if env is None else env
    project = lg.wandb_project or env.get("WANDB_PROJECT") or None
    mode = lg.wandb_mode or env.get("WANDB_MODE") or None
    if mode is None and env.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        mode = "disabled"
    mode = mode or ("online" if project else "offline")
    return {
        "mode": WANDB_MODE_ALIASES.get(mode, mode),
        "project": project or "megatron_md",
        "name": lg.wandb_exp_name or env.get("WANDB_NAME") or Path(run_dir).name,
        "dir": lg.wandb_save_dir or env.get("WANDB_DIR") or str(run_dir),
    }


class RunLogger:
    """Writes the run directory on the logging rank; a no-op elsewhere."""

    def __init__(self, run_dir: Path, cfg, *, active: bool, resumed: bool, runtime_desc: str, world_size: int):
        self.active = active
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.tb = None
        self.wandb = None
        self.bar = None
        if not active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        (self.run_dir / "versions.json").write_text(json.dumps(package_versions(), indent=2))
        (self.run_dir / "host.json").write_text(json.dumps(host_info(runtime_desc, world_size), indent=2))
        self.log_file = open(self.run_dir / "train.log", "a", buffering=1)
        self.metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        lg = cfg.logging
        tb_dir = lg.tensorboard_dir or str(self.run_dir / "tensorboard")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tb_dir)
        except Exception as e:  # tensorboard is a soft dependency of the log, not of training
            self.print(f"[warn] tensorboard disabled: {e}")
        w = wandb_settings(lg, self.run_dir)
        if w["mode"] != "disabled":
            try:
                import wandb

                id_file = self.run_dir / WANDB_ID_FILE
                if resumed and "WANDB_RUN_ID" not in os.environ and id_file.exists():
                    w["id"] = id_file.read_text().strip()  # a resumed run (a requeued job) continues its W&B run
                Path(w["dir"]).mkdir(parents=True, exist_ok=True)
                self.wandb = wandb.init(**w, config=cfg.to_dict(), resume="allow" if resumed else None)
                id_file.write_text(self.wandb.id + "\n")
                self.print(f"W&B {w['mode']} run {self.wandb.id} ({w['project']}/{w['name']}): {self.wandb.dir}")
            except Exception as e:
                self.print(f"[warn] wandb disabled: {e}")
        show_bar = lg.progress_bar if lg.progress_bar is not None else sys.stderr.isatty()
        if show_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.training.train_iters, desc="train", unit="it", dynamic_ncols=True)

    def print(self, msg: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)
        self.log_file.write(msg + "\n")

    def progress(self, iteration: int) -> None:
        if self.bar is not None:
            self.bar.n = iteration
            self.bar.refresh()

    def log_train(self, rec: dict) -> None:
        if not self.active:
            return
        self.print(fmt_log_line(rec, self.cfg.training.train_iters))
        self._write(rec, prefix="train")

    def log_eval(self, rec: dict) -> None:
        if not self.active:
            return
        loss = rec["eval_lm_loss"]
        ppl = math.exp(min(loss, 50.0))
        rec = dict(rec, eval_ppl=ppl)
        self.print(
            f" validation loss at iteration {rec['iteration']} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {ppl:.6E} |"
        )
        self._write(rec, prefix="valid")

    def _write(self, rec: dict, prefix: str) -> None:
        rec = dict(rec, time=time.time())
        self.metrics.write(json.dumps(rec) + "\n")
        step = rec["iteration"]
        for k, v in rec.items():
            if k in ("iteration", "time") or not isinstance(v, (int, float)) or v is None:
                continue
            if self.tb is not None:
                self.tb.add_scalar(f"{prefix}/{k}", v, step)
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.metrics.close()
        self.log_file.close()
