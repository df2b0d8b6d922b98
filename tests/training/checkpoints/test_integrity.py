"""Checkpoint integrity: checksums.json written at save, checked before any load reads a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_md.training.checkpoints import integrity as ci
from megatron_md.training.checkpoints.integrity import MANIFEST, CheckpointCorrupted, verify_checkpoint, write_manifest

# What a real iter_ directory holds (torch_dist shards and metadata, our common state, run config, tokenizer).
KINDS = ["__0_0.distcp", "__1_0.distcp", ".metadata", "metadata.json", "common.pt", "run_config.yaml",
         "tokenizer.model"]


def _fake_checkpoint(root: Path, iteration: int) -> Path:
    d = root / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    for i, name in enumerate(KINDS):
        (d / name).write_bytes(bytes((i * 7 + j * 13 + iteration) % 256 for j in range(1000 + 517 * i)))
    write_manifest(d)
    (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return d


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "ck"
    _fake_checkpoint(r, 1)
    _fake_checkpoint(r, 2)
    return r


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _fails(d: Path, *expected: str) -> str:
    before = _snapshot(d.parent)
    with pytest.raises(CheckpointCorrupted) as e:
        verify_checkpoint(d)
    assert _snapshot(d.parent) == before  # a failed check changes nothing in the checkpoint root
    msg = str(e.value)
    for s in (*expected, "iteration 2", "--no-verify-checkpoint"):
        assert s in msg, (s, msg)
    return msg


def test_manifest_lists_every_file_with_size_and_checksum(root):
    d = root / "iter_0000002"
    doc = json.loads((d / MANIFEST).read_text())
    assert doc["algorithm"] == ci.ALGORITHM and sorted(doc["files"]) == sorted(KINDS)
    for name, entry in doc["files"].items():
        assert entry["size"] == (d / name).stat().st_size
        assert entry[ci.ALGORITHM] == ci.file_checksum(d / name)
    assert not list(d.glob("*.tmp"))  # written atomically through a temporary name
    assert verify_checkpoint(d) is True
    assert ci.verify_load(root) is True and ci.verify_load(root, 1) is True


@pytest.mark.parametrize("name", KINDS)
def test_flipped_byte_is_caught(root, name):
    f = root / "iter_0000002" / name
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(data)
    msg = _fails(f.parent, f"{name}: checksum mismatch")
    # points at the previous checkpoint and says how to use it
    assert "iter_0000001 (iteration 1" in msg and f"echo 1 > {root / 'latest_checkpointed_iteration.txt'}" in msg


@pytest.mark.parametrize("name", KINDS)
def test_truncation_is_caught_by_size(root, name, monkeypatch):
    f = root / "iter_0000002" / name
    f.write_bytes(f.read_bytes()[:-1])
    hashed = []
    monkeypatch.setattr(ci, "file_checksum", lambda *a: hashed.append(a) or "")
    _fails(f.parent, f"{name}: size mismatch: {f.stat().st_size} bytes on disk")
    assert not hashed  # fails on sizes, before reading any file


def test_missing_and_unknown_files_are_caught(root):
    d = root / "iter_0000002"
    (d / "__1_0.distcp").unlink()
    (d / "__2_0.distcp").write_bytes(b"stray")
    _fails(d, "__1_0.distcp: missing", "__2_0.distcp: not listed")


def test_unreadable_manifest_is_corruption(root):
    d = root / "iter_0000002"
    (d / MANIFEST).write_text('{"version": 1, "algori')
    _fails(d, f"{MANIFEST}: unreadable")


def test_no_older_checkpoint_to_fall_back_to(tmp_path):
    d = _fake_checkpoint(tmp_path / "ck", 2)
    (d / "common.pt").write_bytes(b"x")
    assert "no older intact checkpoint" in _fails(d, "common.pt: size mismatch")


def test_fallback_skips_an_older_checkpoint_that_is_broken_too(root, tmp_path):
    _fake_checkpoint(root, 3)
    (root / "iter_0000002" / ".metadata").write_bytes(b"")
    (root / "iter_0000003" / "metadata.json").write_bytes(b"")
    with pytest.raises(CheckpointCorrupted, match=r"iteration 3\).*previous checkpoint is \S*iter_0000001"):
        verify_checkpoint(root / "iter_0000003")


def test_checkpoint_without_manifest_loads_with_one_warning_line(root, capsys):
    (root / "iter_0000002" / MANIFEST).unlink()
    assert verify_checkpoint(root / "iter_0000002") is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checksums.json" in err and "unverified" in err


def test_crc32_manifests_verify(tmp_path, monkeypatch):
    monkeypatch.setattr(ci, "ALGORITHM", "crc32")
    d = _fake_checkpoint(tmp_path / "ck", 2)
    assert json.loads((d / MANIFEST).read_text())["algorithm"] == "crc32"
    assert verify_checkpoint(d)
    (d / "run_config.yaml").write_bytes(b"Y" + (d / "run_config.yaml").read_bytes()[1:])
    _fails(d, "run_config.yaml: checksum mismatch: crc32")


def test_every_loader_checks_first_and_the_flag_skips_it(root):
    """load_checkpoint, score/generate's loader and the HF export refuse before reading anything;
    verify=False (--no-verify-checkpoint) goes on to read the (here fake) files."""
    from megatron_md.training.arguments import train_parser
    from megatron_md.convert.hf_export import export_checkpoint
    from megatron_md.training.checkpoints import checkpointing as ckpt
    from megatron_md.training.config import resolve
    from megatron_md.training.evaluation.score import load_for_inference

    f = root / "iter_0000002" / "__0_0.distcp"
    f.write_bytes(b"\0" + f.read_bytes()[1:])
    before = _snapshot(root)
    for load in (lambda: ckpt.load_checkpoint(root, model=None),
                 lambda: load_for_inference(str(root)),
                 lambda: export_checkpoint(root, root.parent / "hf", iteration=2)):
        with pytest.raises(CheckpointCorrupted, match=r"__0_0.distcp: checksum mismatch"):
            load()
    with pytest.raises(Exception) as e:  # past the check: megatron-core reads the fake common state
        ckpt.load_checkpoint(root, model=None, verify=False)
    assert not isinstance(e.value, CheckpointCorrupted)
    assert _snapshot(root) == before and not (root.parent / "hf").exists()
    for argv, skip in ((["--no-verify-checkpoint"], True), ([], False)):
        cli = vars(train_parser().parse_args(["--model", "tiny-dense", *argv]))
        cli.pop("config", None)
        assert resolve(None, None, cli).checkpoint.no_verify_checkpoint is skip


_TWO_RANKS = r"""
import os, sys, torch.distributed as dist
from pathlib import Path
from megatron_md.training.checkpoints.integrity import CheckpointCorrupted, verify_checkpoint, write_manifest
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=int(sys.argv[1]), world_size=2)
d = Path(sys.argv[3])
write_manifest(d)
dist.barrier()
if dist.get_rank() == 0:  # corrupt a file that rank 1 hashes (sorted files [1::2])
    f = d / "__0_0.distcp"
    f.write_bytes(b"\xff" + f.read_bytes()[1:])
dist.barrier()
try:
    verify_checkpoint(d)
    print("verified")
except CheckpointCorrupted as e:
    print("corrupted:", e)
dist.destroy_process_group()
"""


@pytest.mark.multirank
def test_two_ranks_share_the_hashing_and_both_raise(tmp_path):
    d = tmp_path / "ck" / "iter_0000002"
    d.mkdir(parents=True)
    for i, name in enumerate(KINDS):
        (d / name).write_bytes(bytes([i]) * (100 + i))
    assert sorted(KINDS)[1::2].count("__0_0.distcp") == 1
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(r), str(tmp_path / "store"), str(d)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "corrupted:" in out and "__0_0.distcp: checksum mismatch" in out, out
    assert sorted(json.loads((d / MANIFEST).read_text())["files"]) == sorted(KINDS)


@pytest.mark.multirank
@pytest.mark.e2e
def test_cli_refuses_a_corrupted_checkpoint_and_the_flag_skips_the_check(tmp_path):
    """train tiny-dense 2 steps with --save, flip a byte in a .distcp: score and train --load fail naming
    the file and iteration (and point at iter 1), changing nothing; --no-verify-checkpoint loads it. Through the
    real CLI (e2e): the exit codes and messages are the processes'."""
    from mdtest import QUIET, run_cli

    ck = tmp_path / "ck"
    base = ["--model", "tiny-dense", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--log-interval", "1", "--eval-iters", "1", *QUIET]
    run_cli(["train", *base, "--train-iters", "2", "--save", str(ck), "--save-interval", "1",
             "--run-dir", str(tmp_path / "r1")])
    d = ck / "iter_0000002"
    assert (d / MANIFEST).is_file() and (ck / "iter_0000001" / MANIFEST).is_file()
    assert run_cli(["score", "--load", str(ck), "--validation"]).returncode == 0
    shard = sorted(d.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(data)
    before = _snapshot(ck)
    resume = ["train", *base, "--train-iters", "3", "--load", str(ck), "--run-dir", str(tmp_path / "r2")]
    for args in (["score", "--load", str(ck), "--validation"], resume):
        proc = run_cli(args, check=False)
        assert proc.returncode != 0
        for s in (f"{d} (iteration 2) failed its integrity check", f"{shard.name}: checksum mismatch",
                  "echo 1 >", "--no-verify-checkpoint"):
            assert s in proc.stderr, (s, proc.stderr[-3000:])
        assert _snapshot(ck) == before  # the failed load modified and deleted nothing
    out = run_cli(["score", "--load", str(ck), "--validation", "--no-verify-checkpoint"]).stdout
    assert "mean token loss" in out
    resume[-1] = str(tmp_path / "r3")
    proc = run_cli([*resume, "--no-verify-checkpoint"])
    assert "integrity" not in proc.stdout + proc.stderr
