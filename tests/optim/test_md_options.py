"""MD options of the authors' code (docs/optimizers.md §1.2-1.5): flat / embed gains and sphere, the offset
parametrisation, preserve_init, the tangential gradient (--hs-p), the normalised update (--hs-u), and the Lion
base, each against an independent fp64 computation: the gain gradients come from autograd through φ, the sphere
and tangent space from their definitions, the bases from their papers' equations."""

from __future__ import annotations

import math

import pytest
import torch
from mdtest import run_and_compare as _run_and_compare
import torch.nn.functional as F

from megatron_md.optim import AdamMD, LionMD, MuonMD, msign

PHI = {
    "softplus": (F.softplus, lambda g: g + torch.log(-torch.expm1(-g))),
    "offset": (lambda r: 1 + r, lambda g: g - 1),
    "exp": (torch.exp, torch.log),
}
OPTIMIZERS = {"adam": AdamMD, "lion": LionMD, "muon": MuonMD}
BETAS = (0.9, 0.99)


def _norms(W, sphere):
    """The factor that puts W on its sphere (flat radius sqrt(max(m, n)); rows / columns of unit norm)."""
    if sphere == "flat":
        return math.sqrt(max(W.shape)) / W.norm()
    if sphere == "row":
        return 1 / W.norm(dim=1, keepdim=True)
    return 1 / W.norm(dim=0, keepdim=True)


def _project(W, sphere):
    return W * _norms(W, sphere)


def _radial(G, W, sphere):
    """Component of G along W, per the sphere's constraint (whole matrix, each row, each column)."""
    if sphere == "flat":
        return (G * W).sum() / (W * W).sum() * W
    dim = 1 if sphere == "row" else 0
    return (G * W).sum(dim, keepdim=True) / (W * W).sum(dim, keepdim=True) * W


class Reference:
    """One managed matrix in fp64, written from docs/optimizers.md §1.4 without the package's MD code."""

    def __init__(self, W0, base, lr, gains_lr, sphere="flat", gains="rowcol", phi="softplus", tangent=False,
                 normalize=False, preserve=False):
        self.base, self.lr, self.gains_lr, self.sphere = base, lr, gains_lr, sphere
        self.phi, phi_inv = PHI[phi]
        self.tangent, self.normalize = tangent, normalize
        W0 = W0.double()
        m, n = W0.shape
        one = torch.ones((), dtype=torch.float64)
        shapes = {"rowcol": {"row": m, "col": n}, "row": {"row": m}, "col": {"col": n}, "flat": {"flat": 1},
                  "none": {}}[gains]
        self.rho = {a: torch.full((k,), phi_inv(one).item(), dtype=torch.float64) for a, k in shapes.items()}
        if preserve:  # W0 = g ⊙ Π(W0): the sphere's factor goes into the gains, W0 stays the weight
            g = 1 / _norms(W0, sphere)
            axis = "flat" if gains == "flat" else ("col" if sphere == "col" or gains == "col" else "row")
            self.rho[axis] = phi_inv(g.reshape(-1).expand(shapes[axis]).clone())
            self.W_hat = W0 / g
        else:
            self.W_hat = _project(W0, sphere)
        self.gain_m = {a: torch.zeros_like(r) for a, r in self.rho.items()}
        self.gain_v = {a: torch.zeros_like(r) for a, r in self.rho.items()}
        self.M, self.V, self.t = torch.zeros_like(W0), torch.zeros_like(W0), 0

    def gamma(self, rho):
        m, n = self.W_hat.shape
        g = torch.ones(m, n, dtype=torch.float64)
        if "flat" in rho:
            g = g * self.phi(rho["flat"])
        if "row" in rho:
            g = g * self.phi(rho["row"])[:, None]
        if "col" in rho:
            g = g * self.phi(rho["col"])[None, :]
        return g

    @property
    def W(self):
        return self.gamma(self.rho) * self.W_hat

    def step(self, G):
        G, self.t = G.double(), self.t + 1
        rho = {a: r.clone().requires_grad_() for a, r in self.rho.items()}
        gam = self.gamma(rho)
        if rho:  # ∂L/∂ρ by autograd of L = <G, Γ(ρ) ⊙ Ŵ> (G is ∂L/∂W)
            (G * gam * self.W_hat).sum().backward()
        G_hat = G * gam.detach()
        if self.tangent:
            G_hat = G_hat - _radial(G_hat, self.W_hat, self.sphere)
        if self.base == "adam":
            self.M = BETAS[0] * self.M + (1 - BETAS[0]) * G_hat
            self.V = BETAS[1] * self.V + (1 - BETAS[1]) * G_hat**2
            U = (self.M / (1 - BETAS[0] ** self.t)) / ((self.V / (1 - BETAS[1] ** self.t)).sqrt() + 1e-8)
        elif self.base == "lion":
            U = torch.sign(BETAS[0] * self.M + (1 - BETAS[0]) * G_hat) / math.sqrt(min(G.shape))
            self.M = BETAS[1] * self.M + (1 - BETAS[1]) * G_hat
        else:  # Muon: EMA momentum, Nesterov, msign, shape_up
            self.M = 0.95 * self.M + 0.05 * G_hat
            U = msign(0.05 * G_hat + 0.95 * self.M, steps=5, dtype=torch.float64)
            U = U * math.sqrt(max(G.shape) / min(G.shape))
        if self.normalize:
            U = _project(U, self.sphere)
        self.W_hat = _project(self.W_hat - self.lr * U, self.sphere)
        for a, r in rho.items():
            d = r.grad
            self.gain_m[a] = BETAS[0] * self.gain_m[a] + (1 - BETAS[0]) * d
            self.gain_v[a] = BETAS[1] * self.gain_v[a] + (1 - BETAS[1]) * d**2
            m_hat = self.gain_m[a] / (1 - BETAS[0] ** self.t)
            v_hat = self.gain_v[a] / (1 - BETAS[1] ** self.t)
            self.rho[a] = self.rho[a] - self.gains_lr * m_hat / (v_hat.sqrt() + 1e-8)


def _pair(base, shape=(48, 80), seed=0, lr=None, gains_lr=0.05, **opts):
    torch.manual_seed(seed)
    W0 = torch.randn(*shape) * 0.05
    lr = lr if lr is not None else {"adam": 0.01, "lion": 0.02, "muon": 0.05}[base]
    ref = Reference(W0, base, lr, gains_lr, sphere=opts.get("sphere", "flat"), gains=opts.get("gains", "rowcol"),
                    phi=opts.get("gain_param", "softplus"), tangent=opts.get("tangent_grad", False),
                    normalize=opts.get("normalize_update", False), preserve=opts.get("preserve_init", False))
    p = torch.nn.Parameter(W0.clone())
    kw = dict(gains_lr=gains_lr, **opts)
    kw.update({"betas": BETAS} if base in ("adam", "lion") else {})
    kw.update({"gains_betas": BETAS} if base != "adam" else {})
    opt = OPTIMIZERS[base]([p], lr=lr, **kw)
    return p, opt, ref




CASES = {
    "flat-gains": ("adam", dict(gains="flat")),
    "flat-gains-muon": ("muon", dict(gains="flat")),
    "offset": ("adam", dict(gain_param="offset")),
    "offset-row-gains": ("muon", dict(gain_param="offset", gains="row")),
    "exp-col-gains": ("adam", dict(gain_param="exp", gains="col")),
    "tangent-flat": ("adam", dict(tangent_grad=True)),
    "tangent-row-sphere": ("adam", dict(tangent_grad=True, sphere="row", gains="row")),
    "tangent-col-sphere-muon": ("muon", dict(tangent_grad=True, sphere="col")),
    "normalize-flat": ("adam", dict(normalize_update=True)),
    "normalize-col-sphere": ("adam", dict(normalize_update=True, sphere="col", gains="flat")),
    "lion": ("lion", dict()),
    "lion-row-sphere-none": ("lion", dict(sphere="row", gains="none")),
    "preserve-flat-rowcol": ("adam", dict(preserve_init=True)),
    "preserve-flat-gains": ("muon", dict(preserve_init=True, gains="flat")),
    "preserve-row-sphere": ("adam", dict(preserve_init=True, sphere="row")),
    "preserve-col-sphere": ("lion", dict(preserve_init=True, sphere="col", gains="col")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_option_matches_fp64_reference(case):
    base, opts = CASES[case]
    _run_and_compare(*_pair(base, **opts))


@pytest.mark.parametrize("out_proj", [False, True])
def test_embed_mode_is_row_or_col_by_role(out_proj):
    """``embed``: row sphere and gains for most matrices, column ones for out-projections (a group option)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40, 24))
    opt = AdamMD([{"params": [p], "out_proj": out_proj}], lr=0.01, sphere="embed", gains="embed")
    axis = "col" if out_proj else "row"
    assert set(k for k in opt.state[p] if k.startswith("rho_")) == {f"rho_{axis}"}
    ref = Reference(p.detach().clone(), "adam", 0.01, 1e-3, sphere=axis, gains=axis)
    _run_and_compare(p, opt, ref)
    norms = opt.direction(p).norm(dim=0 if out_proj else 1)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=1e-5, atol=0)


def test_flat_gain_is_one_scalar():
    p, opt, _ = _pair("adam", gains="flat")
    assert opt.state[p]["rho_flat"].shape == (1,)
    g_row, g_col = opt.gains(p)
    assert g_row.ndim == 0 and g_col is None


def test_preserve_init_keeps_the_weights_and_seeds_the_gains():
    torch.manual_seed(2)
    W0 = torch.randn(64, 32) * 0.02
    W0[3] *= 10  # uneven row norms: the row sphere's gains must carry them
    for sphere, gains, axis in (("flat", "rowcol", 0), ("row", "rowcol", 0), ("col", "col", 1)):
        p = torch.nn.Parameter(W0.clone())
        opt = MuonMD([p], lr=0.02, sphere=sphere, gains=gains, preserve_init=True)
        assert torch.equal(p.detach(), W0), "preserve_init must not touch the weights"
        g = opt.gains(p)[axis]
        want = 1 / _norms(W0.double(), sphere)
        torch.testing.assert_close(g.double(), want.reshape(-1).expand(g.shape[0]), rtol=1e-5, atol=0)
        torch.testing.assert_close(opt.direction(p).double(), _project(W0.double(), sphere), rtol=1e-5, atol=1e-6)


def test_preserve_init_on_fused_qkv_seeds_each_block():
    """Flat sphere on Q, K, V separately: each block's rows get that block's norm ratio."""
    torch.manual_seed(3)
    split = (32, 16, 16)
    W0 = torch.randn(128, 64) * 0.03
    p = torch.nn.Parameter(W0.clone())
    opt = AdamMD([p], lr=0.01, qkv_split_shapes=split, preserve_init=True)
    g_row = opt.gains(p)[0].double()
    W3 = W0.double().reshape(2, 64, 64)
    for lo, hi in ((0, 32), (32, 48), (48, 64)):
        block = W3[:, lo:hi].reshape(-1, 64)
        want = block.norm() / math.sqrt(max(block.shape))
        torch.testing.assert_close(g_row.reshape(2, 64)[:, lo:hi], want.expand(2, hi - lo), rtol=1e-5, atol=0)
    assert torch.equal(p.detach(), W0)


@pytest.mark.parametrize("opts, match", [
    (dict(gains="none"), "needs gains"),
    (dict(sphere="row", gains="col"), "needs row gains"),
    (dict(sphere="col", gains="row"), "needs col gains"),
])
def test_preserve_init_refuses_gains_that_cannot_hold_the_norms(opts, match):
    with pytest.raises(ValueError, match=match):
        AdamMD([torch.nn.Parameter(torch.randn(8, 4))], lr=0.01, preserve_init=True, **opts)


def test_lion_relative_update_is_lr_across_shapes():
    """A full sign matrix times 1/sqrt(min(m, n)) has norm sqrt(max(m, n)) = the flat radius."""
    lr = 0.01
    for shape in ((64, 64), (32, 128), (256, 64)):
        torch.manual_seed(1)
        p = torch.nn.Parameter(torch.randn(*shape))
        opt = LionMD([p], lr=lr, gains="none")
        p.grad = torch.randn_like(p)
        before = p.detach().clone()
        U = torch.sign(p.grad * (1 - BETAS[0])) / math.sqrt(min(shape))  # M starts at 0
        pre = before - lr * U
        opt.step()
        assert ((pre - before).norm() / before.norm()).item() == pytest.approx(lr, rel=1e-5)
        torch.testing.assert_close(p.detach(), _project(pre, "flat"), rtol=1e-5, atol=1e-6)


def test_unknown_option_is_refused():
    with pytest.raises(TypeError, match="hs_u"):
        AdamMD([torch.nn.Parameter(torch.randn(4, 4))], lr=0.01, hs_u=True)


def test_soap_base_matches_emerging_optimizers_soap():
    """MD-SOAP without gains is SOAP on the direction, then the sphere: compare with emerging-optimizers' own SOAP
    optimizer stepping a copy of the direction (re-projected after each step, as MD does)."""
    from emerging_optimizers.soap import SOAP

    from megatron_md.optim import SoapMD

    torch.manual_seed(4)
    W0 = torch.randn(24, 40) * 0.1
    lr, betas = 0.01, (0.9, 0.95)
    p = torch.nn.Parameter(W0.clone())
    opt = SoapMD([p], lr=lr, betas=betas, eps=1e-8, shampoo_beta=0.95, gains="none")
    shadow = torch.nn.Parameter(_project(W0.double(), "flat").float())
    ref = SOAP([shadow], lr=lr, betas=betas, shampoo_beta=0.95, eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(5)
    with torch._dynamo.config.patch(disable=True):  # its Adam kernel is torch.compiled: eager is enough here
        for _ in range(4):
            G = torch.randn(W0.shape, generator=gen)
            p.grad, shadow.grad = G.clone(), G.clone()
            opt.step()
            ref.step()
            with torch.no_grad():
                shadow.copy_(_project(shadow.double(), "flat"))
    torch.testing.assert_close(p.detach(), shadow.detach(), rtol=1e-4, atol=1e-5)
    assert set(opt.base.side_state) <= set(opt.state[p])


@pytest.mark.parametrize("name", ["MuonMD", "AdamMD", "LionMD", "SoapMD", "AdEMAMixMD", "NormMD"])
def test_a_smaller_sphere_scales_every_base_s_step_alike(name):
    """``radius_scale`` (``--md-out-proj-radius``'s 1/sqrt(2L)) puts a matrix on a smaller sphere; its step must
    shrink by the same factor so the matrix turns by the same angle. Only Muon's (and the normalised base's) did:
    Adam's, Lion's, SOAP's and AdEMAMix's steps kept their size, turning out-projections c times further."""
    import megatron_md.optim as O

    c, lr = 0.25, 0.05
    W = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    G = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    out = {}
    for scale in (1.0, c):
        p = torch.nn.Parameter(W.clone())
        opt = getattr(O, name)([{"params": [p], "radius_scale": scale}], lr=lr, gains="none")
        start = p.detach().clone()
        for _ in range(2):
            p.grad = G.clone()
            opt.step()
        out[scale] = (start, p.detach().clone())
    (a0, a1), (b0, b1) = out[1.0], out[c]
    assert torch.allclose(b0, c * a0, atol=1e-6)  # the same direction on the smaller sphere
    assert torch.allclose(b1, c * a1, atol=1e-5), (b1 / c - a1).abs().max()  # turned by the same angle
