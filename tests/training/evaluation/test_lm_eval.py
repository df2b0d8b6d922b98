"""megatron-md eval: lm-evaluation-harness on a checkpoint, offline.

The wrapper's numbers against a brute-force recomputation on a toy causal model (batching, right padding,
left truncation, rolling windows, greedy decoding and stop strings); the command end to end on a tiny trained
checkpoint with a custom multiple-choice task and a perplexity task, whose scores the test recomputes from the
model's own per-token losses; and the refusals (no extra installed, unknown task, bad flags), one line each.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from mdtest import QUIET, REPO, run_cli

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


# ----------------------------------------------------------------------------- the wrapper on a toy model

class CharTok:
    """One token per printable ASCII character; 0-3 are special (EOD = 2), as the SentencePiece layout."""

    vocab_size, eod = 100, 2

    def tokenize(self, text):
        return [ord(c) - 28 for c in text]

    def detokenize(self, ids):
        return "".join(chr(i + 28) for i in ids if i >= 4)


class Toy(torch.nn.Module):
    """Causal, and every position's logits depend on the whole prefix and the position; rows 100-103 are
    vocabulary padding with huge logits, which the wrapper must never predict or normalise over."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(104, 16, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(64, 16, generator=g))
        self.out = torch.nn.Parameter(torch.randn(16, 104, generator=g))

    def forward(self, tokens, pos, mask):
        assert mask is None
        h = self.emb[tokens].cumsum(1) / (pos[..., None] + 1) + self.pos[pos]
        logits = h @ self.out
        logits[..., 100:] = 1e4
        return logits


def _lm(max_length=12, batch_size=3):
    pytest.importorskip("lm_eval")
    from megatron_md.training.evaluation.lm_eval import make_lm

    return make_lm(Toy(), CharTok(), max_length=max_length, device="cpu", batch_size=batch_size)


@torch.no_grad()
def _next_logprobs(prefix):
    """log p(. | prefix) from a forward pass over exactly ``prefix``, unbatched."""
    t = torch.tensor([prefix])
    return torch.log_softmax(Toy()(t, torch.arange(len(prefix))[None], None)[0, -1, :100], -1)


def _brute_ll(ctx_ids, cont_ids, max_length):
    """HFLM's rule: the input is the last max_length + 1 tokens less the last one; each continuation token
    is scored from the input before it."""
    inp = (ctx_ids + cont_ids)[-(max_length + 1):][:-1]
    total, greedy = 0.0, True
    for j, t in enumerate(cont_ids):
        k = len(inp) - len(cont_ids) + j  # the input position whose output predicts this token
        lp = _next_logprobs(inp[: k + 1])
        total += float(lp[t])
        greedy &= int(lp.argmax()) == t
    return total, greedy


def _req(*args):
    return SimpleNamespace(args=args)


def test_loglikelihood_matches_brute_force_with_batches_padding_and_truncation():
    lm, tok = _lm(), CharTok()
    pairs = [("Question: 2+2 =", " 4"), ("ab", "cdef"), ("", "hello"), ("x = ", "y"),
             ("a much longer context than the window", " ends here"), ("q", "r")]
    got = lm.loglikelihood([_req(*p) for p in pairs])
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        if ctx == "":  # an empty context conditions on EOD
            c, k = [tok.eod], tok.tokenize(cont)
        else:  # the context's trailing space moves into the continuation
            stripped = ctx.rstrip()
            c, k = tok.tokenize(stripped), tok.tokenize(ctx[len(stripped):] + cont)
        want, want_greedy = _brute_ll(c, k, 12)
        assert ll == pytest.approx(want, abs=1e-4), (ctx, cont)
        assert greedy == want_greedy
    # the greedy continuation is reported as greedy
    ctx = tok.tokenize("abc")
    g = [int(_next_logprobs(ctx).argmax())]
    g.append(int(_next_logprobs(ctx + g).argmax()))
    assert lm.loglikelihood([_req("abc", tok.detokenize(g))])[0][1] is True
    # batch size 1 and 3 agree
    one = _lm(batch_size=1).loglikelihood([_req(*p) for p in pairs])
    assert [a for a, _ in one] == pytest.approx([a for a, _ in got], abs=1e-5)


def test_rolling_loglikelihood_predicts_each_token_once_with_full_windows():
    lm, tok = _lm(max_length=8), CharTok()
    short, long = "hello", "abcdefghijklmnopqrst"  # 5 tokens: one window; 20 tokens: three
    got = lm.loglikelihood_rolling([_req(short), _req(long)])
    ids = tok.tokenize(short)
    assert got[0] == pytest.approx(sum(float(_next_logprobs([tok.eod] + ids[:i])[t]) for i, t in enumerate(ids)),
                                   abs=1e-4)
    # lm-eval's windows of 8: tokens 0-7 from EOD + the tokens before them; 8-15 each from the 8 tokens
    # ending just before the window's last target ... so token i in [8, 16) sees ids[7:i], and the last
    # window (16-19) sees ids[11:i]: each token is predicted once, the last window with full context
    ids = tok.tokenize(long)
    want = sum(float(_next_logprobs([tok.eod] + ids[:i])[ids[i]]) for i in range(8))
    want += sum(float(_next_logprobs(ids[7:i])[ids[i]]) for i in range(8, 16))
    want += sum(float(_next_logprobs(ids[11:i])[ids[i]]) for i in range(16, 20))
    assert got[1] == pytest.approx(want, abs=1e-4)


def test_generate_until_is_greedy_and_stops_at_stop_strings_max_tokens_and_eod():
    lm, tok = _lm(max_length=8), CharTok()
    ids = tok.tokenize("ab")
    chain = []
    for _ in range(6):  # greedy over a window of the last 8 tokens, EOD included as any token
        t = int(_next_logprobs((ids + chain)[-8:]).argmax())
        if t == tok.eod:
            break
        chain.append(t)
    full = tok.detokenize(chain)
    out = lm.generate_until([_req("ab", {"until": [], "max_gen_toks": len(chain)})])
    assert out == [full]
    assert len(full) >= 3
    stop = full[2]
    assert lm.generate_until([_req("ab", {"until": [stop], "max_gen_toks": 6})]) == [full[: full.index(stop)]]
    from megatron_md.training.evaluation.lm_eval import make_lm

    class EodAtPosition4(Toy):  # the same logits before position 4, then EOD: three new tokens, no more
        def forward(self, tokens, pos, mask):
            logits = super().forward(tokens, pos, mask)
            logits[..., tok.eod] += 1e3 * (pos == 4)  # only there: past it, text would follow
            return logits

    stops = make_lm(EodAtPosition4(), tok, max_length=8, device="cpu")
    assert stops.generate_until([_req("ab", {"until": [], "max_gen_toks": 10})]) == [tok.detokenize(chain[:3])]
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until([_req("ab", {"do_sample": True, "temperature": 0.7})])


# ----------------------------------------------------------------------------- refusals

def test_without_lm_eval_the_command_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    from megatron_md import cli

    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an environment without the extra imports
    assert cli.main(["eval", "--load", str(tmp_path), "--tasks", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "megatron-md eval: error: lm-eval is not installed: pip install 'megatron-md[eval]'"


def test_bad_input_is_refused_by_flag_before_the_model_loads(capsys, tmp_path):
    pytest.importorskip("lm_eval")
    from megatron_md import cli

    ck = tmp_path / "ck"  # a pointer at a checkpoint that is not there: loading it would fail otherwise
    ck.mkdir()
    (ck / "latest_checkpointed_iteration.txt").write_text("3\n")
    tasks = _write_tasks(tmp_path / "tasks")
    base = ["eval", "--load", str(ck), "--run-dir", str(tmp_path / "run"), "--include-path", str(tasks)]
    for extra, flag in [(["--tasks", "tiny_mc,no_such_task"], "--tasks: no task named no_such_task"),
                        (["--tasks", "tiny_mc", "--limit", "zero"], "--limit zero"),
                        (["--tasks", "tiny_mc", "--batch-size", "0"], "--batch-size 0")]:
        assert cli.main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("megatron-md eval: error: ") and flag in err and "\n" not in err, err
    assert cli.main(["eval", "--load", str(tmp_path / "none"), "--tasks", "tiny_mc"]) == 2
    assert "--load" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--tasks", "tiny_mc"])
    assert e.value.code == 2 and "--load" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- the command on a checkpoint

MC = [  # question, choices, gold: code the model has seen against noise
    ("def main(", ["args):", "banana split", "42 + 7"], 0),
    ("import", ["os", "the cat sat", "3.14159"], 0),
    ("for i in", ["range(10):", "purple", ")))"], 0),
    ("The for statement in Python", ["iterates over the items", "xyzzy qwv", "0000"], 0),
    ("return", ["elephant", "None", ";;;;"], 1),
]
PPL = ["The for statement in Python differs a bit from C.", "def main(args):\n    return 0"]


def _write_tasks(d):
    d.mkdir(parents=True, exist_ok=True)
    (d / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "label": g}) + "\n"
                                        for q, c, g in MC))
    (d / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in PPL))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (d / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + common.format(d / "mc.jsonl") +
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\nmetric_list:\n"
        "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")
    (d / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\n" + common.format(d / "ppl.jsonl") +
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n"
        "  - {metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n")
    return d


# The expected scores, from the model's own per-token losses (score's loss path: the model's cross-entropy, one
# unpadded sequence at a time), with lm-eval's split of a prompt and a choice: the choice's tokens are those
# of "question choice" after the question's.
REFERENCE = r"""
import json, sys, torch
from megatron_md.training.evaluation.score import load_for_inference, token_losses
cfg, model, tok, rt = load_for_inference(sys.argv[1])
assert tok.vocab_size == 512 and cfg.model.seq_length == 32  # no vocabulary padding to normalise over
def nll(ids, start):  # -log p(ids[start:] | ids[:start])
    t = torch.tensor([ids])
    return float(token_losses(model, t[:, :-1], t[:, 1:])[0, start - 1:].sum())
mc, ppl = json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {"mc": [], "ppl": []}
for q, choices, _ in mc:
    n = len(tok.tokenize(q))
    out["mc"].append([-nll(tok.tokenize(q + " " + c), n) for c in choices])
for text in ppl:
    ids = [tok.eod] + tok.tokenize(text)
    assert len(ids) <= 32  # one window
    out["ppl"].append(-nll(ids, 1))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny-dense, 3 steps on the embedded corpus with a 512-piece SentencePiece tokenizer, sequence 32."""
    from megatron_md.training.data.datasets import prepare_demo_data

    d = tmp_path_factory.mktemp("lm_eval")
    prefix, tok = prepare_demo_data(d / "data", vocab_size=512, log=None)
    run_cli(["train", "--model", "tiny-dense", "--data-path", prefix, "--tokenizer-model", tok, "--seq-length", "32",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2",
             "--eval-iters", "1", *QUIET, "--save", str(d / "ck"), "--run-dir", str(d / "run")])
    return d / "ck"


@pytest.mark.e2e
def test_eval_scores_a_checkpoint_as_its_own_losses_say_and_writes_the_run_dir(checkpoint, tmp_path):
    """(e2e: ``megatron-md eval`` in a fresh interpreter, as a user runs it.)"""
    pytest.importorskip("lm_eval")
    tasks, run = _write_tasks(tmp_path / "tasks"), tmp_path / "run"
    env = dict(OFFLINE, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"))
    proc = run_cli(["eval", "--load", str(checkpoint), "--tasks", "tiny_mc,tiny_ppl", "--include-path", str(tasks),
                    "--run-dir", str(run), "--batch-size", "4", "--log-samples"], env=env)
    ref = json.loads(subprocess.run(
        [sys.executable, "-c", REFERENCE, str(checkpoint), json.dumps(MC), json.dumps(PPL)], cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, check=True).stdout.splitlines()[-1])

    acc = sum(max(range(3), key=lambda i: lls[i]) == g for lls, (_, _, g) in zip(ref["mc"], MC)) / len(MC)
    acc_norm = sum(max(range(3), key=lambda i: lls[i] / len(c[i])) == g
                   for lls, (_, c, g) in zip(ref["mc"], MC)) / len(MC)
    words = sum(len(re.split(r"\s+", t)) for t in PPL)
    nbytes = sum(len(t.encode()) for t in PPL)

    out = run / "eval" / "lm_eval_iter_0000003.json"
    res = json.loads(out.read_text())["results"]
    assert res["tiny_mc"]["acc,none"] == acc and res["tiny_mc"]["acc_norm,none"] == acc_norm
    assert res["tiny_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(-sum(ref["ppl"]) / words), rel=1e-4)
    assert res["tiny_ppl"]["byte_perplexity,none"] == pytest.approx(math.exp(-sum(ref["ppl"]) / nbytes), rel=1e-4)
    # every choice's log-likelihood, not only the argmax
    rows = [json.loads(line) for line in open(run / "eval" / "lm_eval_iter_0000003_samples_tiny_mc.jsonl")]
    for row in rows:
        got = [r[0][0] for r in row["resps"]]
        assert got == pytest.approx(ref["mc"][row["doc_id"]], abs=2e-3)

    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    by = {(r["lm_eval_task"], r["lm_eval_metric"]): r for r in recs}
    assert set(by) == {("tiny_mc", "acc"), ("tiny_mc", "acc_norm"), ("tiny_ppl", "word_perplexity"),
                       ("tiny_ppl", "byte_perplexity")}
    assert by["tiny_mc", "acc"]["value"] == acc and by["tiny_mc", "acc"]["iteration"] == 3
    assert by["tiny_mc", "acc"]["samples"] == len(MC) and by["tiny_mc", "acc"]["num_fewshot"] == 0
    assert "tiny_mc" in proc.stdout and "acc_norm" in proc.stdout and str(out) in proc.stdout
