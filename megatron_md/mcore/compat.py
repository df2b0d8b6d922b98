"""Every megatron-core internal megatron_md relies on, in one table: what we touch, why, and a check.

megatron-core has no public hook for these; each was read in megatron-core 0.19.2 (``CHECKED_AGAINST``).
``tests/mcore/test_compat.py`` runs every entry's ``check`` against the installed megatron-core, so an
upgrade that renames or reshapes one fails there, by name, before a run fails somewhere far away.
Nothing here acts at import: the globals we change are changed by ``install()``, which the model build
calls, and by ``install_multi_tensor_kernels()``, which the optimizer build calls. The CPU runtime's
stand-ins for CUDA (``runtime/cpu.py``) keep their own bridge table; the two of them that replace
megatron-core private functions are listed here too.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

CHECKED_AGAINST = "0.19.2"

# Attributes our tagging (mcore/param_tags.tag_params) sets on model params. megatron copies only
# the keys of _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS onto the fp32 master params it makes for bf16 training,
# so MD's routing and state names would be lost on them without these keys.
PARAM_ATTRIBUTES = {"md_key": None, "md_swiglu": False}


@dataclass(frozen=True)
class Internal:
    module: str
    name: str  # attribute path inside ``module`` ("Class.method" for a method)
    use: str  # what we do with it
    reason: str
    check: Callable[[Any], bool]  # True when the installed object still looks as we use it
    expected: str  # what ``check`` expects, for the failure message

    def resolve(self) -> Any:
        obj = importlib.import_module(self.module)
        for part in self.name.split("."):
            obj = getattr(obj, part)
        return obj


def _params(*names: str) -> Callable[[Any], bool]:
    def check(fn) -> bool:
        return callable(fn) and list(inspect.signature(fn).parameters)[: len(names)] == list(names)
    return check


def _calls_init_group(fn) -> bool:
    return _params("opt", "config")(fn) and "_init_group(group, skip_non_grad_params=False)" in inspect.getsource(fn)


def _source_has(*fragments: str) -> Callable[[Any], bool]:
    """The object's source holds every fragment (whitespace ignored): megatron still calls what we replace
    the way we rely on."""
    def check(obj) -> bool:
        try:
            src = "".join(inspect.getsource(obj).split())
        except (OSError, TypeError):
            return False
        return all("".join(f.split()) in src for f in fragments)
    return check


def _all(*checks: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda obj: all(c(obj) for c in checks)


_EO = "megatron.core.optimizer.emerging_optimizers"
_DO = "megatron.core.optimizer.distrib_optimizer"
_CG = "megatron.core.optimizer.clip_grads"
_KERNEL = ("chunk_size", "noop_flag", "tensor_lists")

_ENTRIES = (
    Internal("megatron.core.tensor_parallel.layers", "_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS", "install() adds keys",
             "the only param attributes megatron copies onto bf16 master params; MD's md_key/md_swiglu must survive "
             "that copy", lambda d: isinstance(d, dict) and "partition_dim" in d, "a dict of attribute defaults"),
    Internal(_EO, "_EMERGING_OPTIMIZERS", "families add their entries at build",
             "megatron-core's optimizer registry: get_megatron_optimizer builds any name found there, with its "
             "param groups, bf16 masters and (layer-wise) distributed optimizers",
             lambda d: isinstance(d, dict) and "muon" in d, "a dict of EmergingOptimizerEntry with 'muon'"),
    Internal(_EO, "EmergingOptimizerEntry", "builds registry entries", "the registry's entry type",
             lambda c: set(getattr(c, "__dataclass_fields__", {})) >= {"optimizer_cls", "init_state_fn",
                                                                       "config_to_kwargs", "default_param_overrides"},
             "a dataclass with optimizer_cls, init_state_fn, config_to_kwargs, default_param_overrides"),
    Internal(_EO, "_eopt_init_state_fn", "passed as our entries' init_state_fn",
             "creates state before a torch_dist load by calling the optimizer's _init_group(group, "
             "skip_non_grad_params=False), which our optimizers override", _calls_init_group,
             "(opt, config) calling opt._init_group(group, skip_non_grad_params=False)"),
    Internal(_DO, "HAVE_APEX_OR_TE", "read",
             "without Apex or TE the distributed optimizer's inner Adam is torch's, whose state a load must "
             "prepare (mcore/optimizer_checkpoint.py)", lambda v: isinstance(v, bool), "a bool"),
    Internal(_DO, "DistributedOptimizer._set_main_param_and_optimizer_states", "wrapped on each instance",
             "a fully_reshardable load hands it no 'step' for torch AdamW; the wrapper marks it absent",
             _params("self", "model_param", "tensors"), "(self, model_param, tensors)"),
    Internal(_DO, "DistributedOptimizer._copy_main_params_to_model_params", "called; wrapped on each instance",
             "after MD / Manifold Muon project weights outside a step, the model params must see them; every step "
             "it copies param by param, so mcore/multi_tensor.py batches its copy_ calls (it must copy into views "
             "and read nothing it wrote)",
             _all(_params("self"), _source_has("shard_model_param.data.copy_(shard_main_param)")), "(self)"),
    Internal("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
             "called; wrapped on each instance", "the same, for bf16 without the distributed optimizer",
             _params("self"), "(self)"),
    Internal("megatron.core.optimizer.optimizer", "param_group_identifier_keys", "MD's groups set is_decoupled_lr",
             "megatron pairs saved and current param groups on load by this fixed tuple of keys, none of them ours; "
             "MD's embedding and LM-head groups can agree on all of them and would swap state. is_decoupled_lr is "
             "in the tuple and read by nothing else in megatron-core, so MD's groups carry their role there "
             "('md:embedding'). Kept, not moved to a key of our own, because every MD checkpoint saved so far is "
             "matched by it", lambda t: isinstance(t, tuple) and "is_decoupled_lr" in t and "max_lr" in t,
             "a tuple of group keys holding is_decoupled_lr and max_lr"),
    Internal(_CG, "l2_norm_impl", "replaced by mcore/multi_tensor.py (only megatron's local fallback)",
             "without Apex/TE it is megatron.core.utils.local_multi_tensor_l2_norm: one norm per gradient and the "
             "total read to the host; ours is one _foreach_norm, left on device",
             lambda f: callable(f) and (not _is_local(f) or _params(*_KERNEL, "per_tensor")(f)),
             "a kernel (chunk_size, noop_flag, tensor_lists, per_tensor)"),
    Internal(_CG, "multi_tensor_scale_impl", "replaced by mcore/multi_tensor.py (only megatron's local fallback)",
             "without Apex/TE it is megatron.core.utils.local_multi_tensor_scale: a multiply and a copy per "
             "gradient when clipping by a Python-number coefficient",
             lambda f: callable(f) and (not _is_local(f) or _params(*_KERNEL, "scale")(f)),
             "a kernel (chunk_size, noop_flag, tensor_lists, scale)"),
    Internal(_CG, "multi_tensor_scale_tensor_impl", "set by mcore/multi_tensor.py where it is None",
             "None without TE; once set, get_grad_norm_fp32 returns the norm as a device tensor and clipping "
             "scales by a device coefficient (TE's path), so the step reads nothing back to the host",
             lambda v: v is None or callable(v), "None or a kernel"),
    Internal(_CG, "get_grad_norm_fp32", "runs with our kernels",
             "its L2 path calls l2_norm_impl through multi_tensor_applier and, with a tensor-scale kernel, "
             "returns total_norm.pow(1/norm_type) without a host read; all-reduces over the model-parallel "
             "group are its own and unchanged",
             _all(_params("grads_for_norm", "norm_type", "grad_stats_parallel_group"),
                  _source_has("multi_tensor_applier(l2_norm_impl, dummy_overflow_buf, [grads_for_norm], False",
                              "if multi_tensor_scale_tensor_impl is not None:",
                              "total_norm = total_norm.pow(1.0 / norm_type)")),
             "(grads_for_norm, norm_type, grad_stats_parallel_group) using l2_norm_impl and, with "
             "multi_tensor_scale_tensor_impl set, returning total_norm.pow(1.0 / norm_type)"),
    Internal(_CG, "clip_grad_by_total_norm_fp32", "runs with our kernels",
             "with a device-tensor norm it clamps the coefficient on device and scales through "
             "multi_tensor_scale_tensor_impl; with a number, through multi_tensor_scale_impl if below 1",
             _all(_params("parameters", "max_norm", "total_norm"),
                  _source_has("clip_coeff.clamp_max_(1.0)",
                              "multi_tensor_scale_tensor_impl, dummy_overflow_buf, [grads, grads], clip_coeff",
                              "elif clip_coeff < 1.0:",
                              "multi_tensor_scale_impl, dummy_overflow_buf, [grads, grads], clip_coeff")),
             "(parameters, max_norm, total_norm) scaling [grads, grads] by the scale kernels"),
    Internal("megatron.core.optimizer.optimizer", "ChainedOptimizer.get_grad_norm", "wrapped on each instance",
             "when its optimizers' grad-stat groups differ (the layer-wise optimizer beside a distributed Adam) it "
             "reads each optimizer's norm to the host ('if _grad_norm') and joins them with math.sqrt: three "
             "device->host syncs per step; ours joins the device tensors on device, the same sum of squares",
             _all(_params("self"), _source_has("grad_norms += [_grad_norm if _grad_norm else 0.0]",
                                               "grad_norm = math.sqrt(sum([x**2 for x in grad_norms]))")),
             "a method joining per-optimizer norms by math.sqrt(sum([x**2 ...]))"),
    Internal(_DO, "DistributedOptimizer._get_model_param_range_map", "called (QK-clip)",
             "the flat range of a model param that this rank's fp32 master shard covers: QK-clip scales the rows "
             "of that shard (mcore/qk_clip.py); the sharded master is what the next step starts from",
             _params("self", "param"), "(self, param) -> {'param': Range, ...}"),
    Internal(_DO, "DistributedOptimizer.__init__", "reads the group lists it builds (QK-clip)",
             "model_float16_groups / shard_fp32_from_float16_groups and model_fp32_groups / shard_fp32_groups "
             "pair each model param with its master shard",
             _source_has("self.model_float16_groups,", "self.model_fp32_groups,", "self.shard_fp32_groups,",
                         "self.shard_fp32_from_float16_groups,"),
             "an __init__ assigning the four group lists"),
    Internal("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.step_with_ready_grads",
             "the inner optimizer's step is wrapped on each instance (QK-clip)",
             "QK-clip scales the fp32 masters between the inner step and the copy into the model weights, so the "
             "bf16 weight is the clipped master's copy; that needs the inner step to come right before the copy",
             _source_has("self.optimizer.step()", "self._copy_main_params_to_model_params()"),
             "self.optimizer.step() followed by the main->model copy"),
    Internal("megatron.core.optimizer.optimizer", "FP32Optimizer.step_with_ready_grads",
             "the inner optimizer's step is wrapped on each instance (QK-clip)",
             "fp32 without the distributed optimizer: the inner optimizer steps the model params themselves",
             _source_has("self.optimizer.step()"), "a call of self.optimizer.step()"),
    Internal("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
             "reads the group lists it builds (QK-clip)",
             "float16_groups / fp32_from_float16_groups pair each bf16 model param with its fp32 master",
             _source_has("self.float16_groups.append(", "self.fp32_from_float16_groups.append(",
                         "self.fp32_from_fp32_groups.append("),
             "an __init__ appending to the three group lists"),
    Internal("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "replaced by runtime/cpu.py (CPU only)",
             "megatron's RNG tracker reads the CUDA generator; on CPU it reads torch's",
             _params("device", "clone", "graph_safe"), "(device, clone, graph_safe)"),
    Internal("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", "replaced by runtime/cpu.py (CPU only)",
             "the same, for restoring RNG state", _params("new_state", "device", "graph_safe"),
             "(new_state, device, graph_safe)"),
)


def _is_local(fn) -> bool:
    """megatron's own pure-torch stand-in for an Apex kernel (megatron.core.utils.local_multi_tensor_*)."""
    return getattr(fn, "__module__", None) == "megatron.core.utils" and fn.__name__.startswith("local_multi_tensor")


def _keyed(entries) -> dict[str, Internal]:
    """Key each entry by its last name component, or by class-qualified name where two share it (both
    optimizers' _copy_main_params_to_model_params)."""
    last = [e.name.rsplit(".", 1)[-1] for e in entries]
    return {(e.name if last.count(k) > 1 else k): e for e, k in zip(entries, last)}


INTERNALS: dict[str, Internal] = _keyed(_ENTRIES)


def get(key: str) -> Any:
    """The internal named ``key`` in ``INTERNALS`` (its last name component, or Class.method where shared)."""
    return INTERNALS[key].resolve()


def install() -> None:
    """Let megatron carry our param attributes onto its master params (idempotent; called by the model build)."""
    defaults = get("_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS")
    for attr, default in PARAM_ATTRIBUTES.items():
        defaults.setdefault(attr, default)


def register_optimizer(name: str, optimizer_cls, config_to_kwargs, default_param_overrides: dict) -> None:
    """Put ``name`` in megatron-core's optimizer registry (replacing an earlier entry of ours)."""
    get("_EMERGING_OPTIMIZERS")[name] = get("EmergingOptimizerEntry")(
        optimizer_cls=optimizer_cls, init_state_fn=get("_eopt_init_state_fn"),
        config_to_kwargs=config_to_kwargs, default_param_overrides=default_param_overrides)


def copy_main_params_to_model_params(optimizer) -> None:
    """megatron's own copy of (fp32) main params into the model params, where the wrapper has one."""
    if hasattr(optimizer, "_copy_main_params_to_model_params"):
        optimizer._copy_main_params_to_model_params()


def wrap_set_main_param_and_optimizer_states(optimizer, wrapper: Callable[[Callable], Callable]) -> None:
    """Replace a DistributedOptimizer instance's per-parameter state copy by ``wrapper(original)``."""
    optimizer._set_main_param_and_optimizer_states = wrapper(optimizer._set_main_param_and_optimizer_states)


def install_multi_tensor_kernels(l2_norm, scale, scale_by_tensor) -> bool:
    """Replace megatron's local (per-tensor) stand-ins for Apex's multi-tensor kernels in its grad-norm and
    clipping module; where Apex or TE provide the kernels, leave them. True when ours are in place."""
    import megatron.core.optimizer.clip_grads as clip_grads

    if clip_grads.l2_norm_impl is l2_norm:
        return True
    if not _is_local(clip_grads.l2_norm_impl):
        return False
    clip_grads.l2_norm_impl = l2_norm
    if _is_local(clip_grads.multi_tensor_scale_impl):
        clip_grads.multi_tensor_scale_impl = scale
    if clip_grads.multi_tensor_scale_tensor_impl is None:
        clip_grads.multi_tensor_scale_tensor_impl = scale_by_tensor
    return True


def restore_multi_tensor_kernels() -> None:
    """megatron's own local kernels back (tests compare against them)."""
    import megatron.core.optimizer.clip_grads as clip_grads
    from megatron.core import utils

    if getattr(clip_grads.l2_norm_impl, "__module__", None) != "megatron_md.mcore.multi_tensor":
        return
    clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = utils.local_multi_tensor_scale
    clip_grads.multi_tensor_scale_tensor_impl = None


def wrap_chained_grad_norm(optimizer, wrapper: Callable[[Any, Callable], Callable]) -> bool:
    """Replace a ChainedOptimizer instance's ``get_grad_norm`` by ``wrapper(optimizer, original)``; False for
    any other optimizer."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    if not isinstance(optimizer, ChainedOptimizer):
        return False
    optimizer.get_grad_norm = wrapper(optimizer, optimizer.get_grad_norm)
    return True


def wrap_copy_main_params_to_model_params(optimizer, wrapper: Callable[[Callable], Callable]) -> bool:
    """Replace an optimizer instance's main->model param copy by ``wrapper(original)``; False where it has none."""
    if not hasattr(optimizer, "_copy_main_params_to_model_params"):
        return False
    optimizer._copy_main_params_to_model_params = wrapper(optimizer._copy_main_params_to_model_params)
    return True
