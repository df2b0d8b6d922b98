"""The MD step batched over same-shape matrices: every phase of ``md.py``'s ``md_prepare`` / ``md_finish_`` on a
stack ``[k, m, n]``, so the number of dispatched ops (CUDA launches) per step depends on the number of distinct
shapes, not on the number of matrices (docs/performance.md, "The optimizer step"). On CPU, where a dispatch costs
little and a copy a pass over memory, matrices above ``msign.CPU_BATCH_MAX_ELEMENTS`` each make a stack of one
(``bucket_key``).

The per-matrix path in ``md.py`` stays the reference; this one computes the same formulas in the same order on
stacked tensors (equal to fp32 rounding: a reduction over a stacked axis may round differently). It covers the
configurations users train with — flat / row / column sphere (l2, no ball, whole matrix or Megatron's fused Q/K/V
blocks), row / column / row+column / flat gains or none under any parametrisation, and the Muon, Adam and Lion
bases (every base that says it ``stacks``: the engine calls the base's own stacked update, ``bases.BaseUpdate``);
anything else (Sinkhorn, spectral and orthogonal spheres, per-head blocks, low-rank or per-block gains, the
tangent gradient, the normalised update, SOAP, AdEMAMix, normalised momentum) takes the per-matrix path.

The matrices' optimizer state lives in one stacked tensor per key (a ``Slab``); ``state[p][key]`` is a view of
its row, so checkpoints see ordinary per-matrix state. A slab notices when anything outside the step replaced or
wrote its tensors (a checkpoint load) and is rebuilt from ``state``: the step counters are read back to the host
only then, so a steady-state step makes no device→host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .adam import adam_foreach_
from .bases import BaseUpdate
from .blocks import Block, block_view
from .gains import DIRECTION_CLAMP, gain_param, rho_floor
from .hyperparams import MDHyperParams
from .msign import CPU_BATCH_MAX_ELEMENTS
from .sphere import _NORM_FLOOR, Reducer, flat_radius

COUNTERS = ("gain_step", "step")  # 0-dim step counters: mirrored on the host, read back only on a rebuild


def batchable(state: dict, hp: MDHyperParams, base: BaseUpdate, blocks: Sequence[Block],
              sphere_blocks: Sequence[Block]) -> bool:
    """True when the batched path computes this matrix's step (else ``md.py``'s per-matrix one)."""
    if not base.stacks or hp.tangent_grad or hp.normalize_update or hp.split_qkv_gains:
        return False
    if hp.gains_mode not in ("rowcol", "row", "col", "flat", "none") or "rho_lowrank_a" in state:
        return False
    if list(blocks) != list(sphere_blocks) or not hp.geometry.plain(blocks):
        return False
    whole = len(blocks) == 1 and blocks[0].rows is None
    if not whole and not all(b.grouped is not None for b in blocks):
        return False
    return whole or hp.sphere_mode in ("flat", "row")  # column norms per Q/K/V block: per matrix


def bucket_key(p: torch.Tensor, blocks: Sequence[Block], reducer: Reducer) -> tuple:
    """Matrices that can share a stack: same shape, dtypes, device, blocks and reduction group. On CPU a matrix
    above ``CPU_BATCH_MAX_ELEMENTS`` is a stack of its own: there a stack saves no dispatch worth its copies (the
    weights and gradients stacked, the result written back: three passes over them), and Newton-Schulz loops over
    such matrices anyway (measured at dense-181m: the copies were a tenth of MD's overhead over Muon)."""
    layout = tuple(b.grouped for b in blocks)
    alone = id(p) if p.device.type == "cpu" and p.numel() > CPU_BATCH_MAX_ELEMENTS else None
    return (tuple(p.shape), p.dtype, p.grad.dtype, p.device, layout, type(reducer),
            id(getattr(reducer, "group", None)), getattr(reducer, "dim", None), alone)


class Slab:
    """The state of a bucket's matrices stacked per key; ``state[p][key]`` are views of its rows."""

    def __init__(self, params: list[torch.Tensor], states: list[dict]):
        self.params = list(params)
        self.data = {key: torch.stack([s[key] for s in states]) for key in states[0]}
        for i, s in enumerate(states):
            for key, stacked in self.data.items():
                s[key] = stacked[i]
        self.views = {key: [s[key] for s in states] for key in self.data}
        self.buffers: dict[str, torch.Tensor] = {}  # CPU only: the step's stacks, reused (see ``buffer``)
        # one device->host read per counter, here only: the step then keeps host copies
        self.steps = {key: self.data[key].tolist() for key in COUNTERS if key in self.data}
        self.stamp()

    @staticmethod
    def compatible(states: list[dict]) -> bool:
        first = states[0]
        if not first or any(not isinstance(v, torch.Tensor) for v in first.values()):
            return False
        sig = {k: (v.shape, v.dtype, v.device) for k, v in first.items()}
        return all({k: (v.shape, v.dtype, v.device) for k, v in s.items() if isinstance(v, torch.Tensor)} == sig
                   and len(s) == len(first) for s in states[1:])

    def stamp(self) -> None:
        self.versions = {key: t._version for key, t in self.data.items()}

    def valid(self, params: list[torch.Tensor], states: list[dict]) -> bool:
        """Still the state: same matrices, every entry our view, nothing written since our last step."""
        if len(params) != len(self.params) or any(a is not b for a, b in zip(params, self.params)):
            return False
        for key, views in self.views.items():
            if self.data[key]._version != self.versions[key]:
                return False
            if any(s.get(key) is not v for s, v in zip(states, views)) or any(len(s) != len(self.data) for s in states):
                return False
        return True

    def buffer(self, name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """An fp32 ``shape`` buffer for this step. On CPU the same one every step: a fresh allocation of this
        size comes from the OS and costs a page fault per page, measured as much as five passes over it; on a
        GPU the caching allocator already reuses memory, and a kept buffer would only hold it."""
        if device.type != "cpu":
            return torch.empty(shape, dtype=torch.float32, device=device)
        buf = self.buffers.get(name)
        if buf is None or buf.shape != shape:
            buf = self.buffers[name] = torch.empty(shape, dtype=torch.float32, device=device)
        return buf

    def step_of(self, key: str) -> int | float | None:
        """The bucket's counter (all matrices of a bucket step together), or None when they differ."""
        values = self.steps.get(key)
        return None if not values or any(v != values[0] for v in values) else values[0]

    def advance(self, key: str) -> int | float:
        self.data[key].add_(1)
        self.steps[key] = [v + 1 for v in self.steps[key]]
        return self.steps[key][0]


# ----------------------------------------------------------------------------------------------------
# The sphere's factor of a stack


def sphere_scale_stacked(W: torch.Tensor, blocks: Sequence[Block], mode: str, reducer: Reducer,
                         radius_scale: float, rows_sq: torch.Tensor | None = None) -> torch.Tensor:
    """``sphere.blocks_sphere_scale`` of each matrix of the stack: ``[k, 1, 1]`` (flat), ``[k, m, 1]`` (row, or
    flat per Q/K/V block) or ``[k, 1, n]`` (column). ``rows_sq``: the rows' squared norms, when already known."""
    if mode == "col":
        sq = reducer.complete(W.square().sum(dim=-2, keepdim=True), "rows")
        return sq.sqrt_().clamp_min_(_NORM_FLOOR).reciprocal_()
    if rows_sq is None:
        rows_sq = torch.linalg.vector_norm(W, dim=-1, keepdim=True).square_()  # [k, m, 1]
    if mode == "row":
        sq = reducer.complete(rows_sq, "cols")
        return sq.sqrt_().clamp_min_(_NORM_FLOOR).reciprocal_()
    if len(blocks) == 1 and blocks[0].rows is None:
        sq = reducer.complete(rows_sq.sum(dim=-2, keepdim=True), "all")
        return (radius_scale * flat_radius(blocks[0].shape)) / sq.sqrt().clamp_min(_NORM_FLOOR)
    out = torch.empty_like(rows_sq)
    for blk in blocks:
        sq = reducer.complete(block_view(rows_sq, blk).sum(dim=(1, 2, 3)), "all")
        view = block_view(out, blk)
        factor = (radius_scale * flat_radius(blk.shape)) / sq.sqrt().clamp_min(_NORM_FLOOR)
        view.copy_(factor.view(-1, 1, 1, 1).expand(view.shape))
    return out


# ----------------------------------------------------------------------------------------------------
# The phases


@dataclass
class BatchedPrepared:
    """A bucket between the phases (``md.MDPrepared`` for a stack)."""

    W: torch.Tensor  # [k, m, n] fp32: the fused weights (a view of the parameter when k = 1 and fp32)
    W_is_param: bool
    direction: torch.Tensor | None  # None: the base's fused step runs in descend_ (from ``G``)
    gain_grads: dict[str, torch.Tensor]
    blocks: list[Block]
    gains: tuple[torch.Tensor | None, torch.Tensor | None]  # the gains before the step
    scale: torch.Tensor | None = None  # the sphere's factor of the stepped Ŵ (in W), once ``descend_`` ran
    G: torch.Tensor | None = None  # the gradient, kept for a fused step


def _gains(slab: Slab, hp: MDHyperParams) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(row factor ``[k, m, 1]`` or flat ``[k, 1, 1]``, column factor ``[k, 1, n]``), None where absent."""
    gp, d = gain_param(hp.gain_param), slab.data
    if "rho_flat" in d:
        return gp.phi(d["rho_flat"]).unsqueeze(-1), None
    row = gp.phi(d["rho_row"]).unsqueeze(-1) if "rho_row" in d else None
    col = gp.phi(d["rho_col"]).unsqueeze(-2) if "rho_col" in d else None
    return row, col


def _times(t: torch.Tensor, row, col, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gains._scaled`` on a stack: ``t * row`` then ``* col`` (None skipped); a new tensor unless ``out``."""
    factors = [f for f in (row, col) if f is not None]
    if not factors:
        return t.clone() if out is None else out.copy_(t)
    res = torch.mul(t, factors[0], out=out) if out is not None else t * factors[0]
    return res.mul_(factors[1]) if len(factors) > 1 else res


@torch.no_grad()
def prepare(params: list[torch.Tensor], slab: Slab, hp: MDHyperParams, base: BaseUpdate, reducer: Reducer,
            blocks: list[Block]) -> BatchedPrepared:
    """``md.md_prepare`` on a stack: gain gradients with the old gains, Ĝ, and the base direction."""
    grads = [p.grad for p in params]
    shape, device = torch.Size((len(params), *params[0].shape)), params[0].device
    W_is_param = len(params) == 1 and params[0].dtype == torch.float32
    W = params[0].unsqueeze(0) if W_is_param else _stacked(params, slab.buffer("W", shape, device))
    single = len(grads) == 1 and grads[0].dtype == torch.float32
    G = grads[0].unsqueeze(0) if single else _stacked(grads, slab.buffer("G", shape, device))
    row, col = _gains(slab, hp)
    grads_out = {}
    # one big whole matrix on a row or flat sphere (the embedding, the LM head): the base may step it in one pass
    # in descend_, from G itself (Ĝ is not made here)
    fused = (len(params) == 1 and len(blocks) == 1 and blocks[0].rows is None and hp.sphere_mode in ("row", "flat")
             and "rho_flat" not in slab.data and base.fuses_step(G.numel()))
    if row is not None or col is not None:
        work = torch.mul(G, W, out=slab.buffer("work", shape, device)) if device.type == "cpu" else G * W
        gp = gain_param(hp.gain_param)
        if "rho_flat" in slab.data:
            d = reducer.complete(work.sum(dim=(-2, -1)), "all").unsqueeze(-1).div_(row.view(-1, 1))
            grads_out["flat"] = d.mul_(gp.phi_prime(slab.data["rho_flat"]))
        else:
            if row is not None:
                d = reducer.complete(work.sum(dim=-1), "cols").div_(row.squeeze(-1))
                grads_out["row"] = d.mul_(gp.phi_prime(slab.data["rho_row"]))
            if col is not None:
                d = reducer.complete(work.sum(dim=-2), "rows").div_(col.squeeze(-2))
                grads_out["col"] = d.mul_(gp.phi_prime(slab.data["rho_col"]))
        G_hat = scratch = None if fused else _times(G, row, col, out=work)
    else:
        aliased = len(grads) == 1 and G.data_ptr() == grads[0].data_ptr()
        # the base's result goes to a buffer of ours (kept between steps on CPU, see Slab.buffer): Ĝ's copy when the
        # base writes Ĝ and Ĝ is the parameter's own gradient, else Ĝ itself when it is our stack, else a spare
        G_hat = slab.buffer("G", shape, device).copy_(G) if base.writes_direction_grad and aliased else G
        scratch = G_hat if G_hat is not G or not aliased else slab.buffer("direction", shape, device)
    if fused:
        if base.has_step:
            slab.advance("step")
        return BatchedPrepared(W, W_is_param, None, grads_out, blocks, (row, col), G=G)
    return BatchedPrepared(W, W_is_param, _direction(G_hat, slab, hp, base, scratch), grads_out, blocks, (row, col))


def _stacked(tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``tensors`` as one fp32 stack in ``out`` (cast on the way when they are not fp32)."""
    if all(t.dtype == out.dtype for t in tensors):
        return torch.stack(tensors, out=out)
    torch._foreach_copy_(list(out.unbind(0)), tensors)
    return out


def _direction(G_hat: torch.Tensor, slab: Slab, hp: MDHyperParams, base: BaseUpdate,
               scratch: torch.Tensor | None) -> torch.Tensor:
    step = slab.advance("step") if base.has_step else None
    return base.direction_stacked(G_hat, slab.data, hp, scratch, step)


@torch.no_grad()
def descend_(prep: BatchedPrepared, slab: Slab, hp: MDHyperParams, base: BaseUpdate, reducer: Reducer,
             orthogonalized: Sequence[torch.Tensor] | None = None) -> None:
    """``md.md_finish_``'s first half on a stack: Ŵ recovered (in ``prep.W``), stepped by the base update
    (``orthogonalized``: each block's msign, stacked), and the sphere's factor of the result in ``prep.scale``."""
    # Ŵ = W ⊘ (γ_r γ_cᵀ) recovered in place: W is the stack (or, alone and fp32, the parameter), rewritten at
    # the end anyway. A division per gain axis (gains.recover_direction multiplies by reciprocals: one rounding
    # apart, two ops fewer)
    W_hat = prep.W
    gains = tuple(None if g is None else g if hp.gains_no_clamp else g.clamp_min(DIRECTION_CLAMP) for g in prep.gains)
    decay = 1.0 - hp.lr * hp.weight_decay
    step = slab.steps["step"][0] if base.has_step else None  # advanced in prepare
    rows_sq = None
    if prep.direction is None:  # the base's fused step (see prepare)
        rows_sq = base.step_rows_stacked_(W_hat, prep.G, prep.gains, gains, decay, slab.data, hp, step)
        if rows_sq is None:  # it declined after all (a compile failure): the phases, eagerly
            G_hat = _times(prep.G, *prep.gains) if any(g is not None for g in prep.gains) else prep.G
            prep.direction = base.direction_stacked(G_hat, slab.data, hp, None, step)
    if rows_sq is None:
        for g in gains:
            if g is not None:
                W_hat.div_(g)
        if hp.weight_decay:
            W_hat.mul_(decay)
        base.descend_stacked_(W_hat, prep.direction, slab.data, hp, prep.blocks, orthogonalized, step, reducer)
    prep.scale = sphere_scale_stacked(W_hat, prep.blocks, hp.sphere_mode, reducer, hp.radius_scale, rows_sq)


@torch.no_grad()
def update_gains_(buckets: Sequence[tuple[Slab, MDHyperParams, BatchedPrepared]]) -> None:
    """Adam on the raw gains of every bucket: one set of foreach ops per distinct set of Adam settings (the same
    elementwise arithmetic as ``adam.adam_``, so each gain equals the per-matrix step's bit for bit)."""
    jobs: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}
    for slab, hp, prep in buckets:
        if not prep.gain_grads:
            continue
        step = slab.advance("gain_step")
        key = (step, hp.gains_lr, tuple(hp.gains_betas), hp.gains_eps, hp.effective_gains_weight_decay,
               hp.gains_bias_correction, rho_floor(hp))
        d = slab.data
        jobs.setdefault(key, []).extend(
            (d[f"rho_{a}"], g, d[f"exp_avg_{a}"], d[f"exp_avg_sq_{a}"]) for a, g in prep.gain_grads.items())
    for (step, lr, betas, eps, wd, bias_correction, floor), items in jobs.items():
        rho, grad, m, v = (list(x) for x in zip(*items))
        adam_foreach_(rho, grad, m, v, step, lr, betas, eps, wd, bias_correction)
        if floor is not None:
            torch._foreach_clamp_min_(rho, floor)


@torch.no_grad()
def write_(params: list[torch.Tensor], prep: BatchedPrepared, slab: Slab, hp: MDHyperParams) -> None:
    """``md.md_finish_``'s end on a stack: sphere and new gains in one write into the parameters."""
    row, col = _gains(slab, hp) if prep.gain_grads else prep.gains
    scale = prep.scale
    # as md_finish_: a scalar or row factor joins the row gains (or the column gains when there are no row
    # gains), a column factor the column gains
    if scale.shape[-1] != 1:
        col = scale if col is None else scale * col
    elif scale.shape[-2] != 1 or row is not None:
        row = scale if row is None else scale * row
    elif col is not None:
        col = col * scale
    else:
        row = scale
    res = _times(prep.W, row, col, out=prep.W)
    if not prep.W_is_param:
        torch._foreach_copy_(params, list(res.unbind(0)))
    slab.stamp()


def stack_outputs(outputs: list[list[torch.Tensor]], nblocks: int) -> list[torch.Tensor]:
    """Per matrix, per block msign outputs -> per block, one ``[k, rows, n]`` stack: a view when the engine's
    outputs already are consecutive entries of one batch (its usual case), else a copy."""
    out = []
    for parts in ([o[b] for o in outputs] for b in range(nblocks)):
        view = parts[0].unsqueeze(0) if len(parts) == 1 else _consecutive(parts)
        out.append(torch.stack(parts) if view is None else view)
    return out


def _consecutive(parts: list[torch.Tensor]) -> torch.Tensor | None:
    base, first = parts[0]._base, parts[0]
    if base is None or base.ndim != 3 or tuple(base.shape[1:]) != tuple(first.shape) or not base.is_contiguous():
        return None
    size, start = first.numel(), first.storage_offset() - base.storage_offset()
    if start % size or any(p._base is not base or p.storage_offset() - base.storage_offset() != start + i * size
                           or p.stride() != first.stride() for i, p in enumerate(parts)):
        return None
    return base[start // size:start // size + len(parts)]


def counters_equal(slab: Slab) -> bool:
    return all(slab.step_of(k) is not None for k in COUNTERS if k in slab.steps)
