"""CPU runtime: one behaviour test per bridged CUDA entry point, plus a world-size-1 integration.

Run from the repo root with ``python -m pytest tests/runtime`` (``-m`` puts the root on sys.path).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from megatron_md.runtime import Runtime, activate, cpu, select_runtime
from megatron_md.runtime.distributed import destroy_distributed, init_distributed

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ per-bridge behaviour checks


def _check_current_device():
    from megatron.core.utils import GlobalMemoryBuffer

    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    # utils.py GlobalMemoryBuffer allocates with device=torch.cuda.current_device()
    assert GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x").device.type == "cpu"


def _check_set_device():
    assert torch.cuda.set_device(3) is None
    assert torch.cuda.current_device() == torch.device("cpu")


def _check_synchronize():
    assert torch.cuda.synchronize() is None
    assert torch.cuda.synchronize(0) is None


def _check_empty_cache():
    assert torch.cuda.empty_cache() is None


def _check_stream():
    s = torch.cuda.Stream(device=torch.cuda.current_device(), priority=-1)
    s.wait_stream(torch.cuda.current_stream())
    with s:
        pass
    with torch.cuda.stream(s):
        x = torch.ones(2) + 1
    ev = s.record_event()
    ev.synchronize()
    assert ev.query() and s.query() and torch.equal(x, torch.full((2,), 2.0))
    assert len(torch.cuda.Stream.priority_range()) == 2


def _check_event():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record(torch.cuda.current_stream())
    end.wait()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) == 0.0
    torch.cuda.current_stream().wait_event(end)


def _check_current_stream():
    s = torch.cuda.current_stream()
    assert isinstance(s, cpu.Stream) and s is torch.cuda.current_stream(0)
    # token_dispatcher.py compares streams with != and waits on them
    side = torch.cuda.Stream()
    assert side != s
    side.wait_stream(s)


def _check_default_stream():
    assert torch.cuda.default_stream() is torch.cuda.current_stream()


def _check_stream_ctx():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s) as got:
        assert got is s
    with torch.cuda.stream(None) as got:
        assert got is None


def _check_device_ctx():
    with torch.cuda.device(1):
        assert torch.zeros(1, device="cuda").device.type == "cpu"


def _check_capturing():
    assert torch.cuda.is_current_stream_capturing() is False


def _check_memory(name):
    def check():
        fn = getattr(torch.cuda, name)
        assert fn() == 0 and fn(torch.cuda.current_device()) == 0

    return check


def _check_reset_peak():
    assert torch.cuda.reset_peak_memory_stats() is None


def _check_memory_stats():
    assert torch.cuda.memory_stats() == {}


def _check_get_rng_state(mod):
    def check():
        m = importlib.import_module(mod)
        state = m.get_rng_state()
        assert torch.equal(state, torch.get_rng_state())
        a = torch.rand(4)
        m.set_rng_state(state)
        assert torch.equal(torch.rand(4), a)
        assert torch.equal(m.get_rng_state("cuda"), torch.get_rng_state())

    return check


def _check_set_rng_state(mod):
    def check():
        m = importlib.import_module(mod)
        torch.manual_seed(11)
        state = torch.get_rng_state()
        a = torch.rand(4)
        m.set_rng_state(state, device="cuda")
        assert torch.equal(torch.rand(4), a)

    return check


def _check_manual_seed(mod, name):
    def check():
        seed = getattr(importlib.import_module(mod), name)
        seed(7)
        a = torch.rand(4)
        torch.manual_seed(7)  # torch.manual_seed calls torch.cuda.manual_seed_all: no recursion
        assert torch.equal(torch.rand(4), a)
        seed(8)
        assert not torch.equal(torch.rand(4), a)

    return check


def _check_tensor_cuda():
    t = torch.zeros(2)
    assert t.cuda() is t and t.cuda(0, non_blocking=True) is t
    p = torch.nn.Parameter(torch.zeros(2))
    assert p.cuda() is p


def _check_tensor_to():
    t = torch.zeros(2)
    for dev in ("cuda", "cuda:1", 0, torch.device("cuda"), torch.device("cuda", 1)):
        assert t.to(dev).device.type == "cpu"
    assert t.to(device="cuda", non_blocking=True).device.type == "cpu"
    assert t.to("cuda", torch.float64).dtype == torch.float64
    assert t.to(torch.float16, True).dtype == torch.float16  # bool non_blocking is not a device
    # class-level patch: works on threads that lack the TorchFunctionMode
    out = []
    th = threading.Thread(target=lambda: out.append(t.to("cuda").device.type))
    th.start()
    th.join()
    assert out == ["cpu"]


def _check_tensor_type():
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.half).type() == "torch.cuda.HalfTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.nn.Parameter(torch.zeros(1)).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.long).type() == "torch.cuda.LongTensor"
    # with an argument it still converts (CUDA type names map to their CPU twin)
    t = torch.zeros(2)
    assert t.type(torch.float64).dtype == torch.float64
    assert t.type("torch.DoubleTensor").dtype == torch.float64
    h = t.type("torch.cuda.HalfTensor")
    assert h.dtype == torch.half and h.device.type == "cpu"
    assert t.type(torch.cuda.DoubleTensor).dtype == torch.float64


def _check_pin_memory():
    t = torch.zeros(2)
    assert t.pin_memory() is t


def _check_record_stream():
    assert torch.zeros(2).record_stream(torch.cuda.current_stream()) is None


def _check_module_cuda():
    m = torch.nn.Linear(2, 2)
    assert m.cuda() is m and m.cuda(0) is m and m.weight.device.type == "cpu"


def _check_mode_device():
    x = torch.zeros(3)
    made = [
        torch.zeros(2, device="cuda"),
        torch.tensor([1.0], device="cuda:0"),
        torch.empty(1, device=0),
        torch.ones(1, device=torch.device("cuda")),
        torch.arange(3, device="cuda"),
        torch.empty_like(x, device="cuda"),
        x.new_zeros(2, device="cuda"),
        torch.full((2,), 1.0, device="cuda:1"),
    ]
    assert all(t.device.type == "cpu" for t in made)
    assert torch.zeros(1, device="cpu").device.type == "cpu"


def _check_mode_pin():
    t = torch.empty(2, pin_memory=True)
    assert t.device.type == "cpu" and not t.is_pinned()
    assert torch.tensor([1, 2], device="cpu", pin_memory=True).tolist() == [1, 2]


def _check_mcore_get_rng():
    from megatron.core.tensor_parallel import random as r

    assert torch.equal(r._get_cuda_rng_state(), torch.get_rng_state())
    assert torch.equal(r._get_cuda_rng_state("cuda", clone=True), torch.get_rng_state())


def _check_mcore_set_rng():
    from megatron.core.tensor_parallel import random as r

    state = torch.get_rng_state()
    a = torch.rand(3)
    r._set_cuda_rng_state(state)  # the original only queues a lazy CUDA callback
    assert torch.equal(torch.rand(3), a)


def _check_fork_warning_filter():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("probe-rng", 4242)
    before = torch.get_rng_state()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    logger.addHandler(handler)
    try:
        with tracker.fork("probe-rng"):
            inside = torch.rand(3)
    finally:
        logger.removeHandler(handler)
    assert not any("CPU RNG state changed" in r.getMessage() for r in records)
    # the fork drew from the tracked stream and restored the default one
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(torch.rand(3), inside)


def _check_move_to_cpu(mod):
    def check():
        move = importlib.import_module(mod).maybe_move_tensor_to_cpu
        t = torch.tensor([3, 1])
        arr = move(t, as_numpy=True, record_stream=True)
        assert not torch.is_tensor(arr) and arr.tolist() == [3, 1]
        assert move(t) is t
        assert move(None) is None

    return check


def _check_all_gather():
    # The padding path, with a stand-in for an even two-rank gather (this process is one rank).
    other = torch.arange(12.0).view(6, 2)

    def even_gather(bufs, padded, group=None):
        bufs[0].copy_(padded)
        bufs[1].copy_(other[: padded.shape[0]])

    mine = torch.ones(4, 2)
    outs = [torch.empty(4, 2), torch.empty(6, 2)]
    cpu.gather_padded(outs, mine, None, even_gather)
    assert torch.equal(outs[0], mine) and torch.equal(outs[1], other)
    # The installed bridge passes an even gather straight through (world size 1 here).
    import torch.distributed as dist

    if dist.is_initialized():
        out = [torch.empty(3)]
        dist.all_gather(out, torch.tensor([1.0, 2.0, 3.0]))
        assert out[0].tolist() == [1.0, 2.0, 3.0]


def _check_checkpoint_backward():
    # A recomputed forward that allocates on "cuda", its backward entered through torch.autograd.backward.
    from megatron.core.tensor_parallel.random import checkpoint

    x = torch.ones(3, requires_grad=True)
    y = checkpoint(lambda t: t * torch.full((3,), 2.0, device="cuda"), False, x)
    y.sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


_TP = "megatron.core.tensor_parallel.random"
CHECKS = {
    f"{_TP}.CheckpointFunction.backward": _check_checkpoint_backward,
    "torch.distributed.all_gather": _check_all_gather,
    "torch.cuda.current_device": _check_current_device,
    "torch.cuda.set_device": _check_set_device,
    "torch.cuda.synchronize": _check_synchronize,
    "torch.cuda.empty_cache": _check_empty_cache,
    "torch.cuda.Stream": _check_stream,
    "torch.cuda.Event": _check_event,
    "torch.cuda.current_stream": _check_current_stream,
    "torch.cuda.default_stream": _check_default_stream,
    "torch.cuda.stream": _check_stream_ctx,
    "torch.cuda.device": _check_device_ctx,
    "torch.cuda.is_current_stream_capturing": _check_capturing,
    "torch.cuda.memory_allocated": _check_memory("memory_allocated"),
    "torch.cuda.max_memory_allocated": _check_memory("max_memory_allocated"),
    "torch.cuda.memory_reserved": _check_memory("memory_reserved"),
    "torch.cuda.max_memory_reserved": _check_memory("max_memory_reserved"),
    "torch.cuda.reset_peak_memory_stats": _check_reset_peak,
    "torch.cuda.memory_stats": _check_memory_stats,
    **{
        f"{mod}.{name}": check
        for mod in ("torch.cuda", "torch.cuda.random")
        for name, check in (
            ("get_rng_state", _check_get_rng_state(mod)),
            ("set_rng_state", _check_set_rng_state(mod)),
            ("manual_seed", _check_manual_seed(mod, "manual_seed")),
            ("manual_seed_all", _check_manual_seed(mod, "manual_seed_all")),
        )
    },
    "torch.Tensor.cuda": _check_tensor_cuda,
    "torch.Tensor.to": _check_tensor_to,
    "torch.Tensor.type": _check_tensor_type,
    "torch.Tensor.pin_memory": _check_pin_memory,
    "torch.Tensor.record_stream": _check_record_stream,
    "torch.nn.Module.cuda": _check_module_cuda,
    "TorchFunctionMode(device=)": _check_mode_device,
    "TorchFunctionMode(pin_memory=)": _check_mode_pin,
    f"{_TP}._get_cuda_rng_state": _check_mcore_get_rng,
    f"{_TP}._set_cuda_rng_state": _check_mcore_set_rng,
    f"logging({_TP})": _check_fork_warning_filter,
    "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu": _check_move_to_cpu(
        "megatron.core.transformer.moe.moe_utils"
    ),
    "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu": _check_move_to_cpu(
        "megatron.core.transformer.moe.token_dispatcher"
    ),
}


def test_every_bridge_has_a_check():
    assert set(CHECKS) == set(cpu.BRIDGES)


@pytest.mark.parametrize("name", sorted(cpu.BRIDGES))
def test_bridge(name, shim):
    CHECKS[name]()


# ------------------------------------------------------------- install / uninstall / selection

# megatron-core files on the GPT + DDP + optimizer + PP + MoE + dist-ckpt paths
_MCORE_FILES = """
distributed/distributed_data_parallel.py distributed/param_and_grad_buffer.py
distributed/finalize_model_grads.py optimizer/__init__.py optimizer/optimizer.py
optimizer/distrib_optimizer.py optimizer/clip_grads.py optimizer/grad_scaler.py
optimizer/emerging_optimizers.py optimizer/layer_wise_optimizer.py pipeline_parallel/schedules.py
pipeline_parallel/p2p_communication.py tensor_parallel/random.py tensor_parallel/layers.py
tensor_parallel/mappings.py transformer/moe/token_dispatcher.py transformer/moe/moe_utils.py
transformer/moe/moe_layer.py transformer/moe/router.py transformer/moe/experts.py
transformer/transformer_layer.py transformer/attention.py transformer/dot_product_attention.py
transformer/utils.py transformer/module.py models/gpt/gpt_model.py utils.py parallel_state.py
dist_checkpointing/serialization.py dist_checkpointing/exchange_utils.py
dist_checkpointing/strategies/torch.py dist_checkpointing/strategies/filesystem_async.py
dist_checkpointing/strategies/state_dict_saver.py dist_checkpointing/strategies/fully_parallel.py
""".split()


def test_megatron_cuda_names_are_all_accounted_for():
    """A megatron-core upgrade that calls a new torch.cuda.X on these paths fails here."""
    import re

    import megatron.core

    root = Path(megatron.core.__file__).parent
    bridged = {k.split(".")[-1] for k in cpu.BRIDGES if k.startswith("torch.cuda.")}
    used = {}
    for rel in _MCORE_FILES:
        for m in re.finditer(r"torch\.cuda\.([A-Za-z_][A-Za-z0-9_]*)", (root / rel).read_text()):
            used.setdefault(m.group(1), rel)
    unknown = {n: f for n, f in used.items() if n not in bridged and n not in cpu.NOT_BRIDGED}
    assert not unknown, f"bridge these or list them in cpu.NOT_BRIDGED: {unknown}"


def test_import_does_not_patch_torch():
    code = """
import json, torch
names = ["current_device", "synchronize", "Stream", "get_rng_state", "manual_seed"]
before = {n: id(getattr(torch.cuda, n)) for n in names}
import megatron_md, megatron_md.runtime, megatron_md.runtime.cpu, megatron_md.runtime.distributed
from megatron_md.runtime import select_runtime
select_runtime("cpu")
print(json.dumps({
    "same": before == {n: id(getattr(torch.cuda, n)) for n in names},
    "tensor_attrs": [a for a in ("cuda", "to", "type") if a in vars(torch.Tensor)],
    "modes": len(torch.overrides._get_current_function_mode_stack()),
    "installed": megatron_md.runtime.cpu.is_installed(),
    "megatron_imported": "megatron.core" in __import__("sys").modules,
}))
"""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "same": True,
        "tensor_attrs": [],
        "modes": 0,
        "installed": False,
        "megatron_imported": False,
    }


def _snapshot():
    snap = {}
    for name, b in cpu.BRIDGES.items():
        if b.owner.startswith("<"):
            continue
        owner = cpu._resolve(b.owner)
        snap[name] = vars(owner).get(b.attr, "<inherited>") if isinstance(owner, type) else (
            getattr(owner, b.attr)
        )
    return snap


def test_uninstall_restores_originals():
    before = _snapshot()
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    filters_before = list(logger.filters)
    cpu.install()
    cpu.install()  # idempotent: one mode, one set of patches
    try:
        assert cpu.is_installed()
        assert len(torch.overrides._get_current_function_mode_stack()) == 1
        during = _snapshot()
        assert all(during[n] is not before[n] for n in before), "a bridge did not patch"
    finally:
        cpu.uninstall()
    cpu.uninstall()
    assert not cpu.is_installed()
    after = _snapshot()
    assert all(after[n] is before[n] for n in before)
    assert torch.overrides._get_current_function_mode_stack() == []
    assert "cuda" not in vars(torch.Tensor) and logger.filters == filters_before
    assert torch.zeros(1).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):  # the real CUDA path again
            torch.zeros(1, device="cuda")


def test_uninstall_must_run_on_installing_thread(shim):
    err = []
    th = threading.Thread(target=lambda: err.append(_raises(cpu.uninstall)))
    th.start()
    th.join()
    assert err == [True] and cpu.is_installed()


def _raises(fn):
    try:
        fn()
    except RuntimeError:
        return True
    return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_select_runtime_without_cuda():
    with pytest.raises(ValueError, match="--device"):
        select_runtime("cuda")
    auto = select_runtime("auto")
    assert auto == select_runtime("cpu") == Runtime("cpu", torch.device("cpu"), "gloo")
    assert auto.describe().startswith("runtime: cpu (gloo)")
    with pytest.raises(ValueError, match="--device"):
        select_runtime("tpu")
    assert not cpu.is_installed()  # selecting patches nothing


def test_cuda_describe_and_activate_refuses_bridges(shim):
    rt = Runtime("cuda", torch.device("cuda", 3), "nccl")
    assert rt.describe() == "runtime: cuda (nccl), device cuda:3"
    with pytest.raises(RuntimeError, match="never be active on a CUDA run"):
        activate(rt)


def test_activate_cpu_installs():
    try:
        activate(select_runtime("cpu"))
        assert cpu.is_installed()
    finally:
        cpu.uninstall()


def test_init_distributed_refuses_partial_launcher_env(single_process, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        init_distributed(select_runtime("cpu"))
    assert not torch.distributed.is_initialized()


def test_init_distributed_single_process(single_process):
    rt = select_runtime("cpu")
    try:
        assert init_distributed(rt, timeout_s=60) == (0, 1, 0)
        assert init_distributed(rt) == (0, 1, 0)  # idempotent
        assert torch.distributed.get_backend() == "gloo"
    finally:
        destroy_distributed()
    assert not torch.distributed.is_initialized()
    destroy_distributed()  # idempotent
