"""The DataLoader pipeline on gloo: one reader per TP group, the broadcast gives every rank the batches the
old in-process path gave, pipeline middle stages read nothing, and workers change no number."""

from __future__ import annotations

import json

import pytest
from mdtest import QUIET, eval_records, run_cli, run_tool, train_records

PROBE = "tests/training/data/_loader_probe.py"


def _probe(nproc: int, cli: dict) -> list[dict]:
    out = run_tool(PROBE, [json.dumps(cli)], nproc=nproc).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("PROBE ")]
    return json.loads(line[len("PROBE "):])


@pytest.mark.multirank
@pytest.mark.parametrize("layout,nproc", [("tp2", 2), ("tp2pp2", 4)])
def test_one_reader_per_tp_group_and_every_rank_gets_its_batches(layout, nproc):
    cli = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2 if layout == "tp2pp2" else 1}
    ranks = _probe(nproc, cli)
    want = [[8, 9], [10, 11], [12, 13], [14, 15]]  # samples 8.. in micro-batches of 2 (DP 1)
    for r in ranks:
        assert r["reads"] == (r["tp_rank"] == 0)  # the receivers hold no loader
        if layout == "tp2" or r["pp_rank"] == 0:  # first stage: tokens and positions
            assert [b["tokens"] for b in r["got"]] == want
        if layout == "tp2":
            assert [b["labels"] for b in r["got"]] == [[x + 1 for x in w] for w in want]
        elif r["pp_rank"] == 1:  # last stage: labels and the loss mask, no tokens
            assert [b["labels"] for b in r["got"]] == [[x + 1 for x in w] for w in want]
            assert all(b["tokens"] is None for b in r["got"]) or r["tp_rank"] == 0


BASE = ["train", "--model", "tiny-dense", "--mock-data", "--train-iters", "4", "--global-batch-size", "4",
        "--micro-batch-size", "1", "--seq-length", "32", "--log-interval", "1", "--eval-iters", "2",
        "--eval-interval", "2", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
        *QUIET]


@pytest.mark.multirank
@pytest.mark.e2e
def test_workers_change_no_number_and_evaluations_move_through_the_split(tmp_path):
    run_cli([*BASE, "--num-workers", "2", "--run-dir", str(tmp_path / "w2")])
    run_cli([*BASE, "--num-workers", "0", "--run-dir", str(tmp_path / "w0")])
    run_cli([*BASE, "--num-workers", "0", "--eval-same-batches", "--run-dir", str(tmp_path / "same")])
    w2, w0 = train_records(tmp_path / "w2"), train_records(tmp_path / "w0")
    assert [(r["lm_loss"], r["grad_norm"]) for r in w2] == [(r["lm_loss"], r["grad_norm"]) for r in w0]
    moving, same = eval_records(tmp_path / "w0"), eval_records(tmp_path / "same")
    assert eval_records(tmp_path / "w2") == moving or [r["eval_lm_loss"] for r in eval_records(tmp_path / "w2")] \
        == [r["eval_lm_loss"] for r in moving]
    assert moving[0]["eval_lm_loss"] == same[0]["eval_lm_loss"]  # the first evaluation reads the same batches
    assert moving[1]["eval_lm_loss"] != same[1]["eval_lm_loss"]  # the second moved on


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Short documents (a few to a few dozen tokens each), with end-of-document tokens: every sample crosses
    boundaries. The demo's tokenizer."""
    from megatron_md.training.data.datasets import prepare_demo_data
    from megatron_md.training.data.preprocess import preprocess

    d = tmp_path_factory.mktemp("corpus")
    _, tok = prepare_demo_data(d, vocab_size=512, log=None)
    docs = d / "short.jsonl"
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}" + " + 1" * (i % 7)}) + "\n"
                            for i in range(400)))
    preprocess(docs, d / "short", tokenizer_model=tok, append_eod=True, log=None)
    return str(d / "short_text_document"), tok


@pytest.mark.multirank
def test_document_switches_change_what_is_trained_on(tmp_path, corpus):
    """On the corpus (documents shorter than a sample) each switch changes the first step's loss: no loss on
    end-of-document tokens, positions restarting per document (learned positions: RoPE ignores position ids, in
    Megatron-LM too), attention kept inside each document."""
    prefix, tok = corpus
    args = ["train", "--model", "tiny-gpt2", "--data-path", prefix, "--tokenizer-model", tok, "--seq-length", "64",
            "--split", "90,10,0", "--train-iters", "1", "--global-batch-size", "4", "--micro-batch-size", "2",
            "--eval-iters", "0",
            "--num-workers", "0", "--log-interval", "1", *QUIET]
    losses = {}
    for name, extra in [("plain", []), ("eod", ["--eod-mask-loss"]), ("pos", ["--reset-position-ids"]),
                        ("mask", ["--reset-attention-mask"])]:
        run_cli([*args, *extra, "--run-dir", str(tmp_path / name)])
        losses[name] = train_records(tmp_path / name)[0]["lm_loss"]
    assert len(set(losses.values())) == 4, losses


def test_per_split_paths_replace_data_path_and_split(tmp_path, corpus):
    """--train-data-path / --valid-data-path (megatron-core's blend_per_split): a run trains and evaluates on them;
    mixing them with --data-path, or a validation path alone, is refused before any work."""
    prefix, tok = corpus
    args = ["train", "--model", "tiny-dense", "--tokenizer-model", tok, "--seq-length", "32", "--train-iters", "2",
            "--global-batch-size", "2", "--eval-iters", "1", "--num-workers", "0", "--log-interval", "1", *QUIET]
    run_cli([*args, "--train-data-path", prefix, "--valid-data-path", prefix, "--run-dir", str(tmp_path / "run")])
    assert len(train_records(tmp_path / "run")) == 2 and len(eval_records(tmp_path / "run")) == 1
    bad = run_cli([*args, "--data-path", prefix, "--train-data-path", prefix], check=False)
    assert bad.returncode == 2 and "--data-path with --train/valid/test-data-path: give one" in bad.stderr
    bad = run_cli([*args, "--valid-data-path", prefix], check=False)
    assert bad.returncode == 2 and "need --train-data-path" in bad.stderr
