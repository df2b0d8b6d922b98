"""The base updates of MD decoupling: the protocol (``BaseUpdate``) and Muon, Adam, Lion, SOAP, AdEMAMix and
normalised momentum.

A base turns the direction gradient Ĝ into the update U of ``Ŵ <- Π(Ŵ - lr·U)``; ``md.py`` runs it inside the MD
step. Muon and Adam are the MD paper's bases; its research branch ran Lion, AdEMAMix and normalised momentum
among them; SOAP comes from NVIDIA's emerging-optimizers (its Kronecker factors, eigenbasis refresh and
projections), the optimizer family megatron-core's own Muon is taken from.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from .adam import (
    COMPILE_MIN_ELEMENTS,
    adam_denominator,
    adam_direction,
    adam_moments_,
    adam_moments_and_denominator,
    adam_step_rows_,
    adam_step_size,
    compiles,
)
from .blocks import Block, add_block_, get_block
from .geometry import project_direction_
from .hyperparams import MDHyperParams
from .msign import scale_factor
from .sphere import LOCAL_REDUCER, Reducer


class BaseUpdate:
    """Turns the direction gradient Ĝ into an update U, applied as ``Ŵ <- Π(Ŵ - lr·U)``.

    In phases: ``direction`` (state update, may reuse Ĝ's memory), then, when ``orthogonalizes``, every block of
    the direction goes through msign elsewhere (an engine may batch it across matrices and ranks), then
    ``descend_`` subtracts ``lr·U`` from Ŵ (``reducer``: sums over the matrix's axes, for a base that needs
    norms of a tensor-parallel shard).

    ``stacks = True`` lets the batched engine (``md_batched.py``) run the base on a stack ``[k, m, n]`` of
    same-shape matrices: it calls ``direction_stacked`` / ``descend_stacked_`` with ``state`` holding the stacked
    state (one tensor per key, ``[k, ...]``), the blocks' helpers of ``blocks.py`` take stacks as they are. By
    default those call ``direction`` / ``descend_``, which is right for a base whose arithmetic is elementwise or
    per block; a base with a step counter (``has_step``) overrides them: the engine advances the counter and
    passes its value as ``step`` (a host number: no device read in the step).
    """

    # Its own typed config section (a dataclass of ``megatron_md.fields.opt`` fields, one flag each), and the
    # section's name in the run's optimizer config (``cfg.optimizer.<section_name>``): registering the base
    # (``plugins.register_md_base``) makes the flags, and the run's section reaches the base as ``self.options``.
    section: type | None = None
    section_name: str | None = None
    orthogonalizes = False
    writes_direction_grad = False  # True: ``direction`` may overwrite Ĝ (the caller then hands it a copy)
    has_step = False  # True: keeps its own step counter in ``state["step"]`` (bias corrections)
    side_state: tuple[str, ...] = ()  # state entries not shaped like the parameter (checkpointed separately)
    # what the planner counts per matrix: (Adam moments, momentum-like buffers) of the matrix's shape, and
    # whether it keeps Kronecker factors (training/planning/memory.py)
    state_layout: tuple[int, int, bool] = (0, 0, False)

    def __init__(self, options=None):
        """``options``: the base's ``section`` as the run set it (default: the section's defaults)."""
        self.options = options if options is not None or self.section is None else self.section()

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        raise NotImplementedError

    def direction(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
        """``scratch``: a matrix-sized buffer the base may use for its result (or None)."""
        raise NotImplementedError

    def descend_(self, W_hat: torch.Tensor, direction: torch.Tensor, state: dict, hp: MDHyperParams,
                 blocks: Sequence[Block], orthogonalized: Sequence[torch.Tensor] | None,
                 reducer: Reducer = LOCAL_REDUCER) -> None:
        raise NotImplementedError

    stacks = False

    def direction_stacked(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams,
                          scratch: torch.Tensor | None, step: int | float | None) -> torch.Tensor:
        return self.direction(g_hat, state, hp, scratch)

    def descend_stacked_(self, W_hat: torch.Tensor, direction: torch.Tensor, state: dict, hp: MDHyperParams,
                         blocks: Sequence[Block], orthogonalized: Sequence[torch.Tensor] | None,
                         step: int | float | None, reducer: Reducer = LOCAL_REDUCER) -> None:
        self.descend_(W_hat, direction, state, hp, blocks, orthogonalized, reducer)

    def fuses_step(self, numel: int) -> bool:
        """Whether ``step_rows_stacked_`` takes a stack of one matrix of ``numel`` elements (default: never)."""
        return False

    def step_rows_stacked_(self, W: torch.Tensor, G: torch.Tensor, gains: tuple, divisors: tuple, decay: float,
                           state: dict, hp: MDHyperParams, step: int | float | None) -> torch.Tensor | None:
        """Optional fusion for one big whole matrix, when ``fuses_step``: the base's direction from
        ``Ĝ = G ⊙ gains`` and its step of ``Ŵ = W ⊘ divisors · decay`` in one pass, in place, returning the rows'
        squared norms of the result (the sphere's factor follows from them). None: nothing was done (the engine
        then runs ``direction_stacked`` and ``descend_stacked_``)."""
        return None


class MuonBase(BaseUpdate):
    """EMA momentum (+ Nesterov), per-block msign and the block's scale factor (docs/optimizers.md §1.5)."""

    state_layout = (0, 1, False)
    stacks = True

    orthogonalizes = True
    writes_direction_grad = True  # Nesterov's lerp runs in Ĝ's memory

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def direction(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
        buf = state["momentum_buffer"]
        buf.lerp_(g_hat, 1.0 - hp.momentum)
        return g_hat.lerp_(buf, hp.momentum) if hp.nesterov else buf

    def descend_(self, W_hat, direction, state, hp, blocks, orthogonalized, reducer=LOCAL_REDUCER) -> None:
        for blk, O in zip(blocks, orthogonalized):
            add_block_(W_hat, blk, O, -hp.lr * scale_factor(*blk.shape, hp.scale_mode) * hp.radius_scale)


class AdamBase(BaseUpdate):
    """Bias-corrected Adam on Ĝ, no scale factor (MD-Adam, docs/optimizers.md §1.5)."""

    state_layout = (2, 0, False)
    stacks = True

    has_step = True

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["step"] = torch.tensor(0.0)

    def direction(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
        """Moments updated; returns the denominator (in ``scratch`` if given): ``descend_`` divides the momentum
        by it. Ĝ is only read."""
        state["step"] += 1
        return adam_moments_and_denominator(g_hat, state["exp_avg"], state["exp_avg_sq"], state["step"].item(),
                                            hp.betas, hp.eps, out=scratch)

    def descend_(self, W_hat, direction, state, hp, blocks, orthogonalized, reducer=LOCAL_REDUCER) -> None:
        self.descend_stacked_(W_hat, direction, state, hp, blocks, orthogonalized, state["step"].item())

    def direction_stacked(self, g_hat, state, hp, scratch, step):
        if g_hat[0].numel() >= COMPILE_MIN_ELEMENTS and g_hat.shape[0] == 1:  # the per-matrix kernel's choice
            # the stacks themselves, not their rows: a row is a view, and torch.compile mishandles several
            # mutated views of different bases in one call (measured: an inductor assertion, then eager)
            return adam_moments_and_denominator(g_hat, state["exp_avg"], state["exp_avg_sq"], step, hp.betas,
                                                hp.eps, out=scratch)
        adam_moments_(g_hat, state["exp_avg"], state["exp_avg_sq"], *hp.betas)
        return adam_denominator(state["exp_avg_sq"], step, hp.betas[1], hp.eps, out=scratch)

    def descend_stacked_(self, W_hat, direction, state, hp, blocks, orthogonalized, step, reducer=LOCAL_REDUCER):
        W_hat.addcdiv_(state["exp_avg"], direction, value=-hp.lr * adam_step_size(step, hp.betas) * hp.radius_scale)

    def fuses_step(self, numel: int) -> bool:
        return compiles(numel)

    def step_rows_stacked_(self, W, G, gains, divisors, decay, state, hp, step):
        # the embedding and LM head at real vocabularies: one compiled pass instead of up to nine eager ones
        return adam_step_rows_(W, G, gains, divisors, state["exp_avg"], state["exp_avg_sq"], step, hp.betas, hp.eps,
                               decay, -hp.lr * hp.radius_scale)


def sign_scale(block_shape: tuple[int, int]) -> float:
    """``1/sqrt(min(m, n))``: a full sign matrix then has Frobenius norm ``sqrt(max(m, n))``, the flat sphere's
    radius, so an MD-Lion step turns Ŵ by ``lr`` like MD-Muon's ``shape_up`` (one LR meaning for both)."""
    return 1.0 / math.sqrt(min(block_shape))


class LionBase(BaseUpdate):
    """Lion on Ĝ (Chen et al. 2023): ``U = sign(lerp(M, Ĝ, 1-β1))``, then ``M <- lerp(M, Ĝ, 1-β2)``; each block's
    sign matrix is scaled by ``sign_scale`` of its global shape."""

    state_layout = (0, 1, False)
    stacks = True

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def direction(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
        b1, b2 = hp.lion_betas
        m = state["exp_avg"]
        # the momentum update still reads Ĝ, so the sign goes to a scratch buffer only if that is not Ĝ's own
        free = scratch is not None and scratch.data_ptr() != g_hat.data_ptr()
        u = torch.lerp(m, g_hat, 1.0 - b1, out=scratch) if free else torch.lerp(m, g_hat, 1.0 - b1)
        m.lerp_(g_hat, 1.0 - b2)
        return u.sign_()

    def descend_(self, W_hat, direction, state, hp, blocks: Sequence[Block], orthogonalized,
                 reducer=LOCAL_REDUCER) -> None:
        for blk in blocks:
            add_block_(W_hat, blk, get_block(direction, blk), -hp.lr * sign_scale(blk.shape) * hp.radius_scale)


class SoapBase(BaseUpdate):
    """SOAP (Vyas et al. 2024) on Ĝ: Adam in the eigenbasis of Shampoo's Kronecker factors ``L = E[ĜĜᵀ]``,
    ``R = E[ĜᵀĜ]``. The factors, the eigenbasis refresh (``eigh`` on the first step, one power iteration + QR
    after) and the projections are emerging-optimizers'; the inner Adam is ours (bias-corrected, as theirs).

    Whole matrices only: ``L`` and ``R`` need the full Ĝ, so tensor-parallel shards are refused by the glue.
    No scale factor (like the Adam base); ``normalize_update`` puts U on the sphere if wanted.
    """

    state_layout = (2, 0, True)

    has_step = True
    side_state = ("soap_L", "soap_R", "soap_QL", "soap_QR")

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        from emerging_optimizers.soap.soap import init_kronecker_factors

        m, n = p.shape
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["soap_L"], state["soap_R"] = init_kronecker_factors(p.shape, device=p.device)
        state["soap_QL"] = torch.eye(m, device=p.device)
        state["soap_QR"] = torch.eye(n, device=p.device)
        state["step"] = torch.tensor(0.0)

    def direction(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
        from emerging_optimizers.soap.soap import (
            precondition,
            update_eigenbasis_and_exp_avgs,
            update_kronecker_factors,
        )

        first = state["step"].item() == 0
        state["step"] += 1
        t = state["step"].item()
        beta = hp.soap_shampoo_beta
        beta = 1.0 - (1.0 - beta) / (1.0 - beta**t)  # bias-corrected EMA of the factors (emerging-optimizers' default)
        update_kronecker_factors([state["soap_L"], state["soap_R"]], g_hat, beta)
        bases, exp_avg, exp_avg_sq = update_eigenbasis_and_exp_avgs(
            [state["soap_L"], state["soap_R"]], [state["soap_QL"], state["soap_QR"]],
            exp_avg_sq=state["exp_avg_sq"], exp_avg=state["exp_avg"], use_eigh=first, power_iter_steps=1,
        )
        # keep the state's tensors (megatron's optimizer wrappers hold references to them)
        for key, new in (("soap_QL", bases[0]), ("soap_QR", bases[1]), ("exp_avg", exp_avg),
                         ("exp_avg_sq", exp_avg_sq)):
            if new is not state[key]:
                state[key].copy_(new)
        Q = [state["soap_QL"], state["soap_QR"]]
        rotated = precondition(g_hat, Q, dims=[[0], [0]])
        update = adam_direction(rotated, state["exp_avg"], state["exp_avg_sq"], t, hp.betas, hp.eps)
        return precondition(update, Q, dims=[[0], [1]])

    def descend_(self, W_hat, direction, state, hp, blocks, orthogonalized, reducer=LOCAL_REDUCER) -> None:
        W_hat.add_(direction, alpha=-hp.lr * hp.radius_scale)


def _half_life(beta: float) -> float:
    """Steps after which an EMA with factor ``beta`` has halved a sample: ``beta^h = 1/2`` (0 for ``beta = 0``)."""
    return math.log(0.5) / math.log(beta) if beta > 0 else 0.0


def ademamix_schedule(step: int | float, hp: MDHyperParams) -> tuple[float, float]:
    """(α, β3) at base step ``step`` (from 1). α rises linearly from 0 over ``ademamix_alpha_warmup`` steps; β3
    goes from β1 to its value over ``ademamix_beta3_warmup`` steps linearly in half-life, so the slow EMA's
    memory grows steadily (a linear ramp in β3 would spend nearly all of it near β1). 0: no warmup."""
    alpha, beta3 = hp.ademamix_alpha, hp.ademamix_beta3
    if step < hp.ademamix_alpha_warmup:
        alpha *= step / hp.ademamix_alpha_warmup
    if step < hp.ademamix_beta3_warmup:
        frac = step / hp.ademamix_beta3_warmup
        h = (1.0 - frac) * _half_life(hp.betas[0]) + frac * _half_life(beta3)
        beta3 = 0.5 ** (1.0 / h) if h > 0 else 0.0
    return alpha, beta3


class AdEMAMixBase(BaseUpdate):
    """AdEMAMix (Pagliardini et al. 2024) on Ĝ: Adam's moments plus a slow, not bias-corrected EMA ``m_s`` of Ĝ,
    ``U = (m̂ + α·m_s) / (sqrt(v̂) + ε)``, with the warmups of ``ademamix_schedule``; no scale factor (as Adam)."""

    state_layout = (2, 1, False)

    has_step = True

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        AdamBase.init_state(self, p, state)
        state["exp_avg_slow"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def direction(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
        """``(m + α(1-β1^t)·m_s) / denominator``; ``descend_`` multiplies by Adam's step size
        ``sqrt(1-β2^t)/(1-β1^t)``, which makes it the update above. Ĝ is only read."""
        state["step"] += 1
        t = state["step"].item()
        alpha, beta3 = ademamix_schedule(t, hp)
        state["exp_avg_slow"].lerp_(g_hat, 1.0 - beta3)
        denom = adam_moments_and_denominator(g_hat, state["exp_avg"], state["exp_avg_sq"], t, hp.betas, hp.eps,
                                             out=scratch)
        num = torch.add(state["exp_avg"], state["exp_avg_slow"], alpha=alpha * (1.0 - hp.betas[0] ** t))
        return torch.div(num, denom, out=denom)

    def descend_(self, W_hat, direction, state, hp, blocks, orthogonalized, reducer=LOCAL_REDUCER) -> None:
        W_hat.add_(direction, alpha=-hp.lr * adam_step_size(state["step"].item(), hp.betas) * hp.radius_scale)


class NormalizedBase(BaseUpdate):
    """Muon with msign replaced by a projection (the authors' "poor man's orthogonalisation"): momentum and
    Nesterov as ``MuonBase``, then each block of the direction put on the group's sphere at unit radius scale
    (flat: ``sqrt(max(M_b, N_b))``; row / col: unit rows / columns; Sinkhorn spheres and the spectral kind as in
    ``geometry.py``; never a ball) and scaled like Muon's msign, ``s(M_b, N_b) · radius_scale``. No Newton-Schulz
    (except under ``sphere_kind='orthogonal'``, whose projection is msign itself and needs whole blocks), and
    the norms run through the reducer, so it works on tensor-parallel shards with no gather."""

    state_layout = (0, 1, False)

    writes_direction_grad = True  # Nesterov's lerp (or the momentum's copy) and the projection run in Ĝ's memory

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        MuonBase.init_state(self, p, state)

    def direction(self, g_hat: torch.Tensor, state: dict, hp: MDHyperParams,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
        buf = state["momentum_buffer"]
        buf.lerp_(g_hat, 1.0 - hp.momentum)
        # a copy without Nesterov: descend_ projects the direction in place and the momentum must survive
        return g_hat.lerp_(buf, hp.momentum) if hp.nesterov else g_hat.copy_(buf)

    def descend_(self, W_hat, direction, state, hp, blocks, orthogonalized, reducer=LOCAL_REDUCER) -> None:
        # the group's sphere (mode, kind, Sinkhorn sweeps) at unit radius scale, always onto it (never a ball);
        # on the update's blocks: l2 flat / row / col is sphere.py's own projection
        project_direction_(direction, blocks, dataclasses.replace(hp.geometry, ball=False, radius_scale=1.0), reducer)
        for blk in blocks:
            add_block_(W_hat, blk, get_block(direction, blk),
                       -hp.lr * scale_factor(*blk.shape, hp.scale_mode) * hp.radius_scale)


BASES = {"muon": MuonBase, "adam": AdamBase, "lion": LionBase, "soap": SoapBase, "ademamix": AdEMAMixBase,
         "norm": NormalizedBase}
