"""QK-clip's mathematics (optim/qk_clip.py) against direct computations of the logits it controls."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_md.optim.gains import gain_param, recover_direction
from megatron_md.optim.md import MDHyperParams
from megatron_md.optim.qk_clip import head_eta, layer_factors, qkv_row_factors, query_key_factors, scale_row_gains_


def _fused(heads: int, groups: int, d: int, hidden: int, gen) -> torch.Tensor:
    return torch.randn(groups * (heads // groups + 2) * d, hidden, generator=gen)


def _split(W: torch.Tensor, heads: int, groups: int, d: int):
    """megatron's fused QKV rows -> (W_Q [heads, d, hidden], W_K [groups, d, hidden]), written out directly."""
    rep = heads // groups
    per = W.view(groups, (rep + 2) * d, -1)
    return per[:, : rep * d].reshape(heads, d, -1), per[:, rep * d: (rep + 1) * d]


def _head_max(W: torch.Tensor, x: torch.Tensor, heads: int, groups: int, d: int, scale: float) -> torch.Tensor:
    """Per-head max of scale·q·k over all query/key pairs of ``x`` [s, hidden] (no mask), by brute force."""
    Wq, Wk = _split(W, heads, groups, d)
    out = []
    for h in range(heads):
        q, k = x @ Wq[h].T, x @ Wk[h // (heads // groups)].T
        out.append((scale * q @ k.T).max())
    return torch.stack(out)


@pytest.mark.parametrize("m", [-3.0, 0.0, float("-inf"), float("nan"), 1.0, 2.0])
def test_heads_at_or_below_threshold_get_exactly_one(m):
    assert head_eta(torch.tensor([m]), 2.0).item() == 1.0


def test_eta_brings_the_maximum_to_the_threshold():
    m = torch.tensor([250.0, 100.0, 99.0, 1e4])
    torch.testing.assert_close(head_eta(m, 100.0), torch.tensor([0.4, 1.0, 1.0, 0.01]))
    with pytest.raises(ValueError, match="threshold"):
        head_eta(m, 0.0)
    with pytest.raises(ValueError, match="alpha"):
        query_key_factors(m, 4, 100.0, 1.5)


@pytest.mark.parametrize("heads,groups,alpha", [(4, 4, 0.5), (8, 2, 0.5), (6, 3, 0.3), (4, 1, 1.0), (4, 2, 0.0)])
def test_row_factors_bring_every_head_to_at_most_tau(heads, groups, alpha):
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    d, hidden, scale = 8, 24, 8 ** -0.5
    W = _fused(heads, groups, d, hidden, gen)
    x = torch.randn(12, hidden, generator=gen)
    before = _head_max(W, x, heads, groups, d, scale)
    tau = before.median().item()  # about half the heads above
    qf, kf = query_key_factors(before, groups, tau, alpha)
    rows = qkv_row_factors(qf, kf, d)
    after = _head_max(W * rows[:, None], x, heads, groups, d, scale)
    over = before > tau
    assert over.any() and (~over).any()
    assert (after <= tau * (1 + 1e-5)).all(), (before, after, tau)
    # the head that set its group's factor lands on tau; V rows are never touched
    for g in range(groups):
        hs = range(g * heads // groups, (g + 1) * heads // groups)
        top = max(hs, key=lambda h: before[h])
        if before[top] > tau:
            assert after[top] == pytest.approx(tau, rel=1e-5)
        else:  # nothing in the group exceeded tau: its logits are unchanged
            for h in hs:
                assert after[h] == pytest.approx(before[h].item(), rel=1e-6)
    v_rows = torch.zeros(groups, (heads // groups + 2) * d, dtype=torch.bool)
    v_rows[:, -d:] = True
    assert (rows.view(groups, -1)[v_rows.view(groups, -1)] == 1).all()


def test_mha_rows_match_megatron_core_own_clip():
    """For MHA (one head per group) megatron-core's SelfAttention._clip_linear_qkv scales the same rows."""
    from types import SimpleNamespace

    from megatron.core.transformer.attention import SelfAttention

    heads, d, hidden = 4, 8, 32
    gen = torch.Generator().manual_seed(0)
    W = _fused(heads, heads, d, hidden, gen)
    m = torch.tensor([50.0, 150.0, 400.0, 99.0])
    eta = torch.clamp(100.0 / m, max=1.0)
    fake = SimpleNamespace(num_query_groups_per_partition=heads, query_projection_size=heads * d,
                           kv_projection_size=heads * d, qk_clip_balancing_eta=eta.view(heads, 1, 1),
                           config=SimpleNamespace(qk_clip_alpha=0.5))
    theirs = SelfAttention._clip_linear_qkv(fake, W.clone())
    qf, kf = query_key_factors(m, heads, 100.0, 0.5)
    torch.testing.assert_close(W * qkv_row_factors(qf, kf, d)[:, None], theirs, rtol=1e-6, atol=0)


def test_layer_factors_scale_all_logits_by_eta():
    q, k = layer_factors(torch.tensor(400.0), 100.0, 0.25)
    assert (q * k).item() == pytest.approx(0.25)
    assert q.item() == pytest.approx(0.25 ** 0.25)
    assert layer_factors(torch.tensor(-5.0), 100.0, 0.5) == (1.0, 1.0)


@pytest.mark.parametrize("gain_kind,floor", [("softplus", None), ("direct", None), ("exp", None), ("softplus", 0.3)])
def test_row_gains_take_the_factor_and_the_direction_stays(gain_kind, floor):
    gen = torch.Generator().manual_seed(3)
    m, n = 12, 6
    hp = MDHyperParams(lr=0.1, gain_param=gain_kind, gains_min=floor)
    gp = gain_param(gain_kind)
    g_row = torch.rand(m, generator=gen) + 0.5
    g_col = torch.rand(n, generator=gen) + 0.5
    D = torch.randn(m, n, generator=gen)
    D /= D.norm()
    state = {"rho_row": gp.phi_inv(g_row).clone(), "rho_col": gp.phi_inv(g_col).clone()}
    W = g_row[:, None] * D * g_col[None, :]
    W0, rho0 = W.clone(), state["rho_row"].clone()
    f = torch.ones(m)
    f[[1, 4, 7]] = torch.tensor([0.5, 0.1, 0.9])
    applied = scale_row_gains_(W, state, hp, f)
    new_g = gp.phi(state["rho_row"])
    untouched = f == 1
    assert torch.equal(W[untouched], W0[untouched]) and torch.equal(state["rho_row"][untouched], rho0[untouched])
    expect = g_row * f if floor is None else (g_row * f).clamp_min(floor)
    torch.testing.assert_close(new_g, expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(W, W0 * applied[:, None], rtol=0, atol=0)
    # W = diag(γ_r')·D·diag(γ_c): the direction is unchanged, on its sphere
    torch.testing.assert_close(recover_direction(W, new_g, g_col), D, rtol=1e-5, atol=1e-6)
    if floor is not None:
        assert new_g[4].item() == pytest.approx(floor, rel=1e-6)  # 0.1 × γ fell below the floor


def test_row_gains_are_required():
    hp = MDHyperParams(lr=0.1, gains="col")
    with pytest.raises(ValueError, match="--md-gains"):
        scale_row_gains_(torch.ones(2, 2), {"rho_col": torch.zeros(2)}, hp, torch.ones(2))
    assert math.isfinite(head_eta(torch.tensor([1e30]), 1.0).item())
