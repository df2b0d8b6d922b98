"""Gain and base options of the authors' research branch (docs/optimizers.md §1.13): low-rank gains, per-block Q/K/V
column gains, the gains' Adam without bias correction and with its own betas / eps / weight decay, the floor
gains_min, gains_no_clamp, and the AdEMAMix and normalised-momentum bases. Each against an fp64 reference written
from the definitions (gain gradients by autograd through φ or through 1 + A·B, Q/K/V blocks from a reshape of
Megatron's layout), plus properties and refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from mdtest import run_and_compare as _run_and_compare
import torch.nn.functional as F

from megatron_md.optim import AdamMD, AdEMAMixMD, MuonMD, NormMD, Reducer, msign

PHI = {
    "softplus": (F.softplus, lambda g: g + torch.log(-torch.expm1(-g))),
    "direct": (lambda r: r, lambda g: g),
    "offset": (lambda r: 1 + r, lambda g: g - 1),
    "exp": (torch.exp, torch.log),
}
OPTIMIZERS = {"adam": AdamMD, "muon": MuonMD, "ademamix": AdEMAMixMD, "norm": NormMD}
BETAS = (0.9, 0.99)
SPLIT = (32, 16, 16)  # GQA: per query group 32 Q rows, 16 K rows, 16 V rows; 2 groups in a 128-row matrix


def _block_of_rows(m, split):
    """Block index (0 Q, 1 K, 2 V) of every row, from Megatron's per-query-group layout."""
    if split is None:
        return torch.zeros(m, dtype=torch.long)
    r = torch.arange(m) % sum(split)
    return (r >= split[0]).long() + (r >= split[0] + split[1]).long()


class Reference:
    """One managed matrix in fp64, from docs/optimizers.md §1.4 and §1.13, without the package's MD code."""

    def __init__(self, W0, base, lr, gains_lr, *, gains="rowcol", phi="softplus", split=None, split_gains=False,
                 lowrank=None, lowrank_min=1e-2, gains_min=0.0, bias_correction=True, gains_betas=BETAS,
                 gains_eps=1e-8, gains_wd=0.0, wd=0.0, betas=BETAS, ademamix=(0.999, 5.0, 0, 0), nesterov=True,
                 rho=None):
        self.base, self.lr, self.gains_lr, self.wd = base, lr, gains_lr, wd
        self.phi, self.phi_inv = PHI[phi]
        self.betas, self.gains_betas, self.gains_eps, self.gains_wd = betas, gains_betas, gains_eps, gains_wd
        self.bias_correction, self.lowrank_min, self.ademamix, self.nesterov = (
            bias_correction, lowrank_min, ademamix, nesterov)
        W0 = W0.double()
        m, n = W0.shape
        self.block = _block_of_rows(m, split)
        self.blocks = [torch.nonzero(self.block == b).reshape(-1) for b in range(3 if split else 1)]
        one = torch.ones((), dtype=torch.float64)
        if lowrank is not None:  # (A0, k): A from the optimizer's seeded draw, B zero
            self.raw = {"A": lowrank.double().clone(), "B": torch.zeros(lowrank.shape[1], n, dtype=torch.float64)}
        else:
            col = (3, n) if split_gains else (n,)
            shapes = {"rowcol": {"row": (m,), "col": col}, "col": {"col": col}, "row": {"row": (m,)}}[gains]
            self.raw = {a: torch.full(s, self.phi_inv(one).item(), dtype=torch.float64) for a, s in shapes.items()}
        for a, r in (rho or {}).items():
            self.raw[a] = r.double().reshape(self.raw[a].shape).clone()
        self.floor = self.phi_inv(torch.tensor(gains_min, dtype=torch.float64)) if gains_min > 0 else None
        self.gm = {a: torch.zeros_like(r) for a, r in self.raw.items()}
        self.gv = {a: torch.zeros_like(r) for a, r in self.raw.items()}
        self.W_hat = self._project(W0)
        self.M, self.V, self.S = (torch.zeros_like(W0) for _ in range(3))
        self.t = 0

    def _project(self, X):
        X = X.clone()
        for rows in self.blocks:
            b = X[rows]
            X[rows] = b * math.sqrt(max(b.shape)) / b.norm()
        return X

    def gamma(self, raw):
        m, n = self.W_hat.shape
        if "A" in raw:  # straight through the floor: forward clamped, gradient of 1 + A·B
            g = 1 + raw["A"] @ raw["B"]
            return g + (g.clamp_min(self.lowrank_min) - g).detach()
        g = torch.ones(m, n, dtype=torch.float64)
        if "row" in raw:
            g = g * self.phi(raw["row"])[:, None]
        if "col" in raw:
            c = self.phi(raw["col"])
            g = g * (c[self.block] if c.ndim == 2 else c[None, :])
        return g

    @property
    def W(self):
        return self.gamma(self.raw) * self.W_hat

    def _ademamix_schedule(self):
        beta3, alpha, w3, wa = self.ademamix
        t, b1 = self.t, self.betas[0]
        if t < wa:
            alpha = alpha * t / wa
        if t < w3:  # half-life ln(1/2)/ln(β) moves linearly from β1's to β3's
            a = t / w3
            h = (1 - a) * math.log(0.5) / math.log(b1) + a * math.log(0.5) / math.log(beta3)
            beta3 = 0.5 ** (1 / h)
        return alpha, beta3

    def step(self, G):
        G, self.t = G.double(), self.t + 1
        raw = {a: r.clone().requires_grad_() for a, r in self.raw.items()}
        gam = self.gamma(raw)
        (G * gam * self.W_hat).sum().backward()
        G_hat = G * gam.detach()
        b1, b2 = self.betas
        if self.base in ("muon", "norm"):
            self.M = 0.95 * self.M + 0.05 * G_hat
            D = 0.05 * G_hat + 0.95 * self.M if self.nesterov else self.M.clone()
            U = torch.zeros_like(D)
            for rows in self.blocks:
                Db = D[rows]
                mb, nb = Db.shape
                if self.base == "muon":
                    U[rows] = msign(Db, steps=5, dtype=torch.float64) * math.sqrt(max(mb, nb) / min(mb, nb))
                else:  # on the block's flat sphere, then Muon's shape_up factor
                    U[rows] = Db / Db.norm() * math.sqrt(max(mb, nb)) * math.sqrt(max(mb, nb) / min(mb, nb))
        else:
            self.M = b1 * self.M + (1 - b1) * G_hat
            self.V = b2 * self.V + (1 - b2) * G_hat**2
            num = self.M / (1 - b1**self.t)
            if self.base == "ademamix":
                alpha, beta3 = self._ademamix_schedule()
                self.S = beta3 * self.S + (1 - beta3) * G_hat
                num = num + alpha * self.S
            U = num / ((self.V / (1 - b2**self.t)).sqrt() + 1e-8)
        self.W_hat = self._project((1 - self.lr * self.wd) * self.W_hat - self.lr * U)
        gb1, gb2 = self.gains_betas
        for a, r in raw.items():
            d = r.grad
            self.gm[a] = gb1 * self.gm[a] + (1 - gb1) * d
            self.gv[a] = gb2 * self.gv[a] + (1 - gb2) * d**2
            c1, c2 = (1 - gb1**self.t, 1 - gb2**self.t) if self.bias_correction else (1.0, 1.0)
            new = self.raw[a] * (1 - self.gains_lr * self.gains_wd)
            new = new - self.gains_lr * (self.gm[a] / c1) / ((self.gv[a] / c2).sqrt() + self.gains_eps)
            self.raw[a] = new.clamp_min(self.floor) if self.floor is not None and a not in ("A", "B") else new


def _pair(base, shape=(128, 64), seed=0, lr=None, gains_lr=0.05, rho=None, **opts):
    torch.manual_seed(seed)
    W0 = torch.randn(*shape) * 0.05
    lr = lr if lr is not None else {"adam": 0.01, "ademamix": 0.01, "muon": 0.05, "norm": 0.05}[base]
    betas = opts.pop("betas", BETAS)
    kw = dict(gains_lr=gains_lr, **opts)
    if base in ("adam", "ademamix"):  # gains_betas unset: the matrices' betas
        kw["betas"] = betas
    elif "gains_betas" not in kw:
        kw["gains_betas"] = BETAS
    p = torch.nn.Parameter(W0.clone())
    opt = OPTIMIZERS[base]([p], lr=lr, **kw)
    st = opt.state[p]
    if rho:  # start the gains elsewhere: the optimizer's state and W (W = Γ ⊙ Ŵ) both move there
        W_hat = opt.direction(p)
        for a, r in rho.items():
            st[f"rho_{a}"].copy_(r)
        with torch.no_grad():
            g_row, g_col = opt.gains(p)
            p.copy_(W_hat * g_row[:, None] * g_col[None, :])
    ref_kw = dict(
        gains=opts.get("gains", "rowcol"), phi=opts.get("gain_param", "softplus"), split=opts.get("qkv_split_shapes"),
        split_gains=opts.get("split_qkv_gains", False), lowrank_min=opts.get("gains_lowrank_min", 1e-2),
        gains_min=opts.get("gains_min") or 0.0, bias_correction=opts.get("gains_bias_correction", True),
        betas=betas, gains_betas=opts.get("gains_betas", betas), gains_eps=opts.get("gains_eps", 1e-8),
        wd=opts.get("weight_decay", 0.0), nesterov=opts.get("nesterov", True), rho=rho,
        gains_wd=opts.get("gains_weight_decay") if opts.get("gains_weight_decay") is not None
        else opts.get("weight_decay", 0.0),
        ademamix=(opts.get("beta3", 0.999), opts.get("alpha", 5.0), opts.get("beta3_warmup", 0),
                  opts.get("alpha_warmup", 0)),
    )
    if opts.get("gains") == "lowrank":
        ref_kw["lowrank"] = st["rho_lowrank_a"]
    ref = Reference(W0, base, lr, gains_lr, **ref_kw)
    return p, opt, ref




CASES = {
    "lowrank-muon": ("muon", dict(gains="lowrank")),
    "lowrank-adam-rank2-std": ("adam", dict(gains="lowrank", gains_rank=2, gains_lowrank_init_std=0.3)),
    "lowrank-floor-active": ("adam", dict(gains="lowrank", gains_lowrank_min=0.98, gains_lr=0.2)),
    "lowrank-qkv-blocks": ("muon", dict(gains="lowrank", qkv_split_shapes=SPLIT)),
    "split-qkv-rowcol-muon": ("muon", dict(split_qkv_gains=True, qkv_split_shapes=SPLIT, gains_lr=0.2)),
    "split-qkv-rowcol-adam": ("adam", dict(split_qkv_gains=True, qkv_split_shapes=SPLIT, gains_lr=0.2)),
    "split-qkv-col-exp": ("adam", dict(split_qkv_gains=True, qkv_split_shapes=SPLIT, gains="col",
                                       gain_param="exp", gains_lr=0.2)),
    "no-bias-correction-muon": ("muon", dict(gains_bias_correction=False)),
    "no-bias-correction-adam": ("adam", dict(gains_bias_correction=False, gains_betas=(0.9, 0.999))),
    "gains-min-softplus": ("adam", dict(gains_min=0.97, gains_lr=0.3)),
    "gains-min-offset": ("muon", dict(gains_min=0.97, gain_param="offset", gains_lr=0.3)),
    "gains-min-exp-split": ("adam", dict(gains_min=0.97, gain_param="exp", gains_lr=0.3, split_qkv_gains=True,
                                         qkv_split_shapes=SPLIT)),
    "gains-betas-eps-wd-adam": ("adam", dict(gains_betas=(0.8, 0.95), gains_eps=1e-3, gains_weight_decay=0.5,
                                             weight_decay=0.1, gains_lr=0.1)),
    "gains-betas-eps-wd-muon": ("muon", dict(gains_betas=(0.7, 0.9), gains_eps=1e-4, weight_decay=0.2,
                                             gains_lr=0.1)),
    "gains-reuse-run-adam": ("adam", dict(betas=(0.8, 0.95), weight_decay=0.3, gains_lr=0.1)),  # None: the run's betas, eps, decay
    "ademamix": ("ademamix", dict()),
    "ademamix-warmups": ("ademamix", dict(beta3=0.9999, alpha=8.0, beta3_warmup=3, alpha_warmup=2)),
    "ademamix-alpha-warmup": ("ademamix", dict(beta3=0.9, alpha=8.0, alpha_warmup=3)),  # fast slow EMA: α shows
    "ademamix-lowrank-qkv": ("ademamix", dict(gains="lowrank", qkv_split_shapes=SPLIT, beta3_warmup=10)),
    "norm": ("norm", dict()),
    "norm-qkv-no-nesterov": ("norm", dict(qkv_split_shapes=SPLIT, nesterov=False)),
    "norm-split-gains-wd": ("norm", dict(qkv_split_shapes=SPLIT, split_qkv_gains=True, weight_decay=0.1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_option_matches_fp64_reference(case):
    base, opts = CASES[case]
    _run_and_compare(*_pair(base, **opts))


@pytest.mark.parametrize("base", ["adam", "muon"])
def test_no_clamp_with_a_negative_gain_matches_reference(base):
    """direct gains without a floor can cross zero; gains_no_clamp recovers Ŵ with the true gains, the reference's
    definition (W = Γ ⊙ Ŵ, Ŵ carried exactly)."""
    rho = {"row": torch.linspace(-0.5, 1.5, 128), "col": torch.linspace(0.5, 1.5, 64)}
    _run_and_compare(*_pair(base, gain_param="direct", gains_min=0.0, gains_no_clamp=True, rho=rho))


def test_no_clamp_inverts_the_fusion_and_clamp_does_not():
    """lr = gains_lr = 0 with a negative gain: with gains_no_clamp the step leaves W as it was; the default
    floor (1e-8) on the division breaks the round trip."""
    out = {}
    for no_clamp in (False, True):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(32, 24))
        opt = AdamMD([p], lr=0.0, gains_lr=0.0, gain_param="direct", gains_min=0.0, gains_no_clamp=no_clamp)
        W_hat = opt.direction(p)
        opt.state[p]["rho_row"][3] = -0.5
        with torch.no_grad():
            p.copy_(W_hat * opt.gains(p)[0][:, None])
        before = p.detach().clone()
        p.grad = torch.randn_like(p)
        opt.step()
        out[no_clamp] = (p.detach() - before).abs().max().item()
    assert out[True] < 1e-6 and out[False] > 0.1


@pytest.mark.parametrize("kind", ["softplus", "direct", "offset", "exp"])
def test_gains_min_floor_holds(kind):
    """A gradient that pulls every gain down: with gains_min the gains stop at it, without they pass it."""
    floor = 0.8
    mins = {}
    for gmin in (None, floor):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(24, 16))
        opt = AdamMD([p], lr=0.0, gains_lr=0.1, gain_param=kind, gains_min=gmin)
        for _ in range(10):
            p.grad = p.detach().clone()  # ∂L/∂γ > 0 for every gain
            opt.step()
        mins[gmin] = min(g.min().item() for g in opt.gains(p))
    assert mins[None] < floor - 0.05
    assert mins[floor] >= floor * (1 - 1e-6)


def test_direct_default_floor_is_the_old_one():
    """gains_min unset: 1e-5 for direct (the floor that keeps its gains positive), none for the others."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 8))
    opt = AdamMD([p], lr=0.0, gains_lr=0.5, gain_param="direct")
    for _ in range(8):
        p.grad = p.detach().clone() * 10
        opt.step()
    assert min(g.min().item() for g in opt.gains(p)) == pytest.approx(1e-5, rel=1e-6)


def test_lowrank_is_identity_at_init_and_seeded():
    torch.manual_seed(0)
    W0 = torch.randn(96, 40)
    p = torch.nn.Parameter(W0.clone())
    opt = MuonMD([p], lr=0.02, gains="lowrank", gains_rank=3)
    st = opt.state[p]
    assert st["rho_lowrank_a"].shape == (96, 3) and st["rho_lowrank_b"].shape == (3, 40)
    assert torch.equal(st["rho_lowrank_b"], torch.zeros(3, 40))
    g_row, g_col = opt.gains(p)
    assert g_col is None and torch.equal(g_row, torch.ones(96, 40))
    torch.testing.assert_close(p.detach(), W0 * math.sqrt(96) / W0.norm())  # only the sphere's projection
    # the same draw for the same seed and name, another for another seed or name; rank capped at min(m, n)
    A = st["rho_lowrank_a"]
    q = torch.nn.Parameter(W0.clone())
    assert torch.equal(MuonMD([q], lr=0.02, gains="lowrank", gains_rank=3).state[q]["rho_lowrank_a"], A)
    q = torch.nn.Parameter(W0.clone())
    assert not torch.equal(
        MuonMD([q], lr=0.02, gains="lowrank", gains_rank=3, gains_lowrank_seed=1).state[q]["rho_lowrank_a"], A)
    q = torch.nn.Parameter(W0.clone())
    q.md_key = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(MuonMD([q], lr=0.02, gains="lowrank", gains_rank=3).state[q]["rho_lowrank_a"], A)
    q = torch.nn.Parameter(torch.randn(6, 2))
    assert MuonMD([q], lr=0.02, gains="lowrank").state[q]["rho_lowrank_a"].shape == (6, 2)


@pytest.mark.parametrize("rank, std", [(4, None), (2, 0.1)])
def test_lowrank_init_std(rank, std):
    p = torch.nn.Parameter(torch.randn(4096, 64))
    A = AdamMD([p], lr=0.01, gains="lowrank", gains_rank=rank, gains_lowrank_init_std=std).state[p]["rho_lowrank_a"]
    want = std if std is not None else rank**-0.5
    assert A.std().item() == pytest.approx(want, rel=0.05) and abs(A.mean().item()) < 0.05 * want


def test_lowrank_floor_holds_and_state_dict_resumes():
    """Γ never drops below gains_lowrank_min; A and B travel in the state dict, so a resume continues exactly."""
    torch.manual_seed(0)
    grads = [torch.randn(48, 32) for _ in range(6)]

    def make():
        torch.manual_seed(5)
        p = torch.nn.Parameter(torch.randn(48, 32))
        return p, AdamMD([p], lr=0.01, gains_lr=0.3, gains="lowrank", gains_lowrank_min=0.9)

    p, opt = make()
    for G in grads:
        p.grad = G.clone()
        opt.step()
        gamma = opt.gains(p)[0]
        floor = torch.tensor(0.9).item()  # in fp32
        assert floor <= gamma.min().item() < 0.95  # the floor is reached and holds
    q, opt2 = make()
    for G in grads[:3]:
        q.grad = G.clone()
        opt2.step()
    saved_w, saved = q.detach().clone(), copy.deepcopy(opt2.state_dict())
    r, opt3 = make()
    with torch.no_grad():
        r.copy_(saved_w)
    opt3.load_state_dict(saved)
    for G in grads[3:]:
        r.grad = G.clone()
        opt3.step()
    assert torch.equal(r.detach(), p.detach())


def test_split_qkv_column_gains_differ_per_block():
    p, opt, _ = _pair("adam", split_qkv_gains=True, qkv_split_shapes=SPLIT, gains_lr=0.1)
    assert opt.state[p]["rho_col"].shape == (3 * 64,)
    p.grad = torch.randn_like(p)
    opt.step()
    q_col, k_col, v_col = opt.state[p]["rho_col"].view(3, 64)
    assert not torch.allclose(q_col, k_col) and not torch.allclose(k_col, v_col) and not torch.allclose(q_col, v_col)
    # and each block's rows carry that block's gains: W = γ_r Ŵ γ_c,block
    g_row, g_col = opt.gains(p)
    W3 = (p.detach() / opt.direction(p) / g_row[:, None]).view(2, 64, 64)
    for rows, col in ((slice(0, 32), q_col), (slice(32, 48), k_col), (slice(48, 64), v_col)):
        torch.testing.assert_close(W3[:, rows], F.softplus(col).expand(2, rows.stop - rows.start, 64))
    # a matrix without Q/K/V blocks keeps one column vector
    plain = torch.nn.Parameter(torch.randn(16, 8))
    assert AdamMD([plain], lr=0.01, split_qkv_gains=True).state[plain]["rho_col"].shape == (8,)


def test_split_qkv_gain_sums_go_through_the_reducer():
    calls = []

    class Counting(Reducer):
        def complete(self, partial, axis):
            calls.append((axis, tuple(partial.shape)))
            return super().complete(partial, axis)

    class CountingAdamMD(AdamMD):
        def reducer_for(self, p):
            return Counting()

    p = torch.nn.Parameter(torch.randn(128, 64))
    opt = CountingAdamMD([p], lr=0.01, split_qkv_gains=True, qkv_split_shapes=SPLIT)
    calls.clear()
    p.grad = torch.randn_like(p)
    opt.step()
    assert ("rows", (3, 64)) in calls and ("cols", (128,)) in calls


def test_lowrank_refused_on_tensor_parallel_shards():
    class RowSharded(Reducer):
        def global_shape(self, local_shape):
            return 2 * int(local_shape[0]), int(local_shape[1])

    class ShardedAdamMD(AdamMD):
        def reducer_for(self, p):
            return RowSharded()

    with pytest.raises(ValueError, match="lowrank.*tensor-parallel"):
        ShardedAdamMD([torch.nn.Parameter(torch.randn(8, 4))], lr=0.01, gains="lowrank")


def test_no_bias_correction_first_gain_step_factor():
    """Step 1: corrected Adam moves ρ by lr·d/(|d|+ε) ≈ lr; uncorrected by lr·(1-β1)d/(sqrt(1-β2)|d|+ε)."""
    moves = {}
    for bc in (True, False):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(32, 16))
        opt = AdamMD([p], lr=0.0, gains_lr=1e-2, betas=(0.9, 0.999), gains_eps=1e-12, gains_bias_correction=bc)
        before = opt.state[p]["rho_row"].clone()
        p.grad = torch.randn_like(p)
        opt.step()
        moves[bc] = (opt.state[p]["rho_row"] - before).abs()
    torch.testing.assert_close(moves[True], torch.full_like(moves[True], 1e-2), rtol=1e-4, atol=0)
    torch.testing.assert_close(moves[False] / moves[True], torch.full_like(moves[True], 0.1 / math.sqrt(0.001)),
                               rtol=1e-4, atol=0)


def test_ademamix_schedules():
    from megatron_md.optim.bases import ademamix_schedule
    from megatron_md.optim.md import MDHyperParams

    hp = MDHyperParams(lr=1.0, betas=(0.9, 0.99), ademamix_beta3=0.9999, ademamix_alpha=8.0,
                       ademamix_beta3_warmup=100, ademamix_alpha_warmup=50)
    assert ademamix_schedule(25, hp)[0] == pytest.approx(4.0)
    assert ademamix_schedule(50, hp)[0] == 8.0 and ademamix_schedule(500, hp) == (8.0, 0.9999)
    half_life = lambda b: math.log(0.5) / math.log(b)  # noqa: E731
    assert ademamix_schedule(0, hp)[1] == pytest.approx(0.9, rel=1e-7)
    mid = ademamix_schedule(30, hp)[1]
    assert half_life(mid) == pytest.approx(0.7 * half_life(0.9) + 0.3 * half_life(0.9999), rel=1e-6)
    off = MDHyperParams(lr=1.0, ademamix_beta3=0.99, ademamix_alpha=3.0)
    assert ademamix_schedule(1, off) == (3.0, 0.99)


def test_ademamix_without_slow_term_is_adam_md():
    runs = []
    for cls, kw in ((AdamMD, {}), (AdEMAMixMD, dict(alpha=0.0))):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(40, 24))
        opt = cls([p], lr=0.01, gains_lr=0.05, **kw)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append(p.detach())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale_mode, factor", [("none", 1.0), ("shape_up", math.sqrt(96 / 32))])
def test_norm_md_relative_step(scale_mode, factor):
    """The projected momentum has the flat radius sqrt(max(m, n)), so the relative step is lr times Muon's scale
    factor: exactly lr with scale_mode none, lr·sqrt(max/min) with shape_up."""
    m, n, lr = 96, 32, 0.01
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(m, n))
    opt = NormMD([p], lr=lr, gains="none", scale_mode=scale_mode)
    before = p.detach().clone()
    p.grad = torch.randn_like(p)
    U = p.grad * 0.05 * (1 + 0.95)  # Nesterov from zero momentum: (1-β)Ĝ + β(1-β)Ĝ
    pre = before - lr * factor * math.sqrt(m) * U / U.norm()
    opt.step()
    assert ((pre - before).norm() / before.norm()).item() == pytest.approx(lr * factor, rel=1e-5)
    torch.testing.assert_close(p.detach(), pre * math.sqrt(m) / pre.norm(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opts, match", [
    (dict(gains="blocks"), "unknown gains mode"),
    (dict(gains_min=-0.1), "gains_min"),
    (dict(gains_rank=0), "gains_rank"),
    (dict(gains_rank=2.5), "gains_rank"),
    (dict(gains_lowrank_init_std=0.0), "gains_lowrank_init_std"),
    (dict(gains_lowrank_min=-1.0), "gains_lowrank_min"),
    (dict(gains_lowrank_seed=0.5), "gains_lowrank_seed"),
    (dict(gains="lowrank", preserve_init=True), "preserve_init"),
    (dict(gains="lowrank", gains_min=0.1), "gains_min"),
    (dict(gains="row", split_qkv_gains=True), "split_qkv_gains"),
    (dict(gains="embed", split_qkv_gains=True), "split_qkv_gains"),
    (dict(gains_betas=(1.0, 0.9)), r"gains_betas\[0\]"),
    (dict(gains_betas=(0.9, -0.1)), r"gains_betas\[1\]"),
    (dict(gains_eps=-1e-8), "gains_eps"),
    (dict(gains_weight_decay=-0.1), "gains_weight_decay"),
])
def test_bad_gain_options_are_refused(opts, match):
    with pytest.raises(ValueError, match=match):
        MuonMD([torch.nn.Parameter(torch.randn(8, 4))], lr=0.01, **opts)


@pytest.mark.parametrize("opts, match", [
    (dict(beta3=1.0), "ademamix_beta3"),
    (dict(alpha=-1.0), "ademamix_alpha"),
    (dict(beta3_warmup=-5), "ademamix_beta3_warmup"),
    (dict(alpha_warmup=2.5), "ademamix_alpha_warmup"),
])
def test_bad_ademamix_options_are_refused(opts, match):
    with pytest.raises(ValueError, match=match):
        AdEMAMixMD([torch.nn.Parameter(torch.randn(8, 4))], lr=0.01, **opts)


def test_unknown_keyword_still_refused():
    with pytest.raises(TypeError, match="gains_minimum"):
        AdamMD([torch.nn.Parameter(torch.randn(4, 4))], lr=0.01, gains_minimum=1e-3)


def test_gmin_keeps_its_meaning():
    """``gmin`` (the earlier keyword) still floors ``direct`` gains and leaves the others alone."""
    from megatron_md.optim import AdamMD

    direct = MuonMD([torch.nn.Parameter(torch.randn(8, 4))], lr=0.01, gain_param="direct", gmin=1e-3)
    assert direct.param_groups[0]["gains_min"] == 1e-3
    soft = AdamMD([torch.nn.Parameter(torch.randn(8, 4))], lr=0.01, gmin=1e-3)
    assert soft.param_groups[0].get("gains_min") is None
