"""MuonMD / AdamMD: sphere and fusion invariants, gain gradients vs autograd, relative update, init."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_md.optim import AdamMD, MuonMD, Reducer, gain_param, msign, qkv_row_index
from megatron_md.optim.gains import direction_grad, gain_grads, recover_direction

# GQA: 4 heads, 2 query groups, kv_channels 16, hidden 64 -> per group [32 q, 16 k, 16 v] rows
QKV_SPLIT = (32, 16, 16)
SHAPES = {"square": (64, 64), "tall": (128, 48), "wide": (48, 128), "qkv_gqa": (128, 64)}
OPTIMIZERS = {"muon": MuonMD, "adam": AdamMD}


def _split_of(name):
    return QKV_SPLIT if name == "qkv_gqa" else None


def _blocks_by_view(W: torch.Tensor, split) -> list[torch.Tensor]:
    """Q, K, V blocks read through a reshape of Megatron's per-group layout (independent of qkv_row_index)."""
    if split is None:
        return [W]
    q, k, v = split
    W3 = W.reshape(-1, q + k + v, W.shape[1])
    return [W3[:, a:b].reshape(-1, W.shape[1]) for a, b in ((0, q), (q, q + k), (q + k, q + k + v))]


def _assemble(blocks: list[torch.Tensor], split, n: int) -> torch.Tensor:
    if split is None:
        return blocks[0]
    groups = [b.reshape(-1, s, n) for b, s in zip(blocks, split)]
    return torch.cat(groups, dim=1).reshape(-1, n)


def _make(opt_name, shape_name, seed=0, **kw):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(*SHAPES[shape_name]) * 0.05)
    opt = OPTIMIZERS[opt_name]([p], qkv_split_shapes=_split_of(shape_name), **kw)
    return p, opt


def _lr_kw(opt_name):
    return dict(lr=0.05) if opt_name == "muon" else dict(lr=0.01)


# ----------------------------------------------------------------------------------------------------


def test_qkv_row_index_layout():
    q_idx, k_idx, v_idx = qkv_row_index(128, QKV_SPLIT)
    assert q_idx.tolist() == list(range(0, 32)) + list(range(64, 96))
    assert k_idx.tolist() == list(range(32, 48)) + list(range(96, 112))
    assert v_idx.tolist() == list(range(48, 64)) + list(range(112, 128))
    with pytest.raises(ValueError):
        qkv_row_index(100, QKV_SPLIT)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shape_name", sorted(SHAPES))
def test_sphere_and_fusion_invariants_every_step(opt_name, shape_name):
    p, opt = _make(opt_name, shape_name, gains_lr=0.05, **_lr_kw(opt_name))
    split = _split_of(shape_name)
    n = p.shape[1]
    for _ in range(4):
        p.grad = torch.randn_like(p)
        opt.step()
        g_row, g_col = opt.gains(p)
        W_hat = opt.direction(p)
        for blk in _blocks_by_view(W_hat, split):
            radius = math.sqrt(max(blk.shape[0], n))
            assert blk.norm().item() == pytest.approx(radius, rel=1e-5)
        torch.testing.assert_close(p.detach(), g_row[:, None] * W_hat * g_col[None, :], rtol=1e-6, atol=1e-7)
    assert (g_row - 1).abs().max() > 1e-3 and (g_col - 1).abs().max() > 1e-3, "gains should have moved"


# --- an explicit float64 reference of docs/optimizers.md §1.4 (own blocks, own Adam), for plain and QKV matrices


def _ref_run(W0, grads, base, split, lr, gains_lr, momentum=0.95, betas=(0.9, 0.99), eps=1e-8):
    n = W0.shape[1]

    def project(Wh):
        return _assemble([b * math.sqrt(max(b.shape[0], n)) / b.norm() for b in _blocks_by_view(Wh, split)], split, n)

    W = project(W0.double())
    rr, rc = [torch.full((s,), math.log(math.e - 1), dtype=torch.float64) for s in W.shape]
    adam_g = {k: torch.zeros_like(v) for k, v in (("mr", rr), ("vr", rr), ("mc", rc), ("vc", rc))}
    M = torch.zeros_like(W)
    V = torch.zeros_like(W)
    for t, G in enumerate(grads, start=1):
        G = G.double()
        gr, gc = F.softplus(rr), F.softplus(rc)
        Wh = W / (gr[:, None] * gc[None, :])
        d_rr = ((G * Wh) * gc[None, :]).sum(1) * torch.sigmoid(rr)
        d_rc = ((G * Wh) * gr[:, None]).sum(0) * torch.sigmoid(rc)
        Gh = G * gr[:, None] * gc[None, :]
        if base == "muon":
            M = momentum * M + (1 - momentum) * Gh
            Umom = (1 - momentum) * Gh + momentum * M
            blocks = [
                msign(b, steps=5, coefficients="quintic", dtype=torch.float64)
                * math.sqrt(max(b.shape) / min(b.shape))
                for b in _blocks_by_view(Umom, split)
            ]
            U = _assemble(blocks, split, n)
        else:
            M = betas[0] * M + (1 - betas[0]) * Gh
            V = betas[1] * V + (1 - betas[1]) * Gh**2
            U = (M / (1 - betas[0] ** t)) / ((V / (1 - betas[1] ** t)).sqrt() + eps)
        Wh = project(Wh - lr * U)
        for rho, d, m, v in ((rr, d_rr, "mr", "vr"), (rc, d_rc, "mc", "vc")):
            adam_g[m] = betas[0] * adam_g[m] + (1 - betas[0]) * d
            adam_g[v] = betas[1] * adam_g[v] + (1 - betas[1]) * d**2
            rho -= gains_lr * (adam_g[m] / (1 - betas[0] ** t)) / ((adam_g[v] / (1 - betas[1] ** t)).sqrt() + eps)
        W = F.softplus(rr)[:, None] * Wh * F.softplus(rc)[None, :]
    return W, F.softplus(rr), F.softplus(rc)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shape_name", ["tall", "qkv_gqa"])
def test_matches_explicit_reference(opt_name, shape_name):
    torch.manual_seed(3)
    W0 = torch.randn(*SHAPES[shape_name]) * 0.05
    grads = [torch.randn_like(W0) for _ in range(3)]
    lr = _lr_kw(opt_name)["lr"]
    W_ref, gr_ref, gc_ref = _ref_run(W0, grads, opt_name, _split_of(shape_name), lr=lr, gains_lr=0.05)
    p = torch.nn.Parameter(W0.clone())
    opt = OPTIMIZERS[opt_name]([p], lr=lr, gains_lr=0.05, qkv_split_shapes=_split_of(shape_name))
    for G in grads:
        p.grad = G.clone()
        opt.step()
    g_row, g_col = opt.gains(p)
    torch.testing.assert_close(g_row.double(), gr_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_col.double(), gc_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p.detach().double(), W_ref, rtol=1e-4, atol=1e-5)


# --- gain gradients vs autograd of an explicit factorised module


def _loss(W, X, Y):
    return ((X @ W.T - Y).square().sum() + (W**3).sum()) / X.shape[0]


@pytest.mark.parametrize("kind", ["softplus", "direct", "exp"])
@pytest.mark.parametrize("mode", ["rowcol", "row", "col"])
def test_gain_and_direction_grads_match_autograd(kind, mode):
    gp = gain_param(kind)
    torch.manual_seed(1)
    m, n = 24, 40
    W_hat = torch.randn(m, n, dtype=torch.float64, requires_grad=True)
    rr = (gp.phi_inv(torch.ones(m, dtype=torch.float64)) + 0.3 * torch.rand(m, dtype=torch.float64)).requires_grad_(
        mode in ("rowcol", "row"))
    rc = (gp.phi_inv(torch.ones(n, dtype=torch.float64)) + 0.3 * torch.rand(n, dtype=torch.float64)).requires_grad_(
        mode in ("rowcol", "col"))
    g_row = gp.phi(rr) if rr.requires_grad else None
    g_col = gp.phi(rc) if rc.requires_grad else None
    X, Y = torch.randn(8, n, dtype=torch.float64), torch.randn(8, m, dtype=torch.float64)
    W = W_hat * (g_row[:, None] if g_row is not None else 1) * (g_col[None, :] if g_col is not None else 1)
    _loss(W, X, Y).backward()

    W_leaf = W.detach().requires_grad_()
    _loss(W_leaf, X, Y).backward()
    G = W_leaf.grad
    gr = None if g_row is None else g_row.detach()
    gc = None if g_col is None else g_col.detach()
    W_rec = recover_direction(W.detach(), gr, gc)
    torch.testing.assert_close(W_rec, W_hat.detach())
    d_row, d_col = gain_grads(G, W_rec, gr, gc)
    if gr is not None:
        torch.testing.assert_close(d_row * gp.phi_prime(rr.detach()), rr.grad)
    else:
        assert d_row is None
    if gc is not None:
        torch.testing.assert_close(d_col * gp.phi_prime(rc.detach()), rc.grad)
    else:
        assert d_col is None
    torch.testing.assert_close(direction_grad(G, gr, gc), W_hat.grad)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shape_name", ["wide", "qkv_gqa"])
def test_optimizer_gain_grads_use_old_gains(opt_name, shape_name):
    """Inside a step, the gain gradient fed to Adam equals autograd through ρ at the pre-step gains."""
    p, opt = _make(opt_name, shape_name, gains_lr=0.2, **_lr_kw(opt_name))
    for _ in range(2):  # move the gains away from 1 first
        p.grad = torch.randn_like(p)
        opt.step()
    st = opt.state[p]
    rr = st["rho_row"].clone().requires_grad_()
    rc = st["rho_col"].clone().requires_grad_()
    W_hat = opt.direction(p)
    X, Y = torch.randn(8, p.shape[1]), torch.randn(8, p.shape[0])
    _loss(F.softplus(rr)[:, None] * W_hat * F.softplus(rc)[None, :], X, Y).backward()
    p.grad = None
    _loss(p, X, Y).backward()  # the model's own gradient of the fused W
    old = {k: st[k].clone() for k in ("exp_avg_row", "exp_avg_col")}
    opt.step()
    b1 = opt.param_groups[0]["gains_betas"][0]
    torch.testing.assert_close(st["exp_avg_row"], b1 * old["exp_avg_row"] + (1 - b1) * rr.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(st["exp_avg_col"], b1 * old["exp_avg_col"] + (1 - b1) * rc.grad, rtol=1e-4, atol=1e-7)


# --- relative update with frozen gains


def test_muon_md_relative_update_is_lr_across_widths():
    lr, widths, ratios = 0.01, (64, 128, 256, 512, 1024), {}
    for w in widths:
        torch.manual_seed(w)
        p = torch.nn.Parameter(torch.randn(w, w) / math.sqrt(w))
        opt = MuonMD([p], lr=lr, gains_lr=0.0)
        rel = []
        for _ in range(3):
            p.grad = torch.randn_like(p)
            before = p.detach().clone()
            opt.step()
            rel.append(((p.detach() - before).norm() / before.norm()).item())
        assert torch.equal(opt.gains(p)[0], torch.ones(w)), "gains_lr=0 must freeze the gains"
        ratios[w] = sum(rel) / len(rel) / lr
    print("MuonMD relative update / lr per width:", {w: round(r, 4) for w, r in ratios.items()})
    for w, r in ratios.items():
        assert abs(r - 1) < 0.15, f"width {w}: relative update {r:.4f} x lr"
    spread = max(ratios.values()) / min(ratios.values()) - 1
    assert spread < 0.10, f"relative update varies {spread:.2%} across widths: {ratios}"


# --- construction: projection, gains at exactly 1, first forward


@pytest.mark.parametrize("opt_cls", [MuonMD, AdamMD])
@pytest.mark.parametrize("kind", ["softplus", "direct", "exp"])
def test_first_forward_equals_projected_model(opt_cls, kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32, bias=False), torch.nn.Tanh(), torch.nn.Linear(32, 8, bias=False)
    )
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for q in reference.parameters():
            q.mul_(math.sqrt(max(q.shape)) / q.norm())
    opt = opt_cls(model.parameters(), lr=0.01, gain_param=kind)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=0)
        g_row, g_col = opt.gains(p)
        assert torch.equal(g_row, torch.ones(p.shape[0])) and torch.equal(g_col, torch.ones(p.shape[1]))
        assert torch.equal(opt.direction(p), p.detach())
    x = torch.randn(5, 16)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-6, atol=1e-7)


def test_one_dimensional_params_are_refused():
    lin = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="AdamW"):
        MuonMD(lin.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="AdamW"):
        AdamMD([lin.bias], lr=0.01)


# --- other modes


@pytest.mark.parametrize("sphere", ["row", "col"])
def test_row_and_col_spheres(sphere):
    p, opt = _make("muon", "tall", lr=0.05, gains_lr=0.05, sphere=sphere)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
        norms = opt.direction(p).norm(dim=1 if sphere == "row" else 0)
        torch.testing.assert_close(norms, torch.ones_like(norms), rtol=1e-5, atol=0)


@pytest.mark.parametrize("gains", ["row", "col", "none"])
def test_single_axis_and_no_gains(gains):
    p, opt = _make("muon", "wide", lr=0.05, gains_lr=0.05, gains=gains)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    g_row, g_col = opt.gains(p)
    assert (g_row is None) == (gains in ("col", "none")) and (g_col is None) == (gains in ("row", "none"))
    assert opt.direction(p).norm().item() == pytest.approx(math.sqrt(128), rel=1e-5)
    if gains == "none":
        assert p.detach().norm().item() == pytest.approx(math.sqrt(128), rel=1e-5)


def test_direct_gains_stay_above_floor():
    p, opt = _make("adam", "square", lr=0.01, gains_lr=0.5, gain_param="direct", gains_min=1e-3)
    for _ in range(5):
        p.grad = torch.randn_like(p) * 10
        opt.step()
    g_row, g_col = opt.gains(p)
    assert g_row.min() >= 1e-3 and g_col.min() >= 1e-3


def test_state_dict_roundtrip_continues_identically():
    torch.manual_seed(0)
    grads = [torch.randn(48, 128) for _ in range(4)]
    p, opt = _make("muon", "wide", lr=0.05, gains_lr=0.05)
    for G in grads:
        p.grad = G.clone()
        opt.step()
    q, opt2 = _make("muon", "wide", lr=0.05, gains_lr=0.05)
    for G in grads[:2]:
        q.grad = G.clone()
        opt2.step()
    saved_w, saved_opt = q.detach().clone(), copy.deepcopy(opt2.state_dict())
    r, opt3 = _make("muon", "wide", seed=9, lr=0.05, gains_lr=0.05)
    with torch.no_grad():
        r.copy_(saved_w)
    opt3.load_state_dict(saved_opt)
    assert set(opt3.state[r]) >= {"momentum_buffer", "rho_row", "rho_col", "exp_avg_row", "exp_avg_sq_row",
                                  "exp_avg_col", "exp_avg_sq_col", "gain_step"}
    for G in grads[2:]:
        r.grad = G.clone()
        opt3.step()
    torch.testing.assert_close(r.detach(), p.detach(), rtol=0, atol=0)


def test_reductions_go_through_the_reducer():
    """TP glue swaps the Reducer; every axis sum of the step must pass through it."""

    class Counting(Reducer):
        def __init__(self):
            self.calls = {"rows": 0, "cols": 0, "all": 0}

        def complete(self, partial, axis):
            self.calls[axis] += 1
            return super().complete(partial, axis)

    counting = Counting()

    class CountingMuonMD(MuonMD):
        def reducer_for(self, p):
            return counting

    p = torch.nn.Parameter(torch.randn(128, 64))
    opt = CountingMuonMD([p], lr=0.05, qkv_split_shapes=QKV_SPLIT)
    assert counting.calls == {"rows": 0, "cols": 0, "all": 3}  # init projection: one per Q/K/V block
    p.grad = torch.randn_like(p)
    opt.step()
    assert counting.calls == {"rows": 1, "cols": 1, "all": 6}


def test_qkv_split_read_from_param_attribute():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(128, 64))
    p.qkv_split_shapes = list(QKV_SPLIT)  # as the model builder tags fused linear_qkv weights
    AdamMD([p], lr=0.01)
    radii = [blk.norm().item() for blk in _blocks_by_view(p.detach(), QKV_SPLIT)]
    assert radii == pytest.approx([8.0, 8.0, 8.0], rel=1e-5)  # sqrt(max(64 rows, 64)), sqrt(max(32, 64)) x2


@pytest.mark.parametrize("mode", ["flat", "row", "col"])
def test_sphere_norms_are_accurate_on_big_matrices(mode):
    """fp32 vector_norm over a whole CPU matrix accumulates naively (5e-3 relative off at 131072x512);
    the projection must land on its sphere to fp32 accuracy at the real embedding/LM-head size."""
    from megatron_md.optim.sphere import project_

    torch.manual_seed(0)
    W = project_(torch.randn(131072, 512), mode)
    if mode == "flat":
        got = float(W.double().square().sum().sqrt())
        assert abs(got / max(W.shape) ** 0.5 - 1) < 1e-6  # radius sqrt(max(m, n))
    else:
        norms = W.double().square().sum(1 if mode == "row" else 0).sqrt()
        assert float((norms - 1).abs().max()) < 1e-6
