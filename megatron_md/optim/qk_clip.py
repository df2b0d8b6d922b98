"""QK-clip (MuonClip, Kimi K2) as mathematics on whole tensors: from per-head maximum logits to the factors that
bring them back to a threshold, and those factors put into MD's row gains.

For a head whose largest pre-softmax logit ``m`` exceeds ``τ``, ``η = τ / m``; the logit is bilinear in the
query and key projections, so scaling the head's W_Q rows by ``η^α`` and its key group's W_K rows by ``η^(1-α)``
scales its logits by ``η``: the largest becomes ``τ``. Heads at or below ``τ`` (a non-positive maximum, -inf,
NaN included) get exactly 1, so nothing they touch changes. Under grouped-query attention a key group is shared:
its queries keep their own ``η_h^α`` and the group's keys take the smallest ``η`` of its heads, so every head
ends at or below ``τ`` (the one that set the group's factor exactly at ``τ``).
"""

from __future__ import annotations

import torch

from .gains import effective_gains_min, gain_param


def head_eta(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """``τ / m`` where ``m > τ``, else exactly 1 (a maximum at or below zero never divides)."""
    if not threshold > 0:
        raise ValueError(f"--qk-clip-threshold must be > 0, got {threshold}")
    m = max_logits.float()
    over = m > threshold
    return torch.where(over, threshold / torch.where(over, m, torch.ones_like(m)), torch.ones_like(m))


def query_key_factors(max_logits: torch.Tensor, groups: int, threshold: float, alpha: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(per query head ``η_h^α``, per key group ``(min_h∈g η_h)^(1-α)``) from per-head maxima ``[heads]``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--qk-clip-alpha must be in [0, 1], got {alpha}")
    eta = head_eta(max_logits, threshold)
    return eta.pow(alpha), eta.view(groups, -1).amin(dim=1).pow(1.0 - alpha)


def qkv_row_factors(q_factor: torch.Tensor, k_factor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Row factors of megatron's fused QKV weight (one tensor-parallel shard of it): per key group, its query
    heads' rows, then its key rows, then its value rows (1), ``head_dim`` rows each."""
    groups = k_factor.numel()
    per_q = q_factor.view(groups, -1, 1).expand(-1, -1, head_dim).reshape(groups, -1)
    k = k_factor.view(groups, 1).expand(-1, head_dim)
    v = torch.ones_like(k)
    return torch.cat([per_q, k, v], dim=1).reshape(-1)


def layer_factors(max_logit: torch.Tensor, threshold: float, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(query, key) factors of a layer whose logit scale is one pair of QK-norm weights shared by its heads:
    ``η^α`` and ``η^(1-α)`` from the layer's largest logit."""
    eta = head_eta(max_logit.reshape(()), threshold)
    return eta.pow(alpha), eta.pow(1.0 - alpha)


@torch.no_grad()
def scale_row_gains_(W: torch.Tensor, state: dict, hp, factors: torch.Tensor) -> torch.Tensor:
    """Put row factors into an MD matrix ``W = diag(γ_r)·Ŵ·diag(γ_c)``: ``γ_r ← γ_r·s`` (through the
    parametrisation, ``ρ ← φ⁻¹(φ(ρ)·s)``) and ``W``'s rows by the same factor, so the direction ``Ŵ`` stays on
    its sphere. A gain floor (``gains_min``) can stop a gain short: the weight then takes the factor the gain
    actually took. Rows with factor 1 are untouched, bit for bit. Returns the factors applied."""
    if "rho_row" not in state:
        raise ValueError("QK-clip scales MD's row gains of the query and key rows; this matrix has none "
                         "(--md-gains col, flat, lowrank or none): use --md-gains rowcol or row")
    gp = gain_param(hp.gain_param)
    rho = state["rho_row"]
    g = gp.phi(rho)
    target = g * factors
    floor = effective_gains_min(hp)
    if floor > 0:
        target = target.clamp_min(floor)
    clip = factors < 1
    new_rho = torch.where(clip, gp.phi_inv(target), rho)
    applied = torch.where(clip, gp.phi(new_rho) / g, torch.ones_like(factors))
    rho.copy_(new_rho)
    W.mul_(applied.unsqueeze(1).to(W.dtype))
    return applied
