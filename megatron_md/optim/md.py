"""Magnitude-Direction (MD) decoupling mathematics, shared by the MD optimizers (docs/optimizers.md §1).

A managed matrix is stored fused, ``W = diag(γ_r) · Ŵ · diag(γ_c)``: the direction ``Ŵ`` lives on a sphere,
the gains ``γ = φ(ρ)`` live in optimizer state (``gains.py``: layouts, parametrisations, gain algebra). One step
(``md_step_``) follows §1.4 in order; the base update that turns the direction gradient into a step (Muon,
Adam, Lion, SOAP, AdEMAMix, normalised momentum) is passed in (``bases.py``).

Options of the authors' code (docs/optimizers.md §1.2-1.4, §1.13): gains per row and column, per row, per column,
one per matrix (``flat``), ``embed`` (row gains, column gains on out-projections), ``lowrank``, per-block Q/K/V
column gains; parametrisations softplus / direct / offset / exp with a floor ``gains_min``; ``preserve_init``
(gains seeded with the initial norms instead of projecting the weights); the tangential gradient
(``tangent_grad``, ``--hs-p``) and the update normalised onto the sphere (``normalize_update``, ``--hs-u``);
the Sinkhorn spheres, the spectral and orthogonal sphere kinds, the ball and per-head spheres and Newton-Schulz
(``geometry.py``).

Every reduction over a matrix axis goes through a ``Reducer`` (``sphere.py``) so the same code runs on
tensor-parallel shards: a TP subclass all-reduces the partial sums when the reduced axis is sharded and
reports the global shape (radii and scale factors always use global shapes). Nothing here talks to
process groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .adam import adam_
from .blocks import Block, get_block, matrix_blocks
from .gains import (
    _scaled,
    current_gains,
    direction_grad,
    gain_grads_fused,
    gain_param,
    init_gain_state,
    lowrank_grads,
    recover_direction,
    rho_floor,
)
from .geometry import SINKHORN, project_direction_, sphere_factors
from .msign import msign
from .sphere import LOCAL_REDUCER, Reducer, blocks_sphere_scale, tangent_

from .bases import BaseUpdate
from .hyperparams import MDHyperParams  # (also imported from here: the step's public names)

MaybeTensor = torch.Tensor | None


def matrix_params(param_group: dict, owner: str) -> list[torch.Tensor]:
    """The group's params as a list, refusing anything that is not a 2-D weight matrix."""
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    for p in params:
        if p.ndim != 2:
            raise ValueError(
                f"{owner} manages 2-D weight matrices only, got a parameter of shape {tuple(p.shape)}; put "
                "1-D parameters (norm gains, biases) in a plain torch.optim.AdamW next to it"
            )
    return params


# ----------------------------------------------------------------------------------------------------
# Per-matrix state and the MD step in phases


def init_md_state(p: torch.Tensor, state: dict, hp: MDHyperParams, base: BaseUpdate,
                  seed: tuple[MaybeTensor, MaybeTensor] | None = None, reducer: Reducer = LOCAL_REDUCER) -> None:
    """Gains at exactly 1 (ρ0 = φ⁻¹(1)), or at ``seed`` (``preserve_init``), with zero Adam moments, plus the
    base update's state."""
    init_gain_state(p, state, hp, seed, gain_split(p, hp), reducer)
    state["gain_step"] = torch.tensor(0.0)
    base.init_state(p, state)


def gain_split(p: torch.Tensor, hp: MDHyperParams) -> tuple[int, int, int] | None:
    """The Q/K/V row counts when ``p``'s column gains are per block (``split_qkv_gains`` on a fused QKV)."""
    return resolve_split_shapes(p, hp) if hp.split_qkv_gains else None


def preserved_gains(W: torch.Tensor, blocks: list[Block], hp: MDHyperParams,
                    reducer: Reducer = LOCAL_REDUCER) -> tuple[MaybeTensor, MaybeTensor]:
    """``preserve_init``: gains that hold ``W``'s magnitudes so that ``W = γ ⊙ Π(W)`` stays the model's weight.

    The sphere's factor ``s`` (``Π(W) = s ⊙ W``) is a scalar (flat), a row factor (row sphere; flat with Q/K/V
    blocks) or a column factor (col sphere); the gains are ``1/s`` on the axis that can hold it (row gains win
    for a scalar under ``rowcol``). Returns ``(γ_r or the flat γ, γ_c)``; the other axis stays at 1.
    """
    mode, gains, geo = hp.sphere_mode, hp.gains_mode, hp.geometry
    if mode in ("col", *SINKHORN) and len(blocks) > 1:
        raise ValueError(f"preserve_init cannot hold per-block (or per-head) column norms of a fused QKV matrix in "
                         f"one column gain; use the flat or row sphere with preserve_init, not {mode!r}")
    if geo.plain(blocks):
        s = blocks_sphere_scale(W.to(torch.float32), blocks, mode, reducer, hp.radius_scale)
    else:  # Sinkhorn: a row and a column factor, held by the row and column gains
        s, s_col = sphere_factors(W.to(torch.float32, copy=True), blocks, geo, reducer)
        if s is not None and s_col is not None:
            if gains != "rowcol":
                raise ValueError(f"preserve_init on the {mode} sphere keeps a norm per row and per column, which "
                                 f"needs rowcol gains; the group has gains={hp.gains!r}")
            return s.reciprocal().reshape(-1), s_col.reciprocal().reshape(-1)
        s = s_col if s is None else s
    inv = s.reciprocal()
    m, n = W.shape
    if s.ndim == 0:
        if gains == "flat":
            return inv.reshape(1), None
        if gains in ("rowcol", "row"):
            return inv.expand(m).clone(), None
        return None, inv.expand(n).clone()
    axis = "row" if s.shape[1] == 1 else "col"
    if gains not in ("rowcol", axis):
        raise ValueError(f"preserve_init on the {mode} sphere keeps one norm per {axis}, which needs {axis} gains "
                         f"(rowcol or {axis}); the group has gains={hp.gains!r}")
    return (inv.reshape(-1), None) if axis == "row" else (None, inv.reshape(-1))


# ``(U_block, global_block_shape) -> msign(U_block)``, a new tensor, unscaled; TP glue supplies its own.
Orthogonalize = Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]


def default_orthogonalize(hp: MDHyperParams) -> Orthogonalize:
    return lambda U, block_shape: msign(U, steps=hp.ns_steps, coefficients=hp.ns_coefficients)


def resolve_split_shapes(p: torch.Tensor, hp: MDHyperParams) -> tuple[int, int, int] | None:
    """The group's qkv_split_shapes, else the param's ``qkv_split_shapes`` attribute, else None."""
    split = hp.qkv_split_shapes if hp.qkv_split_shapes is not None else getattr(p, "qkv_split_shapes", None)
    return None if split is None else tuple(int(s) for s in split)  # type: ignore[return-value]


def md_blocks(p: torch.Tensor, hp: MDHyperParams,
              reducer: Reducer = LOCAL_REDUCER) -> tuple[list[Block], list[Block]]:
    """(update blocks, sphere blocks) of ``p``: its Q/K/V blocks (or the whole matrix), or one block per
    attention head for the update with ``split_heads_update`` and for the sphere with ``split_heads``."""
    split = resolve_split_shapes(p, hp)
    blocks = matrix_blocks(p.shape, split, reducer, p.device)
    if split is None or not (hp.split_heads or hp.split_heads_update):
        return blocks, blocks
    heads = matrix_blocks(p.shape, split, reducer, p.device, hp.head_dim, per_head=True)
    return (heads if hp.split_heads_update else blocks), (heads if hp.split_heads else blocks)


@dataclass
class MDPrepared:
    """A matrix between the phases: its base direction (blocks awaiting msign for Muon) and gain gradients."""

    direction: torch.Tensor
    gain_grads: dict[str, torch.Tensor]  # ∂L/∂(raw state) by axis: row, col, flat, lowrank_a, lowrank_b
    blocks: list[Block]  # the update's blocks (msign, scale factors)
    sphere_blocks: list[Block] | None = None  # the sphere's blocks, when they differ

    def blocks_to_orthogonalize(self) -> list[tuple[torch.Tensor, tuple[int, int]]]:
        """``(block of the direction, its global shape)`` for each block (Muon base)."""
        return [(get_block(self.direction, b), b.shape) for b in self.blocks]


@torch.no_grad()
def md_prepare(
    p: torch.Tensor, grad: torch.Tensor, state: dict, hp: MDHyperParams, base: BaseUpdate,
    reducer: Reducer = LOCAL_REDUCER, blocks: list[Block] | None = None,
    sphere_blocks: list[Block] | None = None,
) -> MDPrepared:
    """Phases 1-5 (docs/optimizers.md §1.4): gain gradients with the OLD gains through φ', the direction
    gradient Ĝ and the base direction (momentum, or Adam moments). ``p`` and the gains are not changed.
    ``blocks`` / ``sphere_blocks``: the update's and the sphere's blocks (``md_blocks``), if known."""
    if blocks is None or (sphere_blocks is None and (hp.split_heads or hp.split_heads_update)):
        blocks, sphere_blocks = md_blocks(p, hp, reducer)
    sphere_blocks = blocks if sphere_blocks is None else sphere_blocks
    G, split = grad.to(torch.float32), gain_split(p, hp)
    g_row, g_col = current_gains(state, hp, split)
    if "rho_lowrank_a" in state:  # no φ: the factors are the raw state
        d_a, d_b, work = lowrank_grads(G, p.to(torch.float32), g_row, state, reducer)
        grads = {"lowrank_a": d_a, "lowrank_b": d_b}
    else:
        d_row, d_col, work = gain_grads_fused(G, p.to(torch.float32), g_row, g_col, reducer, split)
        gp, grads = gain_param(hp.gain_param), {}
        for axis, d in (("flat" if "rho_flat" in state else "row", d_row), ("col", d_col)):
            if d is not None:
                grads[axis] = d.mul_(gp.phi_prime(state[f"rho_{axis}"]))
    # Ĝ in the gain product's buffer; without gains it is G itself, copied only for a base that writes in
    # it. Fresh big allocations cost as much as a pass on CPU (page faults): at most one per matrix.
    if work is not None:
        G_hat = scratch = direction_grad(G, g_row, g_col, out=work)
    else:
        G_hat = G.clone() if base.writes_direction_grad or (hp.tangent_grad and G is grad) else G
        scratch = G_hat if G_hat is not G else None
    if hp.tangent_grad:  # --hs-p: only the part of Ĝ that turns Ŵ on its sphere
        W_hat = recover_direction(p.to(torch.float32), g_row, g_col, clamp=not hp.gains_no_clamp)
        tangent_(G_hat, W_hat, sphere_blocks, hp.sphere_mode, reducer)
    return MDPrepared(base.direction(G_hat, state, hp, scratch), grads, blocks, sphere_blocks)


@torch.no_grad()
def md_finish_(
    p: torch.Tensor, prep: MDPrepared, state: dict, hp: MDHyperParams, base: BaseUpdate,
    reducer: Reducer = LOCAL_REDUCER, orthogonalized: Sequence[torch.Tensor] | None = None,
) -> None:
    """Phases 7-10 (docs/optimizers.md §1.4): the direction step (with msign's ``orthogonalized`` blocks for Muon), the
    sphere, Adam on the raw gains, and the re-fused weight written into ``p``."""
    split, clamp = gain_split(p, hp), not hp.gains_no_clamp
    g_row, g_col = current_gains(state, hp, split)
    if p.dtype == torch.float32:  # Ŵ recovered in place: p is rewritten at the end anyway
        W_hat = p if g_row is None and g_col is None else recover_direction(p, g_row, g_col, out=p, clamp=clamp)
    else:
        W_hat = recover_direction(p.to(torch.float32), g_row, g_col, clamp=clamp)
    if hp.weight_decay:
        W_hat.mul_(1.0 - hp.lr * hp.weight_decay)
    geo, sphere_blocks = hp.geometry, prep.sphere_blocks or prep.blocks
    if hp.normalize_update:  # --hs-u: the update itself on Ŵ's sphere, so the relative step is lr exactly
        U = torch.zeros_like(W_hat)
        base.descend_(U, prep.direction, state, dataclasses.replace(hp, lr=-1.0), prep.blocks, orthogonalized,
                      reducer)
        W_hat.sub_(project_direction_(U, sphere_blocks, geo, reducer), alpha=hp.lr)
    else:
        base.descend_(W_hat, prep.direction, state, hp, prep.blocks, orthogonalized, reducer)
    if geo.plain(sphere_blocks):
        scale, scale_col = blocks_sphere_scale(W_hat, sphere_blocks, hp.sphere_mode, reducer, hp.radius_scale), None
    else:  # None where absent; parts no factor holds are already applied to W_hat
        scale, scale_col = sphere_factors(W_hat, sphere_blocks, geo, reducer)

    if prep.gain_grads:
        state["gain_step"] += 1
        step = state["gain_step"].item()
        floor = rho_floor(hp)  # gains_min: a projected step, φ(ρ) >= gains_min afterwards
        for axis, d in prep.gain_grads.items():
            rho = state[f"rho_{axis}"]
            adam_(rho, d, state[f"exp_avg_{axis}"], state[f"exp_avg_sq_{axis}"], step, hp.gains_lr,
                  hp.gains_betas, hp.gains_eps, hp.effective_gains_weight_decay,
                  bias_correction=hp.gains_bias_correction)
            if floor is not None:
                rho.clamp_min_(floor)
        g_row, g_col = current_gains(state, hp, split)

    # Sphere and new gains in one write: W = diag(γ_r)·(s ⊙ Ŵ)·diag(γ_c); s is a scalar, a row or a column factor
    # (and a Sinkhorn sphere's column factor in scale_col).
    row, col = g_row, g_col
    if scale is None:
        pass
    elif scale.ndim == 2 and scale.shape[1] == 1:
        row = scale if row is None else scale * (row.unsqueeze(1) if row.ndim == 1 else row)
    elif scale.ndim == 2:
        col = scale if col is None else scale * (col.unsqueeze(0) if col.ndim == 1 else col)
    elif row is not None:
        row = row * scale
    elif col is not None:
        col = col * scale
    else:
        row = scale
    if scale_col is not None:
        col = scale_col if col is None else scale_col * (col.unsqueeze(0) if col.ndim == 1 else col)
    out = p if p.dtype == torch.float32 else None
    res = _scaled(W_hat, row, col, out=out)
    if out is None:
        p.copy_(res)


@torch.no_grad()
def md_step_(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    hp: MDHyperParams,
    base: BaseUpdate,
    reducer: Reducer = LOCAL_REDUCER,
    orthogonalize: Orthogonalize | None = None,
    blocks: list[Block] | None = None,
    sphere_blocks: list[Block] | None = None,
) -> None:
    """One MD step on matrix ``p`` in place, docs/optimizers.md §1.4 in order. ``state`` must be initialised."""
    prep = md_prepare(p, grad, state, hp, base, reducer, blocks, sphere_blocks)
    orth = None
    if base.orthogonalizes:
        fn = orthogonalize or default_orthogonalize(hp)
        orth = [fn(U, shape) for U, shape in prep.blocks_to_orthogonalize()]
    md_finish_(p, prep, state, hp, base, reducer, orth)
