"""``megatron-md generate``: continue a prompt under a checkpoint, greedy or sampled.

One process, any saved layout (``torch_dist`` reshards onto TP=PP=EP=1, as ``score``). No KV cache: every
new token re-runs the window (the last ``seq_length`` tokens), which is what a quick look at a small
model needs; serve big ones through the Hugging Face export (``megatron-md convert export``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingOptions:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 1234
    stop_at_eos: bool = True

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"need --top-k >= 0 and 0 < --top-p <= 1, got {self.top_k}, {self.top_p}")


@torch.no_grad()
def next_token_logits(model, ids: list[int], seq_length: int, vocab: int, device) -> torch.Tensor:
    """fp32 logits of the token after ``ids`` (window: the last ``seq_length`` tokens); rows past the
    tokenizer's vocabulary (megatron's padding) are masked out."""
    window = torch.tensor(ids[-seq_length:], device=device).unsqueeze(0)
    pos = torch.arange(window.shape[1], device=device).unsqueeze(0)
    logits = model(window, pos, None)[0, -1].float()
    logits[vocab:] = float("-inf")
    return logits


def choose(logits: torch.Tensor, opts: SamplingOptions, gen: torch.Generator) -> int:
    if opts.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits / opts.temperature
    if opts.top_k:
        kth = torch.topk(logits, min(opts.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if opts.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = sorted_p.cumsum(0) - sorted_p > opts.top_p  # keep the smallest set reaching top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def generate_ids(model, prompt: list[int], opts: SamplingOptions, *, seq_length: int, vocab: int,
                 eos: int | None, device) -> list[int]:
    """The new token ids (the prompt excluded)."""
    opts.validate()
    if not prompt:
        raise ValueError("--prompt: empty after tokenization")
    gen = torch.Generator().manual_seed(opts.seed)
    ids, new = list(prompt), []
    for _ in range(opts.max_new_tokens):
        tok = choose(next_token_logits(model, ids, seq_length, vocab, device), opts, gen)
        if opts.stop_at_eos and eos is not None and tok == eos:
            break
        ids.append(tok)
        new.append(tok)
    return new


def generate_main(args) -> int:
    from megatron_md.training.evaluation.score import load_for_inference

    cfg, model, tokenizer, rt = load_for_inference(args.load, args.device, verify=not args.no_verify_checkpoint)
    if tokenizer is None:
        raise ValueError("--load: this checkpoint was trained without a tokenizer (mock data); nothing to decode")
    opts = SamplingOptions(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                           not args.ignore_eos)
    prompt = tokenizer.tokenize(args.prompt)  # as in training: no BOS (documents end with EOD)
    new = generate_ids(model, prompt, opts, seq_length=cfg.model.seq_length, vocab=tokenizer.vocab_size,
                       eos=tokenizer.eos, device=rt.device)
    # decode prompt and continuation together: SentencePiece drops the space before a leading piece
    print(" ".join(map(str, new)) if args.ids else tokenizer.detokenize(prompt + new))
    return 0
