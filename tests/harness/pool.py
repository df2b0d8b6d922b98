"""Persistent gloo worlds for the test suite: ``megatron-md train`` (and the other in-process commands) run inside
workers started once per pytest run, instead of a fresh interpreter and torchrun per command.

``POOL.run(argv, nproc)`` sends the command to the world of ``nproc`` ranks (1, 2 or 4; started on first use) and
returns what ``subprocess.run`` would: the exit code (a world of several ranks reports 1 when any rank failed, as
torchrun does), and stdout and stderr of every rank, rank 0 first. A job whose rank raised, timed out, or whose
peers did not finish within GRACE_S of a failed rank, ends its world (killed, as torchrun kills the other
workers); the next job starts a new one. tests/harness/worker.py is the other side, tests/harness/reset.py what is
put back between jobs.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GRACE_S = 15.0  # after one rank fails, how long the others may take to fail or finish before the world is killed
START_TIMEOUT_S = 300.0


class WorldDied(RuntimeError):
    pass


class World:
    """``size`` worker processes sharing one TCPStore, each taking the same job."""

    def __init__(self, size: int, root: Path, grace_s: float = GRACE_S):
        self.size, self.root, self.grace_s = size, root, grace_s
        self.procs: list[subprocess.Popen] = []
        self.ctl: list = []
        self.jobs = 0
        self.audit: list[tuple[str, list[str]]] = []  # (job, differences) for each job that left some

    def _spawn(self, rank: int, port: int | None) -> None:
        r, w = os.pipe()
        env = dict(os.environ, MDPOOL_RANK=str(rank), MDPOOL_WORLD=str(self.size), MDPOOL_CTL_FD=str(w),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT", "MASTER_ADDR",
                  "PYTEST_CURRENT_TEST"):
            env.pop(k, None)
        if port is not None:
            env["MDPOOL_PORT"] = str(port)
        log = open(self.root / f"world{self.size}.rank{rank}.log", "ab")
        self.procs.append(subprocess.Popen([sys.executable, str(HERE / "worker.py")], cwd=REPO, env=env,
                                           stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(w,),
                                           start_new_session=True))
        log.close()
        os.close(w)
        self.ctl.append(os.fdopen(r, "r"))

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._spawn(0, None)
        port = self._read(0, time.time() + START_TIMEOUT_S)["port"]
        for rank in range(1, self.size):
            self._spawn(rank, port)
        deadline = time.time() + START_TIMEOUT_S
        for rank in range(self.size):
            self._read(rank, deadline)

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def _read(self, rank: int, deadline: float) -> dict:
        f = self.ctl[rank]
        while True:
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError(f"pool world {self.size}: rank {rank} did not answer in time")
            ready, _, _ = select.select([f], [], [], left)
            if ready:
                line = f.readline()
                if not line:
                    raise WorldDied(f"pool world {self.size}: rank {rank} exited "
                                    f"({self.procs[rank].poll()}); its log: {self.root}/world{self.size}.rank{rank}.log")
                return json.loads(line)

    def run(self, argv: list[str], env: dict | None, cwd: Path, timeout: float,
            script: str | None = None) -> tuple[int, str, str, bool]:
        """(exit code, stdout, stderr, whether the world must be replaced)."""
        self.jobs += 1
        prefix = self.root / f"world{self.size}.job{self.jobs:04d}"
        line = json.dumps({"argv": argv, "env": env or {}, "cwd": str(cwd), "timeout": timeout,
                           "out": str(prefix), "script": script}) + "\n"
        for p in self.procs:
            p.stdin.write(line.encode())
            p.stdin.flush()
        results: dict[int, dict] = {}
        deadline, broken, note = time.time() + timeout, False, ""
        pending = {self.ctl[r]: r for r in range(self.size)}
        while pending:
            failed = any(r["rc"] != 0 or r["error"] for r in results.values())
            left = (min(deadline, failed_at + self.grace_s) if failed else deadline) - time.time()
            ready, _, _ = select.select(list(pending), [], [], max(left, 0))
            if not ready:
                broken = True
                note = (f"\n[pool] rank(s) {sorted(pending.values())} still running "
                        + (f"{self.grace_s:.0f} s after another rank failed" if failed else f"after {timeout:.0f} s")
                        + "; the world was killed\n")
                break
            for f in ready:
                rank = pending.pop(f)
                line = f.readline()
                if not line:
                    results[rank] = {"rc": self.procs[rank].wait(), "error": "worker died", "audit": []}
                    broken = True
                else:
                    results[rank] = json.loads(line)
                if (results[rank]["rc"] != 0 or results[rank]["error"]) and not failed:
                    failed_at = time.time()
        out = "".join(_read_text(f"{prefix}.rank{r}.out") for r in range(self.size))
        err = "".join(_read_text(f"{prefix}.rank{r}.err") for r in range(self.size)) + note
        broken = broken or any(r.get("error") for r in results.values())
        audit = sorted({d for r in results.values() for d in r.get("audit", [])})
        if audit:
            self.audit.append((" ".join(argv), audit))
        if broken and len(results) < self.size and not note:
            note = "[pool] a worker died\n"
        rcs = [results.get(r, {"rc": 1})["rc"] for r in range(self.size)]
        if self.size == 1:
            rc = rcs[0]
        else:  # torchrun: 1 when any worker failed
            rc = 0 if all(c == 0 for c in rcs) and not broken else 1
        if broken:
            self.kill()
        return rc, out, err, broken

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(b'{"quit": true}\n')
                p.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """End the workers: SIGTERM first (a worker waiting for a job exits, and coverage, when measuring, writes its
        data), SIGKILL to their process groups (jobs' helpers included) after a moment."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 3
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.time(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: helpers a job forked go too
            except ProcessLookupError:
                pass
            p.wait()
        for f in self.ctl:
            f.close()
        self.procs, self.ctl = [], []


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


class Pool:
    """The worlds of one pytest run, by size."""

    SIZES = (1, 2, 4)

    def __init__(self, root: Path | None = None, grace_s: float = GRACE_S):
        self._root, self.grace_s = root, grace_s
        self.worlds: dict[int, World] = {}
        self.restarts = 0
        self.seconds = 0.0
        self.finished_jobs = 0  # of worlds already replaced or closed
        self.finished_audit: list[tuple[str, list[str]]] = []

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="mdpool-"))
        return self._root

    def set_root(self, root: Path) -> None:
        if not self.worlds:
            self._root = root

    def world(self, size: int) -> World:
        if size not in self.SIZES:
            raise ValueError(f"no pooled world of {size} ranks (have {self.SIZES})")
        w = self.worlds.get(size)
        if w is None or not w.alive():
            if w is not None:
                self.restarts += 1
                self._retire(w)
            w = self.worlds[size] = World(size, self.root, self.grace_s)
            w.start()
        return w

    def run(self, argv: list[str], nproc: int, *, env: dict | None = None, cwd: Path = REPO,
            timeout: float = 600, script: str | None = None) -> subprocess.CompletedProcess:
        """``megatron-md ARGV`` (or ``python SCRIPT ARGV``) on ``nproc`` ranks, as subprocess.run reports it."""
        t0 = time.perf_counter()
        rc, out, err, _ = self.world(nproc).run(list(argv), env, cwd, timeout, script)
        self.seconds += time.perf_counter() - t0
        return subprocess.CompletedProcess([script or "megatron-md (pool)", *argv], rc, out, err)

    def summary(self) -> str:
        jobs = sum(w.jobs for w in self.worlds.values()) + self.finished_jobs
        if not jobs:
            return ""
        found = self.audit()
        return (f"pool: {jobs} commands in persistent worlds, {self.seconds:.0f} s, {self.restarts} world restart(s)"
                + (f"; {len(found)} job(s) left globals changed (first: {found[0]})" if found else ""))

    def audit(self) -> list[tuple[str, list[str]]]:
        return self.finished_audit + [a for w in self.worlds.values() for a in w.audit]

    def _retire(self, w: World) -> None:
        self.finished_jobs += w.jobs
        self.finished_audit += w.audit

    def close(self) -> None:
        for w in self.worlds.values():
            w.close()
            self._retire(w)
        self.worlds = {}


POOL = Pool()
atexit.register(POOL.close)
