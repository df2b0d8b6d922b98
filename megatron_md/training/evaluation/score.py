"""``megatron-md score``: mean token loss of a text (or the run's validation set) under a checkpoint.

Runs in one process (CPU is fine) whatever layout the checkpoint was saved with:
``torch_dist`` reshards it onto TP=PP=EP=1.
"""

from __future__ import annotations

import os

import torch
import yaml

from megatron_md.training.checkpoints import checkpointing as ckpt
from megatron_md.training.config import RunConfig


def load_for_inference(load_dir: str, device: str = "cpu", verify: bool = True):
    """Build the checkpoint's model in this single process and load its weights.

    ``verify``: check the files against the checkpoint's checksums.json before reading any of them.
    """
    if verify:
        from megatron_md.training.checkpoints.integrity import verify_load

        verify_load(load_dir)
    text, path = ckpt.read_run_config(load_dir)
    cfg = RunConfig.from_dict(yaml.safe_load(text))
    p = cfg.parallel
    p.tensor_model_parallel_size = p.pipeline_model_parallel_size = p.expert_model_parallel_size = 1
    p.expert_tensor_parallel_size = None
    p.sequence_parallel = False
    p.use_distributed_optimizer = False
    cfg.training.device = device
    cfg.training.nproc_per_node = 1
    from megatron_md.training.data.tokenizer import use_checkpoint_tokenizer

    use_checkpoint_tokenizer(cfg.data, path)  # the tokenizer files saved with the checkpoint
    cfg.checkpoint.save = cfg.checkpoint.load = cfg.checkpoint.pretrained_checkpoint = None
    cfg.checkpoint.save_interval = None  # a run saved with --save-interval: without --save it is refused
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(k, None)
    from megatron_md.models.builder import build_model
    from megatron_md.training.build import make_tokenizer, setup_parallel, vocab_size_for

    from megatron_md.training.validate import validate_for_inference

    rt = setup_parallel(cfg, check=validate_for_inference)  # (an imported checkpoint names no data: none is needed)
    tokenizer = make_tokenizer(cfg)
    model = build_model(cfg, vocab_size_for(cfg, tokenizer), cpu=rt.name == "cpu")
    if rt.name == "cuda":
        model.cuda()
    if cfg.training.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    ckpt.load_checkpoint(load_dir, model, load_optim=False, load_rng=False, verify=False)  # verified above
    model.eval()
    return cfg, model, tokenizer, rt


@torch.no_grad()
def token_losses(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, pos, None, labels=labels).float()


@torch.no_grad()
def score_text(model, tokenizer, text: str, seq_length: int, device) -> tuple[float, int]:
    ids = tokenizer.tokenize(text)
    if len(ids) < 2:
        raise ValueError("--text: needs at least two tokens to score")
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, seq_length):
        window = ids[start : start + seq_length + 1]
        if len(window) < 2:
            break
        t = torch.tensor(window, device=device).unsqueeze(0)
        losses = token_losses(model, t[:, :-1], t[:, 1:])
        total += losses.sum().item()
        count += losses.numel()
    return total / count, count


@torch.no_grad()
def score_validation(cfg: RunConfig, model, tokenizer, device) -> tuple[float, int]:
    """The trainer's final evaluation, recomputed: same dataset sizes, same samples."""
    from megatron_md.training.data.batches import collate
    from megatron_md.training.data.datasets import build_gpt_datasets, dataset_options
    from megatron_md.training.data.loader import eval_start
    from megatron_md.training.build import vocab_size_for

    t = cfg.training
    gbs = t.global_batch_size
    evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 1
    _, valid, _ = build_gpt_datasets(
        cfg.data.data_path, cfg.data.split, cfg.model.seq_length, t.seed, tokenizer,
        t.train_iters * gbs, evals * t.eval_iters * gbs, 0,
        mock=cfg.data.mock_data, path_to_cache=cfg.data.data_cache_path,
        vocab_size=vocab_size_for(cfg, tokenizer), **dataset_options(cfg.data),
    )
    total = torch.zeros(2, dtype=torch.float64)
    n = len(valid)
    start = eval_start(t.train_iters, t.eval_interval, t.eval_iters, gbs, cfg.data.eval_same_batches)
    for i in range(start, start + t.eval_iters * gbs):
        b = {k: v.to(device) for k, v in collate([valid[i % n]]).items()}
        # the dataset's positions and mask (--reset-position-ids, --reset-attention-mask), as in training
        losses = model(b["tokens"], b["position_ids"], b.get("attention_mask"), labels=b["labels"]).float()
        mask = b["loss_mask"].to(losses.device)
        total += torch.stack([(losses * mask).sum(), mask.sum()]).double().cpu()
    return (total[0] / total[1]).item(), int(total[1].item())


def score_main(args) -> int:
    cfg, model, tokenizer, rt = load_for_inference(args.load, args.device, verify=not args.no_verify_checkpoint)
    if args.validation:
        d = cfg.data
        if not (d.mock_data or d.data_path or d.valid_data_path):
            raise ValueError(f"--validation: the checkpoint in {args.load} names no data to validate on (a "
                             "checkpoint imported from Hugging Face, say); score --text or --text-file instead")
        loss, n = score_validation(cfg, model, tokenizer, rt.device)
        what = "validation set"
    else:
        if tokenizer is None:
            raise ValueError("--load: this checkpoint was trained without a tokenizer (mock data); use --validation")
        text = args.text if args.text is not None else open(args.text_file, encoding="utf-8").read()
        loss, n = score_text(model, tokenizer, text, cfg.model.seq_length, rt.device)
        what = "text"
    print(f"mean token loss: {loss:.8f} over {n} tokens ({what}, {args.load})")
    return 0
