"""``megatron-md eval``: EleutherAI's lm-evaluation-harness (``lm-eval``, the ``eval`` extra) on a checkpoint.

The model runs in this process through :class:`MegatronScorer` mixed into an ``lm_eval.api.model.LM``, over
the checkpoint's model and tokenizer (loaded as ``score`` loads them: any saved layout onto one process,
imported checkpoints included), so no Hugging Face export is needed. It mirrors lm-eval's own ``HFLM``: the context's trailing
spaces move into the continuation, the continuation's tokens are the tail of the whole text's, an input longer
than the model's window loses tokens on the left, and rolling log-likelihoods use lm-eval's disjoint windows.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

INSTALL_HINT = "lm-eval is not installed: pip install 'megatron-md[eval]'"


def import_lm_eval():
    """lm-eval's modules, or a ValueError saying how to install the extra."""
    try:
        import lm_eval.api.model as model
        import lm_eval.evaluator as evaluator
        import lm_eval.tasks as tasks
        import lm_eval.utils as utils
    except ImportError as e:  # the extra is optional: the rest of megatron-md never needs it
        raise ImportError(INSTALL_HINT) from e
    return model, evaluator, tasks, utils


def _base_lm():
    return import_lm_eval()[0].LM


def _stop_index(text: str, until: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in until if s) if i >= 0]
    return min(hits) if hits else None


class MegatronScorer:
    """The LM interface over a megatron model (called as ``model(tokens, position_ids, None)`` -> logits) and a
    megatron tokenizer (``tokenize``, ``detokenize``, ``vocab_size``, ``eod``); ``make_lm`` mixes it into
    lm-eval's ``LM``, so lm-eval is imported only when an evaluation runs."""

    def __init__(self, model, tokenizer, *, max_length: int, device, batch_size: int = 8, info: dict | None = None):
        super().__init__()  # lm-eval's LM, when make_lm mixes it in
        self.model, self.tok, self.max_length, self._device = model, tokenizer, max_length, device
        self.batch_size, self.info = batch_size, dict(info or {})
        self.vocab = tokenizer.vocab_size  # rows past it are megatron's vocabulary padding: never predicted

    # -- what lm-eval's TemplateLM does for HFLM, written out: our tokenizer is not a Hugging Face one
    @property
    def prefix_token_id(self) -> int:
        # Our documents end with the end-of-document token and training never sees BOS: EOD is what
        # precedes a document, so it stands in for an empty context (HFLM takes BOS, else EOS).
        return self.tok.eod

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tok.tokenize(text)) if text else []

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if context == "":
            cont = self.tok_encode(continuation)
            if cont and cont[0] == self.prefix_token_id:
                return cont[:1], cont[1:]
            return [self.prefix_token_id], cont
        n = len(context) - len(context.rstrip())
        if n:  # "Q: ... A: " + "yes": the space belongs with the word it precedes
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = self.tok_encode(context)
        return ctx, self.tok_encode(context + continuation)[len(ctx):]

    @torch.no_grad()
    def logprobs(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """Per-position log-softmax over the tokenizer's vocabulary, for right-padded rows (causal
        attention: padding after a row's end changes none of its positions)."""
        width = max(map(len, batch))
        toks = torch.zeros(len(batch), width, dtype=torch.long)
        for i, row in enumerate(batch):
            toks[i, : len(row)] = torch.tensor(row)
        toks = toks.to(self._device)
        pos = torch.arange(width, device=self._device).unsqueeze(0).expand_as(toks)
        logits = self.model(toks, pos, None).float()[..., : self.vocab]
        out = torch.log_softmax(logits, dim=-1).cpu()
        return [out[i, : len(row)] for i, row in enumerate(batch)]

    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether greedy decoding yields it), longest inputs first
        in batches of ``batch_size``, as HFLM._loglikelihood_tokens."""
        res: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        todo = []
        for i in order:
            ctx, cont = pairs[i]
            if not cont:  # nothing to score (lm-eval never asks; an empty choice would)
                res[i] = (0.0, True)
                continue
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens exceeds the model's window of "
                                 f"{self.max_length}")
            todo.append(i)
        for b in range(0, len(todo), self.batch_size):
            idx = todo[b : b + self.batch_size]
            # left-truncate to the window; the last token is only ever a target
            inps = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1) :][:-1] for i in idx]
            for i, inp, lp in zip(idx, inps, self.logprobs(inps)):
                cont = torch.tensor(pairs[i][1])
                lp = lp[len(inp) - len(cont) :]
                res[i] = (float(lp.gather(1, cont[:, None]).sum()), bool((lp.argmax(-1) == cont).all()))
        return res

    # -- the LM interface
    def loglikelihood(self, requests, disable_tqdm: bool = False, **_) -> list[tuple[float, bool]]:
        return self.score_tokens([self.encode_pair(*r.args[:2]) for r in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False, **_) -> list[float]:
        utils = import_lm_eval()[3]
        windows, owner = [], []
        for n, r in enumerate(requests):
            for w in utils.get_rolling_token_windows(token_list=self.tok_encode(r.args[0]),
                                                     prefix_token=self.prefix_token_id,
                                                     max_seq_len=self.max_length, context_len=1):
                windows.append(utils.make_disjoint_window(w))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (ll, _) in zip(owner, self.score_tokens(windows)):
            totals[n] += ll
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False, **_) -> list[str]:
        from megatron_md.training.evaluation.generate import next_token_logits

        out = []
        for r in requests:
            context, kw = r.args[0], dict(r.args[1] or {})
            if kw.get("do_sample") and kw.get("temperature", 1.0) != 0:
                raise ValueError("megatron-md eval decodes greedily; this task asks for sampling "
                                 f"(generation_kwargs {kw})")
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", 256))  # HFLM's default
            prompt = self.tok_encode(context) or [self.prefix_token_id]
            head = self.tok.detokenize(prompt)
            ids, text = list(prompt), ""
            for _ in range(max_new):
                # the last max_length tokens: a context longer than the window loses its left end
                t = int(torch.argmax(next_token_logits(self.model, ids, self.max_length, self.vocab,
                                                      self._device)))
                if t == self.tok.eod:
                    break
                ids.append(t)
                # decode with the prompt: SentencePiece drops the space before a leading piece
                whole = self.tok.detokenize(ids)
                text = whole[len(head):] if whole.startswith(head) else self.tok.detokenize(ids[len(prompt):])
                if _stop_index(text, until) is not None:
                    break
            stop = _stop_index(text, until)
            out.append(text if stop is None else text[:stop])
        return out

    def get_model_info(self) -> dict:
        return dict(self.info, max_length=self.max_length, prefix_token_id=self.prefix_token_id)


def make_lm(model, tokenizer, *, max_length: int, device, batch_size: int = 8, info: dict | None = None):
    """An lm-eval ``LM``: :class:`MegatronScorer` with lm-eval's base class mixed in."""
    lm_class = type("MegatronLM", (MegatronScorer, _base_lm()), {})
    return lm_class(model, tokenizer, max_length=max_length, device=device, batch_size=batch_size, info=info)


def parse_limit(text: str | None):
    """--limit: an int (examples per task) or a fraction below 1, as lm-eval takes it."""
    if text is None:
        return None
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"--limit {text}: not a number") from None
    if v <= 0:
        raise ValueError(f"--limit {text}: must be > 0")
    return v if v < 1 else int(v)


def task_manager_for(tasks_mod, names: list[str], include_path: str | None):
    """lm-eval's TaskManager, refusing unknown task names by flag. Indexing lm-eval's thousands of built-in
    tasks takes seconds: a run whose tasks are all plain tasks of --include-path indexes only that."""
    if include_path is not None and not Path(include_path).is_dir():
        raise ValueError(f"--include-path {include_path}: not a directory")
    if include_path is not None:
        own = tasks_mod.TaskManager(include_path=include_path, include_defaults=False)
        if all(n in own.all_subtasks for n in names):
            return own
    tm = tasks_mod.TaskManager(include_path=include_path)
    missing = [n for n in names if not tm.match_tasks([n])]  # a name or a glob (arc_*) matching none
    if missing:
        where = f" in lm-eval or {include_path}" if include_path else " in lm-eval (custom tasks: --include-path)"
        raise ValueError(f"--tasks: no task named {', '.join(missing)}{where}")
    return tm


def default_run_dir(load: str) -> str:
    """The checkpoint's run directory, as its saved config names it, when it exists here."""
    import yaml

    from megatron_md.training.checkpoints import checkpointing as ckpt

    text, _ = ckpt.read_run_config(load)
    run_dir = ((yaml.safe_load(text) or {}).get("logging") or {}).get("run_dir")
    if not run_dir or not Path(run_dir).is_dir():
        raise ValueError(f"--run-dir: the checkpoint in {load} names no run directory that exists here"
                         f"{f' ({run_dir})' if run_dir else ''}; give one")
    return run_dir


def metric_records(results: dict, iteration: int, load: str) -> list[dict]:
    """One metrics.jsonl record per task and metric ('acc,none' -> metric acc, filter none)."""
    recs, now = [], time.time()
    for task, vals in results.get("results", {}).items():
        shots = results.get("n-shot", {}).get(task)
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        for key, v in vals.items():
            metric, comma, filt = key.partition(",")
            # metrics are "name,filter"; alias and sample_len are not
            if not comma or metric.endswith("_stderr") or not isinstance(v, (int, float)):
                continue
            se = vals.get(f"{metric}_stderr,{filt}")
            recs.append({"iteration": iteration, "lm_eval_task": task, "lm_eval_metric": metric,
                         "lm_eval_filter": filt, "value": float(v),
                         "stderr": float(se) if isinstance(se, (int, float)) and math.isfinite(se) else None,
                         "num_fewshot": shots, "samples": n, "load": str(load), "time": now})
    return recs


def eval_main(args) -> int:
    from megatron_md.training.checkpoints.integrity import latest_iteration

    _, evaluator, tasks_mod, utils = import_lm_eval()
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not names:
        raise ValueError("--tasks: name at least one task")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: must be >= 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot {args.num_fewshot}: must be >= 0")
    limit = parse_limit(args.limit)
    iteration = latest_iteration(args.load)
    if iteration is None:
        raise FileNotFoundError(f"--load {args.load}: no checkpoint there (no latest_checkpointed_iteration.txt)")
    run_dir = Path(args.run_dir or default_run_dir(args.load))
    manager = task_manager_for(tasks_mod, names, args.include_path)  # before the model: a typo costs no load

    from megatron_md.training.evaluation.score import load_for_inference

    cfg, model, tokenizer, rt = load_for_inference(args.load, args.device, verify=not args.no_verify_checkpoint)
    if tokenizer is None:
        raise ValueError(f"--load {args.load}: this checkpoint was trained without a tokenizer (mock data); "
                         "lm-eval's tasks are text")
    lm = make_lm(model, tokenizer, max_length=cfg.model.seq_length, device=rt.device, batch_size=args.batch_size,
                 info={"load": str(args.load), "iteration": iteration, "runtime": rt.name})
    results = evaluator.simple_evaluate(
        model=lm, tasks=names, num_fewshot=args.num_fewshot, limit=limit, batch_size=args.batch_size,
        task_manager=manager, log_samples=args.log_samples, random_seed=args.seed, numpy_random_seed=args.seed,
        torch_random_seed=args.seed, fewshot_random_seed=args.seed)
    samples = results.pop("samples", None) if results else None
    out = Path(args.output) if args.output else run_dir / "eval" / f"lm_eval_iter_{iteration:07d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=utils.handle_non_serializable, ensure_ascii=False))
    if samples:  # every request's inputs and the model's answers, one JSON line each
        for task, rows in samples.items():
            with open(out.with_name(f"{out.stem}_samples_{task}.jsonl"), "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, default=utils.handle_non_serializable, ensure_ascii=False) + "\n")
    run_dir.mkdir(parents=True, exist_ok=True)
    recs = metric_records(results, iteration, args.load)
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    print(utils.make_table(results))
    print(f"lm-eval results: {out}; {len(recs)} metric record(s) appended to {run_dir / 'metrics.jsonl'}")
    sys.stdout.flush()
    return 0
