"""One rank of a persistent gloo world (tests/harness/pool.py starts WORLD of them once per pytest run).

It imports torch, megatron-core and megatron_md once, then takes jobs from stdin, one JSON line each, and answers
on the file descriptor MDPOOL_CTL_FD, one JSON line per job:

- ``{"argv": [...], "env": {...}, "cwd": ..., "timeout": s, "out": prefix}`` (with ``"script": path``: ``python
  PATH ARGV`` instead, for the tools/ scripts that run no workers of their own) runs ``megatron-md ARGV`` in this
  process as torchrun's worker would run it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set; with a world of
  one, as the CLI's own single process, none of them), in a default process group made for the job on the
  world's persistent store. Its stdout and stderr (file descriptors 1 and 2, so C++ output too) go to
  ``prefix.rankN.out``/``.err``. The answer: ``{"rc", "seconds", "error", "audit"}``; ``error`` is the traceback
  of an exception the CLI did not turn into an exit code (the pool then starts a new world for the next job).
- ``{"quit": true}`` ends the worker (coverage data is written at a normal exit).

After every job ``reset.reset()`` and the saved process state return the worker to where it started, and
``audit`` lists the globals that still differ (tests/harness/reset.py).
"""

from __future__ import annotations

import datetime
import json
import os
import runpy
import sys
import time
import traceback
import types

# (module level: names only; spawn-mode children of a job, such as dist-ckpt's multiprocessing manager, import this
# file again as their __main__)
RANK = int(os.environ.get("MDPOOL_RANK", "0"))
WORLD = int(os.environ.get("MDPOOL_WORLD", "1"))
CTL = None
STORE_PORT = 0
CLI_FILE = ""


def send(msg: dict) -> None:
    CTL.write(json.dumps(msg) + "\n")


def launcher_env(port: int) -> dict[str, str | None]:
    """What torchrun gives each worker (and, for a world of one, what the CLI's single process lacks)."""
    if WORLD == 1:
        return {k: None for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK")}
    return {"RANK": str(RANK), "LOCAL_RANK": str(RANK), "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(RANK), "ROLE_WORLD_SIZE": str(WORLD),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "mdpool", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def redirect(prefix: str | None):
    """Point fds 1 and 2 at the job's files (or back at the worker's log); returns what to restore."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    for fd, ext in ((1, "out"), (2, "err")):
        target = os.open(f"{prefix}.rank{RANK}.{ext}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    return saved


def restore(saved) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, old in zip((1, 2), saved):
        os.dup2(old, fd)
        os.close(old)


def run_job(job: dict, store, n: int, start) -> dict:
    import torch.distributed as dist

    for k, v in {**launcher_env(STORE_PORT), **job.get("env", {})}.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    os.chdir(job.get("cwd") or os.getcwd())
    script = job.get("script")
    sys.argv[:] = [script or CLI_FILE, *job["argv"]]  # as `python SCRIPT` or `python -m megatron_md.cli` sees it
    saved = redirect(job["out"])
    t0, error, rc = time.perf_counter(), None, 1
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"job{n}/", store), rank=RANK, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=job.get("timeout", 600)))
        from megatron_md.cli import main

        if os.environ.get("MDPOOL_RAISE_ON_RANK") == str(RANK):  # tests/harness/test_pool.py: a crashed rank
            raise RuntimeError(f"MDPOOL_RAISE_ON_RANK={RANK}: raised on purpose")
        if script:  # a tool: its file run as __main__ (it ends through sys.exit, or returns 0)
            runpy.run_path(script, run_name="__main__")
            rc = 0
        else:
            rc = main(list(job["argv"]))
    except SystemExit as e:  # argparse and sys.exit: the exit code a process would have
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 — a crash: the traceback, exit 1, and a new world for the next job
        error = traceback.format_exc()
        sys.stderr.write(error)
    finally:
        seconds = time.perf_counter() - t0
        try:
            start.reset_mod.reset(start.restore)
        except BaseException:  # noqa: BLE001
            error = (error or "") + "reset failed:\n" + traceback.format_exc()
            sys.stderr.write(error)
        restore(saved)
        start.state.restore()
    return {"rc": int(rc or 0), "seconds": seconds, "error": error, "audit": start.audit.differences()}


def main() -> None:
    global STORE_PORT, CLI_FILE, CTL
    CTL = os.fdopen(int(os.environ["MDPOOL_CTL_FD"]), "w", buffering=1)
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    if RANK == 0:  # port 0: the OS picks a free port when the store binds it, so two pools cannot collide
        store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False, timeout=timeout)
        send({"port": store.port})
    else:
        store = dist.TCPStore("127.0.0.1", int(os.environ["MDPOOL_PORT"]), WORLD, is_master=False, timeout=timeout)
    STORE_PORT = store.port
    torch.set_num_threads(1)
    # Everything a job imports on its way, imported before the audit's snapshot.
    import megatron_md.cli
    import megatron_md.training.evaluation.generate  # noqa: F401
    import megatron_md.training.evaluation.score  # noqa: F401
    import megatron_md.training.trainer  # noqa: F401
    import reset as reset_mod  # this file's folder is sys.path[0]

    CLI_FILE = megatron_md.cli.__file__
    # what every job's end returns to
    start = types.SimpleNamespace(reset_mod=reset_mod, restore=reset_mod.Restore(), audit=reset_mod.Audit(),
                                  state=reset_mod.ProcessState())
    send({"ready": True, "pid": os.getpid()})
    n = 0
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("quit"):
            break
        n += 1
        send(run_job(job, store, n, start))


if __name__ == "__main__":
    main()
