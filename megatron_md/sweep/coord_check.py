"""Coordinate check: how activations and updates scale with width in the first steps.

For each optimizer at its centre LR and each width, one process builds the model and optimizer with
the trainer's own pieces (``build_wrapped_model``, ``build_optimizer``, world size 1) and trains a
few steps on one fixed batch (the same tokens at every width) at a constant LR, no warmup. Per step
``t`` (0 = init) it records, on a no-grad forward of that batch:

- ``act_rms``: RMS of the output of the embedding, of each transformer layer and of the LM head;
- ``act_delta_rms``: RMS of (that output at step t - at step 0);
- ``rel_update``: ||W_t - W_{t-1}||_F / ||W_{t-1}||_F of the layer's hidden matrices (their RMS over
  the layer; per role in the ``rel_update_<role>`` columns), of the embedding and of the LM head.

A quantity that stays flat across widths is width-invariant; one that grows with width is the
muP-style violation (for MD with ``shape_up`` the relative update is the LR at every width).
"""

from __future__ import annotations

import copy
import gc
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Callable

from megatron_md.sweep.grid import RECIPES, SweepSpec, lr_of_k
from megatron_md.mcore.families import family_of

ROLES = ["attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2"]
COLUMNS = ["optimizer", "width", "lr", "layer", "step", "act_rms", "act_delta_rms", "rel_update",
           *[f"rel_update_{r.replace('.', '_')}" for r in ROLES]]


def _cli(spec: SweepSpec, optimizer: str, width: int, seed: int, steps: int) -> tuple[str | None, dict]:
    """The cell's train flags as a config dict, with a constant LR and no warmup."""
    from megatron_md.training.arguments import train_parser
    from megatron_md.sweep.grid import Cell

    lr = lr_of_k(spec.k_centers.get(optimizer, RECIPES[optimizer].k_center))
    wd = spec.weight_decays[0] if spec.weight_decays else RECIPES[optimizer].weight_decay
    cell = Cell(optimizer, width, lr, seed, 0, wd, steps)
    args = vars(train_parser().parse_args(spec.train_args(cell)))
    args.update(lr_decay_style="constant", lr_warmup_iters=0)
    return args.pop("config", None), args


class _Probe:
    """Forward hooks on the embedding, every transformer layer and the LM head."""

    def __init__(self, gpt):
        self.out: dict = {}
        self.handles = []
        mods = [("embedding", gpt.embedding)]
        mods += [(f"L{i}", layer) for i, layer in enumerate(gpt.decoder.layers)]
        mods += [("output", gpt.output_layer)]
        for name, mod in mods:
            self.handles.append(mod.register_forward_hook(self._hook(name)))
        self.names = [n for n, _ in mods]

    def _hook(self, name):
        def hook(module, args, output):
            t = output[0] if isinstance(output, (tuple, list)) else output
            self.out[name] = t.detach().float().clone()

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _matrices(gpt) -> dict:
    """name -> (layer, role, param) of the hidden matrices, the embedding and the LM head."""
    from megatron_md.training.observability.diagnostics import label

    out = {}
    for name, p in gpt.named_parameters():
        if p.ndim != 2:
            continue
        if name.endswith("word_embeddings.weight"):
            out[name] = ("embedding", "embedding", p)
        elif name.startswith("output_layer."):
            out[name] = ("output", "output", p)
        else:
            lab = label(name)
            if lab and "expert" not in lab and lab.split(".", 1)[1] in ROLES:
                layer, role = lab.split(".", 1)
                out[name] = (layer, role, p)
    return out


def _one(cfg, steps: int, rt, log) -> list[dict]:
    import torch

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_md.training.data.loader import GlobalBatchSampler, loader
    from megatron.core.utils import unwrap_model as unwrap
    from megatron_md.training.data.datasets import build_gpt_datasets
    from megatron_md.training.step import make_forward_step
    from megatron_md.training.build import (build_optimizer, build_wrapped_model, global_batch_size,
                                              make_tokenizer, seed_everything, vocab_size_for)

    t = cfg.training
    seed_everything(t.seed)
    tok = make_tokenizer(cfg)
    vocab = vocab_size_for(cfg, tok)
    model, _ = build_wrapped_model(cfg, vocab, cpu=rt.name == "cpu")
    optimizer, scheduler = build_optimizer(cfg, model)
    family_of(cfg).after_build(optimizer)
    gbs = global_batch_size(cfg)
    train, _, _ = build_gpt_datasets(cfg.data.data_path, cfg.data.split, cfg.model.seq_length, t.seed, tok,
                                     gbs, 1, 0, mock=cfg.data.mock_data, path_to_cache=cfg.data.data_cache_path,
                                     vocab_size=vocab)
    first = GlobalBatchSampler(len(train), 0, lambda _c: gbs, t.micro_batch_size, 0, 1, limit=1)  # global batch 0
    batch = [{k: v.to(rt.device) for k, v in mb.items()} for mb in loader(train, first, 0, pin=False)]  # every step
    gpt = unwrap(model)
    probe = _Probe(gpt)
    mats = _matrices(gpt)
    fb = get_forward_backward_func()
    init: dict = {}
    prev = {n: p.detach().float().clone() for n, (_, _, p) in mats.items()}
    rows = []
    try:
        for step in range(steps + 1):
            if step > 0:
                model.zero_grad_buffer()
                optimizer.zero_grad()
                fb(forward_step_func=make_forward_step(False), data_iterator=iter(batch), model=[model],
                   num_microbatches=len(batch), seq_length=cfg.model.seq_length,
                   micro_batch_size=t.micro_batch_size, forward_only=False)
                ok, _, _ = optimizer.step()
                if not ok:
                    log(f"[coord-check] step {step}: optimizer step skipped (non-finite)")
                scheduler.step(increment=gbs)
            model.eval()
            with torch.no_grad():
                b = batch[0]
                model(b["tokens"], b["position_ids"], None)
            model.train()
            upd = defaultdict(dict)
            for n, (layer, role, p) in mats.items():
                w = p.detach().float()
                if step > 0:
                    upd[layer][role] = ((w - prev[n]).norm() / prev[n].norm().clamp_min(1e-30)).item()
                prev[n] = w.clone()
            for layer in probe.names:
                a = probe.out[layer]
                if step == 0:
                    init[layer] = a
                roles = upd.get(layer, {})
                rel = math.sqrt(sum(v * v for v in roles.values()) / len(roles)) if roles else None
                row = {"layer": layer, "step": step, "act_rms": a.pow(2).mean().sqrt().item(),
                       "act_delta_rms": (a - init[layer]).pow(2).mean().sqrt().item(), "rel_update": rel}
                for r in ROLES:
                    row[f"rel_update_{r.replace('.', '_')}"] = roles.get(r)
                rows.append(row)
    finally:
        probe.remove()
    del model, optimizer, scheduler, gpt, probe, mats, prev
    gc.collect()
    return rows


def run_coord_check(spec: SweepSpec, out: Path, steps: int, log: Callable[[str], None] = print) -> tuple[Path, Path]:
    import torch

    from megatron_md.runtime import cpu
    from megatron_md.runtime.distributed import destroy_distributed
    from megatron_md.training import config as C
    from megatron_md.training.build import setup_parallel

    from megatron_md.sweep.results import write_csv

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seed = spec.seeds[0]
    cfgs = {}
    for opt in spec.optimizers:
        for w in spec.widths:
            yaml_path, cli = _cli(spec, opt, w, seed, steps)
            try:
                cfgs[(opt, w)] = C.resolve(None, yaml_path, cli)
            except ValueError as e:
                raise ValueError(f"--coord-check {opt} width {w}: {e}") from None
    first = next(iter(cfgs.values()))
    if first.parallel.tensor_model_parallel_size * first.parallel.pipeline_model_parallel_size != 1:
        raise ValueError("--coord-check runs in one process: drop the TP/PP flags")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(k, None)
    rows = []
    rt = setup_parallel(copy.deepcopy(first))
    try:
        for (opt, w), cfg in cfgs.items():
            lr = C.setting(cfg, RECIPES[opt].lr_field)
            log(f"[coord-check] {opt} width {w} ({RECIPES[opt].lr_field.replace('_', '-')} {lr:.4g}), {steps} steps")
            for r in _one(cfg, steps, rt, log):
                rows.append({"optimizer": opt, "width": w, "lr": lr, **r})
    finally:
        destroy_distributed()
        if rt.name == "cpu":
            cpu.uninstall()
        torch.set_grad_enabled(True)
    csv_path = write_csv(out / "coord_check.csv", rows, COLUMNS)
    png = plot_coord_check(rows, out / "coord_check.png")
    log(f"[coord-check] wrote {csv_path} and {png}")
    return csv_path, png


def plot_coord_check(rows: list[dict], png: Path) -> Path:
    """Rows: optimizers. Columns: act RMS, act change RMS (last step, per layer) and relative update
    (mean over steps, per role), each against width on log2 axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opts = list(dict.fromkeys(r["optimizer"] for r in rows))
    last = max(r["step"] for r in rows)
    fig, axes = plt.subplots(len(opts), 3, figsize=(16, 3.8 * len(opts)), squeeze=False)
    for i, opt in enumerate(opts):
        rs = [r for r in rows if r["optimizer"] == opt]
        layers = list(dict.fromkeys(r["layer"] for r in rs))
        for j, (key, title) in enumerate([("act_rms", f"activation RMS, step {last}"),
                                          ("act_delta_rms", f"activation change RMS, step {last}")]):
            ax = axes[i][j]
            for layer in layers:
                pts = sorted((r["width"], r[key]) for r in rs if r["layer"] == layer and r["step"] == last)
                ax.plot([p[0] for p in pts], [max(p[1], 1e-12) for p in pts], marker="o", ms=3, label=layer)
            ax.set_title(f"{opt}: {title}")
        ax = axes[i][2]
        series = {"embedding": ("embedding", "rel_update"), "output": ("output", "rel_update")}
        series.update({r: (None, f"rel_update_{r.replace('.', '_')}") for r in ROLES})
        for name, (layer, col) in series.items():
            by_w = defaultdict(list)
            for r in rs:
                if r["step"] > 0 and r.get(col) is not None and (layer is None or r["layer"] == layer):
                    by_w[r["width"]].append(r[col])
            if by_w:
                ws = sorted(by_w)
                ax.plot(ws, [max(sum(by_w[w]) / len(by_w[w]), 1e-12) for w in ws], marker="o", ms=3, label=name)
        ax.set_title(f"{opt}: ||dW||/||W|| per step (mean)")
        for ax in axes[i]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("width")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Coordinate check: flat lines = width-invariant; growing lines = muP-style violation")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
