"""``MDOptimizer``: a torch optimizer over 2-D matrices that runs the MD phases of ``md.py`` (batched over
same-shape matrices by ``md_batched.py``) around one base update of ``bases.py`` (docs/optimizers.md §1); the
single-process classes of ``md_variants.py`` (MuonMD, AdamMD, ...) and megatron's glue build on it.

It projects every managed matrix onto its sphere at construction and starts the gains at exactly 1,
so the first forward equals the projected model's. 1-D parameters (norm gains, biases) are refused:
they belong in a plain AdamW beside this optimizer.

Tensor-parallel glue subclasses and overrides ``reducer_for(p)`` (a Reducer that all-reduces over the
param's TP group) and ``orthogonalize_all`` (or ``orthogonalizer_for(p, hp)``); nothing in this module
touches process groups.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch

from .bases import BaseUpdate
from .blocks import Block, get_block
from .geometry import project_direction_
from . import md_batched
from .md import (
    MDHyperParams,
    Orthogonalize,
    current_gains,
    default_orthogonalize,
    gain_split,
    init_md_state,
    matrix_params,
    md_blocks,
    md_finish_,
    md_prepare,
    preserved_gains,
    recover_direction,
)
from .msign import msign
from .qk_clip import scale_row_gains_
from .sphere import LOCAL_REDUCER, Reducer

ROW_GAIN_MODES = ("rowcol", "row")  # gain layouts (``embed`` resolved) with a gain per row of the QKV matrix


class MDOptimizer(torch.optim.Optimizer):
    """MD decoupling around a pluggable base update (``bases.py``: ``MuonBase``, ``AdamBase``, ``LionBase``,
    ``SoapBase``, ``AdEMAMixBase``, ``NormalizedBase``)."""

    # False: every matrix gets its state at construction. A subclass whose param groups are narrowed
    # after construction (a distributed optimizer handing each rank the matrices it owns) sets True:
    # state is then made on a matrix's first step, or by ``_init_group`` before a checkpoint load.
    lazy_state = False
    # True: every matrix through md.py's per-matrix phases (the reference; --md-per-matrix-step)
    per_matrix = False

    def __init__(self, params: Iterable[Any], defaults: dict, base: BaseUpdate):
        self.base = base  # set before super().__init__, which calls add_param_group
        self._blocks: dict[torch.Tensor, tuple[list[Block], list[Block]]] = {}  # (update, sphere) blocks
        self._seeds: dict[torch.Tensor, tuple] = {}  # preserve_init gains awaiting a lazily made state
        self._slabs: dict[tuple, md_batched.Slab] = {}  # stacked state of same-shape matrices (md_batched.py)
        super().__init__(params, defaults)

    # --- hooks for tensor-parallel glue -----------------------------------------------------------
    def reducer_for(self, p: torch.Tensor) -> Reducer:
        """Reductions over ``p``'s axes; the local one sums within this process."""
        return LOCAL_REDUCER

    def base_for(self, hp: MDHyperParams) -> BaseUpdate:
        """The base update of a param group (one for the whole optimizer unless overridden)."""
        return self.base

    def orthogonalizer_for(self, p: torch.Tensor, hp: MDHyperParams) -> Orthogonalize | None:
        """``(U_block, global_block_shape) -> msign(U_block)``; None uses local msign with the group's NS options."""
        return None

    # --- construction --------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        params = matrix_params(param_group, type(self).__name__)
        super().add_param_group({**param_group, "params": params})
        group = self.param_groups[-1]
        hp = MDHyperParams.from_group(group)
        hp.validate()
        if hp.split_heads_update and not self.base_for(hp).orthogonalizes:
            raise ValueError(f"split_heads_update splits the Newton-Schulz orthogonalisation per attention head; "
                             f"the {type(self.base_for(hp)).__name__} has none (use MuonMD, or drop it)")
        with torch.no_grad():
            for p in group["params"]:
                self._init_param(p, hp, project=True, state=not self.lazy_state)

    def _init_param(self, p: torch.Tensor, hp: MDHyperParams, project: bool, state: bool = True) -> None:
        """``project``: put ``p`` on its sphere (or, with ``preserve_init``, keep ``p`` and put its magnitudes
        in the gains); ``state``: make the optimizer state now (else on the first step)."""
        if project and hp.preserve_init:
            self._seeds[p] = preserved_gains(p.data, self._param_blocks(p, hp)[1], hp, self.reducer_for(p))
        elif project:
            project_direction_(p.data, self._param_blocks(p, hp)[1], hp.geometry, self.reducer_for(p))
        if state and not self.state.get(p):
            init_md_state(p, self.state[p], hp, self.base_for(hp), self._seeds.pop(p, None), self.reducer_for(p))

    def _param_blocks(self, p: torch.Tensor, hp: MDHyperParams) -> tuple[list[Block], list[Block]]:
        """(update blocks, sphere blocks) of ``p`` (``md.md_blocks``), cached."""
        blocks = self._blocks.get(p)
        if blocks is None:
            blocks = self._blocks[p] = md_blocks(p, hp, self.reducer_for(p))
        return blocks

    # --- step ------------------------------------------------------------------------------------
    def md_groups(self) -> list[dict]:
        """The param groups the MD step runs on: all of them here; a subclass that steps some groups its own
        way (Manifold Muon's manifold groups) narrows this."""
        return self.param_groups

    def prepare_group(self, group: dict) -> None:
        """Hook run on each param group before its step (e.g. a schedule for extra group options)."""

    def phase(self, name: str):
        """Hook around each phase of the step (md-prepare, md-orthogonalize, md-finish): the glue times them."""
        return contextlib.nullcontext()

    def orthogonalize_all(self, requests: list[tuple]) -> list[list[torch.Tensor]]:
        """msign of every block of every matrix: ``requests`` = ``[(p, hp, [(U_block, global_shape), ...])]``.

        Here in this process: blocks of the same shape and Newton-Schulz settings as one batched msign (one by
        one with ``per_matrix``, or where ``orthogonalizer_for`` gives a function); distributed glue overrides
        this to batch them across ranks and give each matrix one owner."""
        out: list[list] = [[None] * len(blocks) for _, _, blocks in requests]
        batches: dict[tuple, list[tuple[int, int, torch.Tensor]]] = {}
        for i, (p, hp, blocks) in enumerate(requests):
            fn = self.orthogonalizer_for(p, hp)
            for j, (U, shape) in enumerate(blocks):
                if fn is None and not self.per_matrix:
                    key = (tuple(U.shape), U.dtype, U.device, hp.ns_steps, hp.ns_coefficients)
                    batches.setdefault(key, []).append((i, j, U))
                else:
                    out[i][j] = (fn or default_orthogonalize(hp))(U, shape)
        for (_, _, _, steps, coefficients), items in batches.items():
            O = msign(torch.stack([U for _, _, U in items]), steps=steps, coefficients=coefficients)
            for (i, j, _), o in zip(items, O.unbind(0)):
                out[i][j] = o
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """Every matrix in three phases (``md.py``): prepare (gain gradients, Ĝ, base direction), orthogonalise
        the Muon-base blocks of all matrices together, finish (step, sphere, gain Adam, re-fused weight).
        Same-shape matrices run each phase as one stack (``md_batched.py``) unless ``per_matrix`` is set."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        waiting, stacks = [], []
        with self.phase("md-prepare"):  # (bases that do not orthogonalise also finish here)
            for index, group in enumerate(self.md_groups()):
                self.prepare_group(group)
                hp = MDHyperParams.from_group(group)
                base = self.base_for(hp)
                buckets: dict[tuple, list[torch.Tensor]] = {}
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if not self.state[p]:  # e.g. state dropped by a load without optimizer state
                        self._init_param(p, hp, project=False)
                    r = self.reducer_for(p)
                    blocks, sphere_blocks = self._param_blocks(p, hp)
                    if not self.per_matrix and md_batched.batchable(self.state[p], hp, base, blocks, sphere_blocks):
                        buckets.setdefault(md_batched.bucket_key(p, blocks, r), []).append(p)
                        continue
                    prep = md_prepare(p, p.grad, self.state[p], hp, base, r, blocks, sphere_blocks)
                    if base.orthogonalizes:
                        waiting.append((p, hp, base, r, prep))
                    else:
                        md_finish_(p, prep, self.state[p], hp, base, r)
                for key, params in buckets.items():
                    slab = self._slab((index, key), params)
                    if slab is None:  # states that cannot share a stack (e.g. different step counts): one by one
                        for p in params:
                            r = self.reducer_for(p)
                            prep = md_prepare(p, p.grad, self.state[p], hp, base, r, *self._param_blocks(p, hp))
                            if base.orthogonalizes:
                                waiting.append((p, hp, base, r, prep))
                            else:
                                md_finish_(p, prep, self.state[p], hp, base, r)
                        continue
                    r, blocks = self.reducer_for(params[0]), self._param_blocks(params[0], hp)[0]
                    stacks.append((params, slab, hp, base, r, md_batched.prepare(params, slab, hp, base, r, blocks)))
        requests = [(p, hp, prep.blocks_to_orthogonalize()) for p, hp, _, _, prep in waiting]
        for params, _, hp, base, _, prep in stacks:
            if base.orthogonalizes:
                parts = [get_block(prep.direction, b) for b in prep.blocks]
                requests += [(p, hp, [(part[i], b.shape) for part, b in zip(parts, prep.blocks)])
                             for i, p in enumerate(params)]
        with self.phase("md-orthogonalize"):
            done = self.orthogonalize_all(requests)
        with self.phase("md-finish"):
            for (p, hp, base, r, prep), orth in zip(waiting, done):
                md_finish_(p, prep, self.state[p], hp, base, r, orth)
            done = done[len(waiting):]
            for params, slab, hp, base, r, prep in stacks:
                orth = None
                if base.orthogonalizes:
                    outs, done = done[:len(params)], done[len(params):]
                    orth = md_batched.stack_outputs(outs, len(prep.blocks))
                md_batched.descend_(prep, slab, hp, base, r, orth)
            # the gains' Adam of every stack together, then each stack's one write into its parameters
            md_batched.update_gains_([(slab, hp, prep) for _, slab, hp, _, _, prep in stacks])
            for params, slab, hp, _, _, prep in stacks:
                md_batched.write_(params, prep, slab, hp)
        return loss

    def _slab(self, key: tuple, params: list[torch.Tensor]) -> "md_batched.Slab | None":
        """The bucket's stacked state, rebuilt when anything outside the step replaced or wrote it."""
        states = [self.state[p] for p in params]
        slab = self._slabs.get(key)
        if slab is not None and slab.valid(params, states):
            return slab
        self._slabs.pop(key, None)
        if not md_batched.Slab.compatible(states):
            return None
        slab = md_batched.Slab(params, states)
        if not md_batched.counters_equal(slab):
            return None
        self._slabs[key] = slab
        return slab

    # --- QK-clip -------------------------------------------------------------------------------
    def check_scale_rows(self, p: torch.Tensor) -> str:
        """Before training: how ``scale_rows_`` will treat ``p`` (a line for the log), or a ValueError naming
        the flag when it cannot."""
        hp = self._hp_of(p)
        if hp.gains_mode not in ROW_GAIN_MODES:
            raise ValueError(f"--qk-clip scales MD's row gains of the query and key rows, and --md-gains "
                             f"{hp.gains_mode} gives the QKV matrix none: use --md-gains rowcol or row, or drop "
                             "--qk-clip (a row factor on the fused weight alone would be undone when the next "
                             "step puts the direction back on its sphere)")
        return "MD: into the Q/K row gains (the direction stays on its sphere)"

    @torch.no_grad()
    def scale_rows_(self, p: torch.Tensor, factors: torch.Tensor) -> None:
        """QK-clip's row ``factors`` on ``p``: into its row gains and its rows (``optim/qk_clip.py``). A stacked
        state (``md_batched.Slab``) that was current stays current: this write is accounted for."""
        current = [s for s in self._slabs.values() if any(q is p for q in s.params)
                   and all(s.data[k]._version == s.versions[k] for k in s.data)]
        scale_row_gains_(p, self.state[p], self._hp_of(p), factors)
        for slab in current:
            slab.stamp()

    # --- inspection ----------------------------------------------------------------------------
    def _hp_of(self, p: torch.Tensor) -> MDHyperParams:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return MDHyperParams.from_group(group)
        raise KeyError(f"parameter of shape {tuple(p.shape)} is not managed by this optimizer")

    def gains(self, p: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(γ_row, γ_col) after the parametrisation φ; None for an axis without gains. Low-rank gains: the
        ``[m, n]`` multiplier as γ_row; per-block Q/K/V column gains: a ``[q+k+v, n]`` pattern as γ_col
        (``gains.py``)."""
        hp = self._hp_of(p)
        return current_gains(self.state[p], hp, gain_split(p, hp))

    def direction(self, p: torch.Tensor) -> torch.Tensor:
        """Ŵ = W ⊘ (γ_r γ_cᵀ), the on-sphere direction of ``p`` (a new tensor)."""
        with torch.no_grad():
            clamp = not self._hp_of(p).gains_no_clamp
            return recover_direction(p.detach().to(torch.float32), *self.gains(p), clamp=clamp)


OPTIONS = ("sphere", "gains", "gain_param", "weight_decay", "gains_weight_decay", "qkv_split_shapes",
           "radius_scale", "out_proj", "preserve_init", "tangent_grad", "normalize_update", "gains_min",
           "gains_no_clamp", "gains_bias_correction", "split_qkv_gains", "gains_rank", "gains_lowrank_init_std",
           "gains_lowrank_min", "gains_lowrank_seed", "sphere_kind", "sphere_iters", "ball", "split_heads",
           "split_heads_update", "head_dim")


def md_options(options: dict, gain_param: str | None = None) -> dict:
    """The MD options every optimizer here takes by keyword (``OPTIONS``); anything else is a typo.

    ``gmin`` is the earlier name of the floor of ``direct`` gains: it still sets ``gains_min`` for them, and (as
    before) does nothing for the other parametrisations."""
    options = dict(options)
    if "gmin" in options:
        gmin = options.pop("gmin")
        if (gain_param or options.get("gain_param", "softplus")) == "direct":
            options.setdefault("gains_min", gmin)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"unknown MD option(s) {unknown}; the options are {OPTIONS}")
    return options
