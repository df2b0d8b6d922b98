"""Every megatron-core internal megatron_md relies on, in one table: what we touch, why, and a check.

megatron-core has no public hook for these; each was read in megatron-core 0.19.2 (``CHECKED_AGAINST``).
``tests/mcore/test_compat.py`` runs every entry's ``check`` against the installed megatron-core, so an
upgrade that renames or reshapes one fails there, by name, before a run fails somewhere far away.
Nothing here acts at import: the one global we change is changed by ``install()``, which the model
build calls. The CPU runtime's stand-ins for CUDA (``runtime/cpu.py``) keep their own bridge table; the
two of them that replace megatron-core private functions are listed here too.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

CHECKED_AGAINST = "0.19.2"

# Attributes our tagging (mcore/md_checkpoint.tag_md_params) sets on model params. megatron copies only
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


_EO = "megatron.core.optimizer.emerging_optimizers"
_DO = "megatron.core.optimizer.distrib_optimizer"

INTERNALS: dict[str, Internal] = {e.name.rsplit(".", 1)[-1]: e for e in (
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
    Internal(_DO, "DistributedOptimizer._copy_main_params_to_model_params", "called",
             "after MD / Manifold Muon project weights outside a step, the model params must see them",
             _params("self"), "(self)"),
    Internal("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
             "called", "the same, for bf16 without the distributed optimizer", _params("self"), "(self)"),
    Internal("megatron.core.optimizer.optimizer", "param_group_identifier_keys", "MD's groups set is_decoupled_lr",
             "megatron pairs saved and current param groups on load by this fixed tuple of keys, none of them ours; "
             "MD's embedding and LM-head groups can agree on all of them and would swap state. is_decoupled_lr is "
             "in the tuple and read by nothing else in megatron-core, so MD's groups carry their role there "
             "('md:embedding'). Kept, not moved to a key of our own, because every MD checkpoint saved so far is "
             "matched by it", lambda t: isinstance(t, tuple) and "is_decoupled_lr" in t and "max_lr" in t,
             "a tuple of group keys holding is_decoupled_lr and max_lr"),
    Internal("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "replaced by runtime/cpu.py (CPU only)",
             "megatron's RNG tracker reads the CUDA generator; on CPU it reads torch's",
             _params("device", "clone", "graph_safe"), "(device, clone, graph_safe)"),
    Internal("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", "replaced by runtime/cpu.py (CPU only)",
             "the same, for restoring RNG state", _params("new_state", "device", "graph_safe"),
             "(new_state, device, graph_safe)"),
)}


def get(key: str) -> Any:
    """The internal named ``key`` in ``INTERNALS`` (its last name component)."""
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
