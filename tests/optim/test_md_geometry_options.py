"""MD sphere geometry options (docs/optimizers.md §1.2.1-1.2.4): the Sinkhorn spheres (rowcol, invrowcol, equi),
the spectral and orthogonal sphere kinds, the ball, per-head spheres and per-head Newton-Schulz on fused QKV.

Each option is checked against an independent fp64 computation written from the definitions (Sinkhorn
sweeps written out, spectral norms from ``torch.linalg.matrix_norm(ord=2)``, polar factors from the SVD,
Q/K/V blocks and heads by explicit row slicing), by properties of the result, and on simulated
tensor-parallel shards (threads whose reducers sum like TP's all-reduce)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from mdtest import run_and_compare as _run_and_compare
import torch.nn.functional as F

from megatron_md.optim import AdamMD, MuonMD, msign
from megatron_md.optim.blocks import matrix_blocks
from megatron_md.optim.geometry import Geometry, project_direction_
from megatron_md.optim.sphere import Reducer, tangent_

BETAS = (0.9, 0.99)
SPLIT = (32, 16, 16)  # two query heads of 16 rows per group, one K and one V head: 128 x 64 holds 2 groups
PHI, PHI_INV = F.softplus, (lambda g: g + torch.log(-torch.expm1(-g)))


# ----------------------------------------------------------------------------------------------------
# The definitions, in fp64, one block at a time


def qkv_blocks(m, split):
    """Row indices of Q, K, V in megatron's per-query-group interleaving, written out."""
    q, k, v = split
    per = q + k + v
    out = [[], [], []]
    for g in range(m // per):
        for i, (off, cnt) in enumerate(((0, q), (q, k), (q + k, v))):
            out[i] += range(g * per + off, g * per + off + cnt)
    return [torch.tensor(r) for r in out]


def head_blocks(m, hd):
    return [torch.arange(s, s + hd) for s in range(0, m, hd)]


def sinkhorn_ref(W, mode, iters, ball):
    """Alternate column and row normalisation (invrowcol: rows first), norms recomputed after every division;
    the ball divides by max(norm, 1) instead. Returns the result and the accumulated row / column divisors."""
    X, a, b = W.clone(), torch.ones(W.shape[0], 1, dtype=W.dtype), torch.ones(1, W.shape[1], dtype=W.dtype)
    order = (1, 0) if mode == "invrowcol" else (0, 1)  # dim 0: column norms, dim 1: row norms
    for _ in range(1 if mode == "equi" else iters):
        for dim in order:
            nrm = X.norm(dim=dim, keepdim=True)
            nrm = nrm.clamp_min(1.0) if ball else nrm
            X = X / nrm
            if dim == 0:
                b = b / nrm
            else:
                a = a / nrm
    return X, a, b


def project_ref(W, sphere="flat", kind="l2", ball=False, radius_scale=1.0, iters=10):
    """Π of one block from its definition."""
    m, n = W.shape
    if kind == "spectral":
        s, R = torch.linalg.matrix_norm(W, ord=2), radius_scale
        return W * (R / max(s, torch.tensor(R)) if ball else R / s)
    if kind == "orthogonal":
        U, _, Vh = torch.linalg.svd(W, full_matrices=False)
        return radius_scale * U @ Vh
    if sphere in ("rowcol", "invrowcol", "equi"):
        return sinkhorn_ref(W, sphere, iters, ball)[0]
    if sphere == "flat":
        R, nrm = radius_scale * math.sqrt(max(m, n)), W.norm()
        return W * (R / max(nrm, torch.tensor(R)) if ball else R / nrm)
    nrm = W.norm(dim=1 if sphere == "row" else 0, keepdim=True)
    return W / (nrm.clamp_min(1.0) if ball else nrm)


def project_blocks_ref(W, blocks, **geo):
    out = W.clone()
    for rows in blocks:
        out[rows] = project_ref(W[rows], **geo)
    return out


class Reference:
    """One managed matrix in fp64 (row and column softplus gains, Muon or Adam base), from docs/optimizers.md §1.4,
    with the sphere of ``project_blocks_ref`` over ``sphere_blocks`` and msign over ``update_blocks``."""

    def __init__(self, W0, base, lr, gains_lr, sphere_blocks, update_blocks, geo, ns=(5, "quintic"),
                 normalize=False, tangent=False, preserve=False):
        self.base, self.lr, self.gains_lr, self.geo, self.ns = base, lr, gains_lr, geo, ns
        self.sphere_blocks, self.update_blocks = sphere_blocks, update_blocks
        self.normalize, self.tangent = normalize, tangent
        W0 = W0.double()
        m, n = W0.shape
        rho0 = PHI_INV(torch.ones((), dtype=torch.float64)).item()
        self.rho = {a: torch.full((k,), rho0, dtype=torch.float64) for a, k in (("row", m), ("col", n))}
        if preserve == "sinkhorn":  # W0 = diag(1/a)·Π(W0)·diag(1/b): the divisors go into the gains
            self.W_hat, a, b = sinkhorn_ref(W0, geo["sphere"], geo.get("iters", 10), geo.get("ball", False))
            self.rho = {"row": PHI_INV(1 / a.reshape(-1)), "col": PHI_INV(1 / b.reshape(-1))}
        elif preserve:  # a scalar factor, held by the row gains
            self.W_hat = project_blocks_ref(W0, sphere_blocks, **geo)
            self.rho["row"] = PHI_INV((W0.norm() / self.W_hat.norm()).expand(m).clone())
        else:
            self.W_hat = project_blocks_ref(W0, sphere_blocks, **geo)
        self.gm = {a: torch.zeros_like(r) for a, r in self.rho.items()}
        self.gv = {a: torch.zeros_like(r) for a, r in self.rho.items()}
        self.M, self.V, self.t = torch.zeros_like(W0), torch.zeros_like(W0), 0

    def gamma(self, rho):
        return PHI(rho["row"])[:, None] * PHI(rho["col"])[None, :]

    @property
    def W(self):
        return self.gamma(self.rho) * self.W_hat

    def step(self, G):
        G, self.t = G.double(), self.t + 1
        rho = {a: r.clone().requires_grad_() for a, r in self.rho.items()}
        gam = self.gamma(rho)
        (G * gam * self.W_hat).sum().backward()
        G_hat = G * gam.detach()
        if self.tangent:  # flat sphere, per block: drop the component along Ŵ
            for rows in self.sphere_blocks:
                Wb = self.W_hat[rows]
                G_hat[rows] = G_hat[rows] - (G_hat[rows] * Wb).sum() / (Wb * Wb).sum() * Wb
        if self.base == "adam":
            self.M = BETAS[0] * self.M + (1 - BETAS[0]) * G_hat
            self.V = BETAS[1] * self.V + (1 - BETAS[1]) * G_hat**2
            U = (self.M / (1 - BETAS[0] ** self.t)) / ((self.V / (1 - BETAS[1] ** self.t)).sqrt() + 1e-8)
            U = U * self.geo.get("radius_scale", 1.0)  # the step shrinks with the sphere, as Muon's below
        else:  # Muon: EMA momentum, Nesterov, msign and shape_up per update block (times radius_scale)
            self.M = 0.95 * self.M + 0.05 * G_hat
            N = 0.05 * G_hat + 0.95 * self.M
            U = torch.zeros_like(N)
            for rows in self.update_blocks:
                b = N[rows]
                scale = math.sqrt(max(b.shape) / min(b.shape)) * self.geo.get("radius_scale", 1.0)
                U[rows] = scale * msign(b, steps=self.ns[0], coefficients=self.ns[1], dtype=torch.float64)
        if self.normalize:
            U = project_blocks_ref(U, self.sphere_blocks, **self.geo)
        self.W_hat = project_blocks_ref(self.W_hat - self.lr * U, self.sphere_blocks, **self.geo)
        for a, r in rho.items():
            d = r.grad
            self.gm[a] = BETAS[0] * self.gm[a] + (1 - BETAS[0]) * d
            self.gv[a] = BETAS[1] * self.gv[a] + (1 - BETAS[1]) * d**2
            m_hat, v_hat = self.gm[a] / (1 - BETAS[0] ** self.t), self.gv[a] / (1 - BETAS[1] ** self.t)
            self.rho[a] = self.rho[a] - self.gains_lr * m_hat / (v_hat.sqrt() + 1e-8)


def spiked(shape, seed, sigma=4.0):
    """A matrix with a clear top singular value, so power iteration converges well within 10 steps."""
    g = torch.Generator().manual_seed(seed)
    u, v = torch.randn(shape[0], 1, generator=g), torch.randn(1, shape[1], generator=g)
    return 0.05 * torch.randn(*shape, generator=g) + sigma * 0.05 * u @ v / math.sqrt(min(shape))


def _pair(base, shape=(48, 80), seed=0, lr=None, gains_lr=0.05, W0=None, ns=(5, "quintic"), **opts):
    torch.manual_seed(seed)
    W0 = torch.randn(*shape) * 0.05 if W0 is None else W0
    lr = lr if lr is not None else {"adam": 0.01, "muon": 0.05}[base]
    m = shape[0]
    split, hd = opts.get("qkv_split_shapes"), opts.get("head_dim") or (SPLIT[1])
    qkv = qkv_blocks(m, split) if split else [torch.arange(m)]
    heads = head_blocks(m, hd) if split else qkv
    geo = {"sphere": opts.get("sphere", "flat"), "kind": opts.get("sphere_kind", "l2"),
           "ball": opts.get("ball", False), "radius_scale": opts.get("radius_scale", 1.0),
           "iters": opts.get("sphere_iters", 10)}
    preserve = opts.get("preserve_init", False) and ("sinkhorn" if geo["sphere"] in ("rowcol", "invrowcol", "equi")
                                                     else True)
    ref = Reference(W0, base, lr, gains_lr, heads if opts.get("split_heads") else qkv,
                    heads if opts.get("split_heads_update") else qkv, geo, ns=ns,
                    normalize=opts.get("normalize_update", False), tangent=opts.get("tangent_grad", False),
                    preserve=preserve)
    p = torch.nn.Parameter(W0.clone())
    group = {"params": [p], "ns_steps": ns[0], "ns_coefficients": ns[1]}
    if base == "adam":
        opt = AdamMD([group], lr=lr, gains_lr=gains_lr, betas=BETAS, **opts)
    else:
        opt = MuonMD([group], lr=lr, gains_lr=gains_lr, gains_betas=BETAS, **opts)
    return p, opt, ref




PE = (10, "polar_express")  # Newton-Schulz close to the exact polar factor (1e-6), for the orthogonal kind
QKV = dict(qkv_split_shapes=SPLIT)
CASES = {
    "rowcol": (dict(sphere="rowcol"), {}),
    "invrowcol": (dict(sphere="invrowcol"), {}),
    "equi": (dict(sphere="equi"), {}),
    "rowcol-3-sweeps": (dict(sphere="rowcol", sphere_iters=3), {}),
    "rowcol-qkv": (dict(sphere="rowcol", **QKV), dict(shape=(128, 64))),
    "rowcol-ball": (dict(sphere="rowcol", ball=True), dict(W0=torch.randn(48, 80) * 0.3)),  # rows and columns outside
    "equi-ball": (dict(sphere="equi", ball=True), dict(W0=torch.randn(48, 80) * 0.3)),
    "rowcol-normalize-update": (dict(sphere="rowcol", normalize_update=True), {}),
    "rowcol-preserve-init": (dict(sphere="rowcol", preserve_init=True), {}),
    "spectral": (dict(sphere_kind="spectral"), dict(W0=spiked((48, 80), 0))),
    "spectral-radius": (dict(sphere_kind="spectral", radius_scale=0.5), dict(W0=spiked((48, 80), 1))),
    "spectral-ball": (dict(sphere_kind="spectral", ball=True), dict(W0=spiked((48, 80), 2, sigma=40.0))),
    "orthogonal": (dict(sphere_kind="orthogonal"), dict(ns=PE)),
    "orthogonal-radius-normalize": (dict(sphere_kind="orthogonal", radius_scale=2.0, normalize_update=True),
                                    dict(ns=PE)),
    "orthogonal-qkv": (dict(sphere_kind="orthogonal", **QKV), dict(shape=(128, 64), ns=PE)),
    "ball-flat-inside": (dict(ball=True), {}),  # 0.05·randn is inside the sqrt(80) ball: no projection at all
    "ball-flat-outside": (dict(ball=True), dict(W0=torch.randn(48, 80))),
    "ball-row": (dict(ball=True, sphere="row"), dict(W0=torch.randn(48, 80) * 0.15)),
    "ball-col-qkv": (dict(ball=True, sphere="col", **QKV), dict(shape=(128, 64), W0=torch.randn(128, 64) * 0.15)),
    "ball-preserve-init": (dict(ball=True, preserve_init=True), dict(W0=torch.randn(48, 80))),
    "heads-flat": (dict(split_heads=True, **QKV), dict(shape=(128, 64))),
    "heads-flat-tangent": (dict(split_heads=True, tangent_grad=True, **QKV), dict(shape=(128, 64))),
    "heads-rowcol": (dict(split_heads=True, sphere="invrowcol", **QKV), dict(shape=(128, 64))),
    "heads-spectral": (dict(split_heads=True, sphere_kind="spectral", sphere_iters=40, **QKV),
                       dict(shape=(128, 64), W0=spiked((128, 64), 3, sigma=12.0))),
    "heads-orthogonal": (dict(split_heads=True, sphere_kind="orthogonal", **QKV), dict(shape=(128, 64), ns=PE)),
    "heads-ball": (dict(split_heads=True, ball=True, head_dim=16, **QKV),
                   dict(shape=(128, 64), W0=torch.randn(128, 64) * 0.2)),
}
MUON_ONLY = {
    "heads-update": dict(split_heads_update=True, **QKV),
    "heads-update-and-sphere": dict(split_heads_update=True, split_heads=True, **QKV),
    "heads-update-8": dict(split_heads_update=True, head_dim=8, **QKV),
}


@pytest.mark.parametrize("base", ["muon", "adam"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_option_matches_fp64_reference(case, base):
    opts, kw = CASES[case]
    kw = dict(kw)
    if "W0" in kw:
        kw["W0"] = kw["W0"].clone()
        kw.setdefault("shape", tuple(kw["W0"].shape))
    if base == "adam" and "spectral" in case:
        kw["lr"] = 0.003  # Adam's step has a large spectral norm: keep the spike the top singular value
    _run_and_compare(*_pair(base, **kw, **opts))


@pytest.mark.parametrize("case", sorted(MUON_ONLY))
def test_per_head_newton_schulz_matches_fp64_reference(case):
    _run_and_compare(*_pair("muon", shape=(128, 64), **MUON_ONLY[case]))


def test_per_head_newton_schulz_goes_through_orthogonalize_all():
    """Every head is its own 2-D request (so an engine batches them by shape), with its own global shape."""
    seen = []

    class Recording(MuonMD):
        def orthogonalize_all(self, requests):
            seen.extend((tuple(U.shape), shape) for _, _, blocks in requests for U, shape in blocks)
            return super().orthogonalize_all(requests)

    p = torch.nn.Parameter(torch.randn(128, 64))
    opt = Recording([p], lr=0.02, qkv_split_shapes=SPLIT, split_heads_update=True)
    p.grad = torch.randn_like(p)
    opt.step()
    assert seen == [((16, 64), (16, 64))] * 8


# ----------------------------------------------------------------------------------------------------
# Properties


def _steps(opt, p, n=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("sphere, exact_dim, balanced", [("rowcol", 1, math.sqrt(48 / 80)),
                                                         ("invrowcol", 0, math.sqrt(80 / 48)),
                                                         ("equi", 1, None)])
def test_sinkhorn_spheres_reach_their_norms(sphere, exact_dim, balanced):
    """The last half-sweep's axis has unit norms; after 10 sweeps the other one is balanced (its norms all equal
    the value the unit axis forces: rows unit -> columns sqrt(m/n))."""
    torch.manual_seed(0)
    W0 = torch.randn(48, 80) * 0.05
    W0[3] *= 10
    p = torch.nn.Parameter(W0)
    opt = MuonMD([p], lr=0.05, sphere=sphere, gains="none")
    _steps(opt, p)
    W = p.detach().double()
    unit = W.norm(dim=exact_dim)
    torch.testing.assert_close(unit, torch.ones_like(unit), rtol=1e-5, atol=0)
    if balanced is not None:
        other = W.norm(dim=1 - exact_dim)
        torch.testing.assert_close(other, torch.full_like(other, balanced), rtol=1e-4, atol=0)


@pytest.mark.parametrize("sphere", ["rowcol", "invrowcol", "equi"])
def test_sinkhorn_sphere_does_not_depend_on_the_scale(sphere):
    """A sphere: Π(3W) = Π(W). (Dividing by row and column norms taken from the same matrix would instead return
    3·Π(W) after an even number of sweeps.)"""
    torch.manual_seed(1)
    W = torch.randn(40, 24)
    geo, blocks = Geometry(sphere), matrix_blocks(W.shape)
    torch.testing.assert_close(project_direction_(3 * W, blocks, geo), project_direction_(W.clone(), blocks, geo),
                               rtol=1e-5, atol=1e-6)


def test_spectral_and_orthogonal_kinds_set_the_singular_values():
    W0 = spiked((48, 80), 4)
    p = torch.nn.Parameter(W0.clone())
    opt = MuonMD([p], lr=0.05, sphere_kind="spectral", radius_scale=0.7, gains="none")
    _steps(opt, p)
    assert torch.linalg.matrix_norm(p.detach().double(), ord=2).item() == pytest.approx(0.7, rel=1e-5)
    p = torch.nn.Parameter(torch.randn(48, 80))
    opt = MuonMD([p], lr=0.05, sphere_kind="orthogonal", radius_scale=0.7, gains="none",
                 ns_steps=10, ns_coefficients="polar_express")
    _steps(opt, p)
    s = torch.linalg.svdvals(p.detach().double())
    torch.testing.assert_close(s, torch.full_like(s, 0.7), rtol=1e-5, atol=0)


BALLS = [Geometry("flat", ball=True), Geometry("row", ball=True), Geometry("col", ball=True),
         Geometry("rowcol", ball=True), Geometry("equi", ball=True), Geometry("flat", "spectral", ball=True),
         Geometry("flat", ball=True, radius_scale=0.5)]


@pytest.mark.parametrize("geo", BALLS, ids=lambda g: f"{g.mode}-{g.kind}-{g.radius_scale}")
def test_ball_never_grows_and_keeps_inside_points(geo):
    torch.manual_seed(2)
    blocks = matrix_blocks((48, 80))
    for scale in (0.01, 0.1, 1.0):
        X = torch.randn(48, 80) * scale
        X[5] *= 8
        out = project_direction_(X.clone(), blocks, geo)
        assert (out.abs() <= X.abs()).all(), "the ball only shrinks"
        if geo.mode in ("rowcol", "equi"):  # every row and every column ends inside the unit ball
            assert out.norm(dim=1).max() <= 1 + 1e-6 and out.norm(dim=0).max() <= 1 + 1e-6
        sphere = project_direction_(X.clone(), blocks, Geometry(geo.mode, geo.kind, False, geo.radius_scale))
        if geo.mode in ("flat",):  # a single norm: inside it is left alone, outside it lands on the sphere
            norm = torch.linalg.matrix_norm(X, ord=2) if geo.kind == "spectral" else X.norm()
            inside = norm <= geo.radius((48, 80))
            torch.testing.assert_close(out, X if inside else sphere, rtol=1e-5, atol=1e-7)
    small = torch.randn(48, 80) * 1e-3  # inside every ball here: bit-for-bit unchanged
    assert torch.equal(project_direction_(small.clone(), blocks, geo), small)


def test_ball_weights_inside_are_stepped_but_never_projected():
    """With the ball and no gains, a step that stays inside is exactly Ŵ - lr·U (no rescaling)."""
    torch.manual_seed(3)
    W0 = torch.randn(48, 80) * 0.01  # norm ~0.6, radius sqrt(80)
    p = torch.nn.Parameter(W0.clone())
    opt = AdamMD([p], lr=1e-3, ball=True, gains="none", betas=BETAS)
    assert torch.equal(p.detach(), W0)
    G = torch.randn(48, 80)
    p.grad = G.clone()
    opt.step()
    U = (0.1 * G / 0.1) / ((0.01 * G**2 / 0.01).sqrt() + 1e-8)  # Adam's first bias-corrected step
    torch.testing.assert_close(p.detach(), W0 - 1e-3 * U, rtol=1e-6, atol=1e-7)


def test_per_head_sphere_puts_every_head_on_its_own_radius():
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.randn(128, 64))
    opt = AdamMD([p], lr=0.01, split_heads=True, qkv_split_shapes=SPLIT)
    _steps(opt, p)
    heads = opt.direction(p).double().view(8, 16, 64)
    norms = heads.flatten(1).norm(dim=1)
    torch.testing.assert_close(norms, torch.full_like(norms, math.sqrt(64)), rtol=1e-5, atol=0)


def test_head_dim_defaults_to_kv_channels_and_may_be_given():
    torch.manual_seed(5)
    W0 = torch.randn(128, 64)
    outs = []
    for hd in (None, 16):
        p = torch.nn.Parameter(W0.clone())
        opt = MuonMD([p], lr=0.02, split_heads=True, split_heads_update=True, head_dim=hd, qkv_split_shapes=SPLIT)
        _steps(opt, p, n=2)
        outs.append(p.detach())
    assert torch.equal(*outs)


def test_split_heads_is_a_no_op_without_fused_qkv():
    torch.manual_seed(6)
    W0 = torch.randn(48, 80)
    outs = []
    for heads in (False, True):
        p = torch.nn.Parameter(W0.clone())
        opt = MuonMD([p], lr=0.02, split_heads=heads, split_heads_update=heads)
        _steps(opt, p, n=2)
        outs.append(p.detach())
    assert torch.equal(*outs)


# ----------------------------------------------------------------------------------------------------
# Tensor-parallel shards, simulated by threads


class _Hub:
    def __init__(self, size):
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size, timeout=60)

    def all_reduce(self, rank, t):
        self.slots[rank] = t.clone()
        self.barrier.wait()
        total = sum(self.slots[1:], self.slots[0].clone())
        self.barrier.wait()
        return total


class ShardReducer(Reducer):
    """Completes partial sums across the shards when the summed axis is split (the rule of TP's reducer)."""

    def __init__(self, hub, rank, dim):
        self.hub, self.rank, self.dim = hub, rank, dim

    def complete(self, partial, axis):
        crosses = axis == "all" or (axis == "rows") == (self.dim == 0)
        return self.hub.all_reduce(self.rank, partial) if crosses else partial

    def global_shape(self, local_shape):
        m, n = (int(x) for x in local_shape)
        return (m * self.hub.size, n) if self.dim == 0 else (m, n * self.hub.size)


def _on_shards(W, dim, size, fn):
    """``fn(shard, reducer)`` on each of ``size`` shards of ``W`` along ``dim``, in threads; results re-joined."""
    hub, shards, out, errors = _Hub(size), list(W.chunk(size, dim=dim)), [None] * size, []

    def run(rank):
        try:
            out[rank] = fn(shards[rank].clone(), ShardReducer(hub, rank, dim))
        except Exception as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return torch.cat(out, dim=dim)


SHARDED = {
    "rowcol-cols": (Geometry("rowcol"), None, False, 1),
    "invrowcol-rows": (Geometry("invrowcol"), None, False, 0),
    "equi-ball-rows": (Geometry("equi", ball=True), None, False, 0),
    "spectral-rows": (Geometry("flat", "spectral"), None, False, 0),
    "spectral-ball-cols": (Geometry("flat", "spectral", ball=True, radius_scale=0.5), None, False, 1),
    "flat-ball-cols": (Geometry("flat", ball=True, radius_scale=0.1), None, False, 1),
    "qkv-rowcol-rows": (Geometry("rowcol"), SPLIT, False, 0),
    "qkv-spectral-rows": (Geometry("flat", "spectral", iters=30), SPLIT, False, 0),
    "heads-flat-rows": (Geometry("flat"), SPLIT, True, 0),
    "heads-rowcol-cols": (Geometry("rowcol"), SPLIT, True, 1),
    "heads-orthogonal-rows": (Geometry("flat", "orthogonal", ns_steps=10, ns_coefficients="polar_express"),
                              SPLIT, True, 0),
}


@pytest.mark.parametrize("case", sorted(SHARDED))
def test_projection_on_shards_equals_the_whole_matrix(case):
    """Two TP shards (row shards hold whole query groups) give the projection of the whole matrix."""
    geo, split, heads, dim = SHARDED[case]
    W = spiked((128, 64), 7, sigma=10.0)

    def project(X, red):
        return project_direction_(X, matrix_blocks(X.shape, split, red, per_head=heads), geo, red)

    whole = project(W.clone(), Reducer())
    torch.testing.assert_close(_on_shards(W, dim, 2, project), whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["flat", "col"])
def test_tangent_on_per_head_spheres_on_shards_equals_the_whole_matrix(mode):
    W, G = torch.randn(128, 64), torch.randn(128, 64)
    both = torch.cat([W, G], dim=1)  # sharded together along rows

    def tangent(X, red):
        Wl, Gl = X.chunk(2, dim=1)
        return tangent_(Gl.clone(), Wl, matrix_blocks(Wl.shape, SPLIT, red, per_head=True), mode, red)

    whole = tangent(both.clone(), Reducer())
    torch.testing.assert_close(_on_shards(both, 0, 2, tangent), whole, rtol=1e-5, atol=1e-6)
    dims = (1, 2) if mode == "flat" else (1,)
    radial = (whole.view(8, 16, 64) * W.view(8, 16, 64)).sum(dim=dims)
    assert radial.abs().max() < 1e-4  # each head's gradient is tangent to that head's sphere


def test_orthogonal_kind_refuses_a_shard():
    W = torch.randn(128, 64)
    geo = Geometry("flat", "orthogonal")
    with pytest.raises(ValueError, match="orthogonal.*tensor-parallel shard"):
        _on_shards(W, 0, 2, lambda X, red: project_direction_(X, matrix_blocks(X.shape, SPLIT, red), geo, red))


# ----------------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("cls, opts, match", [
    (AdamMD, dict(sphere="sinkhorn"), "unknown sphere 'sinkhorn'"),
    (AdamMD, dict(sphere_kind="nuclear"), "unknown sphere_kind 'nuclear'"),
    (AdamMD, dict(sphere_kind="spectral", sphere="row"), "sphere_kind='spectral'.*sphere='flat'"),
    (AdamMD, dict(sphere_iters=0), "sphere_iters"),
    (AdamMD, dict(ball=True, sphere_kind="orthogonal"), "ball"),
    (AdamMD, dict(head_dim=0, split_heads=True), "head_dim"),
    (AdamMD, dict(split_heads=True, head_dim=12, qkv_split_shapes=SPLIT), "head_dim 12 must divide"),
    (AdamMD, dict(tangent_grad=True, sphere="rowcol"), "tangent_grad"),
    (AdamMD, dict(tangent_grad=True, sphere_kind="spectral"), "tangent_grad"),
    (AdamMD, dict(preserve_init=True, sphere_kind="orthogonal"), "preserve_init"),
    (AdamMD, dict(preserve_init=True, sphere="rowcol", gains="row"), "preserve_init.*rowcol gains"),
    (AdamMD, dict(preserve_init=True, sphere="equi", qkv_split_shapes=SPLIT), "preserve_init.*per-block"),
    (AdamMD, dict(split_heads_update=True, qkv_split_shapes=SPLIT), "split_heads_update"),
])
def test_bad_geometry_is_refused_naming_the_option(cls, opts, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.randn(128, 64))], lr=0.01, **opts)
