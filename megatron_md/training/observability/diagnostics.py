"""Weight-geometry and attention diagnostics, cheap enough to leave on.

Every log interval: per hidden matrix σ_max, σ_min, ‖Off(WᵀW)‖_F and ‖W‖_F (TP shards gathered
first), MD gain statistics where MD manages the matrix, with ``--log-update-norms`` its relative
update over that step, and per layer the max attention logit and mean attention entropy of the
interval's last micro-batch (first sequence). The values land in ``metrics.jsonl`` (keys
``diag/...``), TensorBoard and W&B; ``tools/plot_spectra.py`` draws them.
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)\.weight$")
_ROLES = [
    ("self_attention.linear_qkv", "attention.qkv"),
    ("self_attention.linear_proj", "attention.proj"),
    ("mlp.linear_fc1", "mlp.fc1"),
    ("mlp.linear_fc2", "mlp.fc2"),
    ("mlp.router", "router"),
]
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_(fc\d)$")  # canonical (mcore/naming.py)


def label(md_key: str) -> str | None:
    """``decoder.layers.3.self_attention.linear_qkv.weight`` -> ``L3.attention.qkv``; a routed expert's
    matrix, SequentialMLP's ``local_experts.5.linear_fc1.weight`` or TEGroupedMLP's ``linear_fc1.weight5``,
    -> ``L1.expert5.fc1`` (md_keys carry the global expert; a raw grouped name its local index)."""
    from megatron_md.mcore.naming import canonical_name

    m = _LAYER.match(canonical_name(md_key or ""))
    if not m:
        return None
    layer, rest = m.groups()
    e = _EXPERT.match(rest)
    if e:
        return f"L{layer}.expert{e.group(1)}.{e.group(2)}"
    for prefix, role in _ROLES:
        if rest == prefix:
            return f"L{layer}.{role}"
    return None


def _gather_full(p: torch.Tensor) -> torch.Tensor:
    W = p.detach().float()
    if not getattr(p, "tensor_model_parallel", False):
        return W
    group = ps.get_expert_tensor_parallel_group() if getattr(p, "expert_tp", False) else ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return W
    parts = [torch.empty_like(W) for _ in range(size)]
    dist.all_gather(parts, W.contiguous(), group=group)
    return torch.cat(parts, dim=p.partition_dim)


# Exact singular values up to this smaller side: about the crossover on one CPU core (4n×n
# Gaussian, whole matrix_stats: exact 11 vs estimated 10 ms at n = 256, even at 384, 45 vs 24 ms
# at 512, 340 vs 130 ms at 1024; exact 1.5 vs 3.3 ms at 128). Below it
# the estimates' fixed cost (2 × 32 Lanczos steps, a Cholesky) does not pay; above it the full SVD
# (O(mn²) plus a poorly parallel bidiagonal solve) dominates (benchmarks/diagnostics_cost.py).
EXACT_SVD_MAX_SIDE = 256
LANCZOS_STEPS = 32  # Lanczos steps per extreme; σ_max within ~0.2%, σ_min within ~0.01% of the SVD on the kinds tested
# Redo σ_min from a float64 Gram when the float32 one cannot carry it: condition number above
# _ILL_CONDITIONED (Gram rounding ~eps₃₂·cond² relative on σ_min²), or σ_min² within
# _JITTER_MARGIN of the Cholesky jitter.
_ILL_CONDITIONED = 300.0
_JITTER_MARGIN = 100.0


def _lanczos_top(matvec, n: int, steps: int, dtype, device) -> torch.Tensor:
    """Largest Ritz value of a symmetric operator after ``steps`` Lanczos steps (full re-orthogonalisation).

    Fixed-seed start (the training RNG is left alone). A breakdown (exhausted Krylov space) continues
    from the re-orthogonalised rounding noise with a zero coupling: the tridiagonal stays the
    operator's projection, so the top Ritz value stays a lower bound that only improves.
    """
    steps = min(steps, n)
    gen = torch.Generator(device=device).manual_seed(0)
    Q = torch.zeros(steps + 1, n, dtype=dtype, device=device)  # Lanczos vectors as rows
    v = torch.randn(n, generator=gen, dtype=dtype, device=device)
    Q[0] = v / v.norm()
    alpha, beta = [], []
    for j in range(steps):
        w = matvec(Q[j])
        alpha.append(Q[j] @ w)
        w = w - (Q @ w) @ Q
        w = w - (Q @ w) @ Q  # twice is enough (Kahan-Parlett)
        b = w.norm()
        beta.append(b)
        Q[j + 1] = w / b.clamp_min(torch.finfo(dtype).tiny)
    T = torch.diag(torch.stack(alpha))
    if steps > 1:
        off = torch.stack(beta[:-1])
        T = T + torch.diag(off, 1) + torch.diag(off, -1)
    return torch.linalg.eigvalsh(T)[-1]


def _sigma_min_inverse(G: torch.Tensor, lam_max: float, eps: float, steps: int) -> tuple[float, float]:
    """(σ_min, jitter δ) from Lanczos on (G + δI)⁻¹ through a Cholesky factor L of the float64 Gram G.

    δ starts at eps·λ_max (eps of the precision G was formed in) and grows 100× until the factor
    exists; σ_min² = λ_min(G + δI) − δ, so a δ far above σ_min² amplifies the Lanczos error.
    """
    n = G.shape[0]
    eye = torch.eye(n, dtype=G.dtype, device=G.device)
    delta = max(eps * lam_max, torch.finfo(G.dtype).tiny)
    for _ in range(8):
        L, info = torch.linalg.cholesky_ex(G + delta * eye)
        if int(info) == 0:
            break
        delta *= 100.0

    def inv(v):  # (G + δI)⁻¹v: two triangular solves, O(n²)
        y = torch.linalg.solve_triangular(L, v[:, None], upper=False)
        return torch.linalg.solve_triangular(L.mT, y, upper=True)[:, 0]

    inv_top = _lanczos_top(inv, n, steps, G.dtype, G.device)
    return math.sqrt(max(1.0 / inv_top.item() - delta, 0.0)), delta


def matrix_stats(W: torch.Tensor, steps: int = LANCZOS_STEPS) -> dict[str, float]:
    """σ_max, σ_min, ‖Off(WᵀW)‖_F (Gram of the smaller side), ‖W‖_F of one matrix.

    Exact (``svdvals``) when the smaller side is at most ``EXACT_SVD_MAX_SIDE``. Above it, from the
    n×n Gram G of the smaller side (formed anyway for ‖Off‖: ‖Off(G)‖² = ‖G‖_F² − Σ diag²):
    σ_max² = λ_max(G) by Lanczos on G, σ_min² = 1/λ_max(G⁻¹) by Lanczos on G⁻¹ through a Cholesky
    factor (O(n³/3), a sixth of the Gram's 2mn²). Krylov methods on G itself (Lanczos, LOBPCG,
    power iteration on σ_max²I − G) cannot reach σ_min within 2% in a few dozen steps on square or
    ill-conditioned matrices (the small end of G's spectrum is crowded relative to its width); the
    inverse is not. The float32 Gram carries rounding ~eps₃₂·σ_max², too much for σ_min once the
    condition number passes a few hundred: then σ_min is redone from a float64 Gram (below ~10⁻⁷·σ_max
    σ_min is resolved only to about that, absolutely).
    """
    X = W if W.shape[0] >= W.shape[1] else W.T
    gram = X.T @ X
    off = (gram.pow(2).sum() - gram.diagonal().pow(2).sum()).clamp_min(0).sqrt()
    sigma_max, sigma_min = _sigma_extremes(X, gram, steps)
    return {"sigma_max": sigma_max, "sigma_min": sigma_min, "off_gram": off.item(), "fro": W.norm().item()}


def _sigma_extremes(X: torch.Tensor, gram: torch.Tensor, steps: int) -> tuple[float, float]:
    """(σ_max, σ_min) of X (m ≥ n) given its n×n Gram."""
    n = X.shape[1]
    if n <= EXACT_SVD_MAX_SIDE:
        sv = torch.linalg.svdvals(X)
        return sv.max().item(), sv.min().item()
    G = gram.double()
    lam_max = _lanczos_top(lambda v: G @ v, n, steps, G.dtype, G.device).item()
    if not math.isfinite(lam_max):
        return float("nan"), float("nan")
    sigma_max = math.sqrt(max(lam_max, 0.0))
    if sigma_max == 0.0:
        return 0.0, 0.0
    sigma_min, delta = _sigma_min_inverse(G, lam_max, torch.finfo(gram.dtype).eps, steps)
    if gram.dtype != torch.float64 and (
        sigma_min * _ILL_CONDITIONED < sigma_max or sigma_min**2 < _JITTER_MARGIN * delta
    ):
        X64 = X.double()
        sigma_min, _ = _sigma_min_inverse(X64.T @ X64, lam_max, torch.finfo(torch.float64).eps, steps)
    return sigma_max, sigma_min


# Query rows per chunk of the attention probe, and the most logits one block of heads may hold.
PROBE_CHUNK = 256
PROBE_BLOCK_ELEMS = 1 << 22  # 16 MiB of float32 per temporary


@torch.no_grad()
def attention_stats(q: torch.Tensor, k: torch.Tensor, chunk: int = PROBE_CHUNK,
                    block_elems: int = PROBE_BLOCK_ELEMS) -> tuple[torch.Tensor, torch.Tensor]:
    """Max causal logit and mean causal attention entropy of one sequence, as 0-d tensors.

    ``q`` is [s, heads, d], ``k`` is [s, groups, d] (GQA: query head h reads group h // (heads/groups)).
    Queries go in chunks of ``chunk`` rows, heads in blocks of whole groups, so a block holds at most
    about ``block_elems`` logits (and never fewer than one group × one chunk × s): memory O(chunk·s)
    per head instead of the dense s² per head. Rows are complete within a chunk (keys past the
    chunk's last query are masked for all of it and never formed), so max and softmax are exact;
    the maximum and the entropy sum run across chunks.
    """
    s, heads, d = q.shape
    groups = k.shape[1]
    rep = heads // groups
    qf = q.float().reshape(s, groups, rep, d)
    kf = k.float()
    root_d = math.sqrt(d)
    gb = max(1, min(groups, block_elems // max(1, rep * chunk * s)))
    best = torch.full((), float("-inf"), device=q.device)
    ent_sum = torch.zeros((), dtype=torch.float64, device=q.device)
    pos = torch.arange(s, device=q.device)
    for s0 in range(0, s, chunk):
        s1 = min(s, s0 + chunk)
        causal = pos[:s1].unsqueeze(0) <= pos[s0:s1].unsqueeze(1)  # [c, t]: key t visible to query
        for g0 in range(0, groups, gb):
            g1 = min(groups, g0 + gb)
            logits = torch.einsum("cgrd,tgd->grct", qf[s0:s1, g0:g1], kf[:s1, g0:g1]).div_(root_d)
            logits.masked_fill_(~causal, float("-inf"))
            best = torch.maximum(best, logits.amax())
            probs = logits.softmax(-1)
            del logits
            plogp = probs.clamp_min(1e-30).log_().mul_(probs)  # three temporaries at most
            ent_sum -= plogp.sum(-1).sum(dtype=torch.float64)
            del probs, plogp
    return best, (ent_sum / (s * heads)).float()


class AttentionProbe:
    """Forward pre-hooks on each layer's core attention that measure logits when armed."""

    def __init__(self, gpt_model):
        self.armed = False
        self.values: dict[str, float] = {}
        self.handles = []
        for layer in getattr(getattr(gpt_model, "decoder", None), "layers", []):
            core = getattr(layer.self_attention, "core_attention", None)
            if core is not None:
                self.handles.append(core.register_forward_pre_hook(self._hook(layer.layer_number - 1)))

    def _hook(self, layer_idx: int):
        def hook(module, args):
            if not self.armed or len(args) < 2:
                return
            q, k = args[0], args[1]  # [s, b, heads, d] and [s, b, groups, d]
            max_logit, entropy = attention_stats(q[:, 0], k[:, 0])
            self.values[f"L{layer_idx}.max_logit"] = max_logit.item()
            self.values[f"L{layer_idx}.attn_entropy"] = entropy.item()

        return hook

    def take(self) -> dict[str, float]:
        out, self.values = self.values, {}
        return out


def _labelled_matrices(model):
    """(name, parameter, label) of every hidden matrix the diagnostics report, in module order."""
    from megatron.core.utils import unwrap_model as unwrap

    for name, p in unwrap(model).named_parameters():
        lab = label(getattr(p, "md_key", name))
        if lab is not None and p.ndim == 2:
            yield name, p, lab


def snapshot(model) -> dict[str, torch.Tensor]:
    """This rank's shard of every reported matrix, copied in its own dtype: the "before" of a relative update."""
    return {name: p.detach().clone() for name, p, _ in _labelled_matrices(model)}


def _rel_update(p: torch.Tensor, before: torch.Tensor) -> float:
    """‖W − W_before‖_F / ‖W_before‖_F of the whole matrix: the shards' squared norms summed over TP (a collective
    of the matrix's TP group, so every rank of it must call)."""
    sums = torch.stack([(p.detach().float() - before.float()).square().sum(), before.float().square().sum()])
    if getattr(p, "tensor_model_parallel", False):
        group = ps.get_expert_tensor_parallel_group() if getattr(p, "expert_tp", False) else ps.get_tensor_model_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
    return math.sqrt(sums[0].item() / sums[1].item()) if sums[1].item() > 0 else float("nan")


def weight_diagnostics(model, gains: dict, before: dict | None = None) -> dict[str, float]:
    """This rank's share of the matrix statistics (TP rank 0 of each group reports); ``gains``: {md_key: (row,
    column gains)} of the matrices whose optimizer keeps gains (the family's ``RunHooks.matrix_gains``);
    ``before``: a ``snapshot`` from before this step's update, for each matrix's ``rel_update``."""
    out: dict[str, float] = {}
    for name, p, lab in _labelled_matrices(model):
        key = getattr(p, "md_key", name)
        W = _gather_full(p)
        rel = _rel_update(p, before[name]) if before is not None and name in before else None
        tp_rank = (ps.get_expert_tensor_parallel_rank() if getattr(p, "expert_tp", False)
                   else ps.get_tensor_model_parallel_rank())
        if tp_rank != 0:
            continue
        if rel is not None:
            out[f"diag/{lab}/rel_update"] = rel
        for k, v in matrix_stats(W).items():
            out[f"diag/{lab}/{k}"] = v
        for axis, g in zip(("row", "col"), gains.get(key, (None, None))):
            if g is not None:  # local shard's gains: enough for a trend
                axis = "flat" if g.ndim == 0 else axis  # one gain per matrix
                out[f"diag/{lab}/gain_{axis}_mean"] = g.mean().item()
                out[f"diag/{lab}/gain_{axis}_max"] = g.max().item()
    return out


def collect(model, gains: dict, probe: AttentionProbe | None, before: dict | None = None) -> dict[str, float]:
    """Gather every rank's diagnostics (all ranks must call); returns the merged dict (``gains``, ``before``: as
    ``weight_diagnostics``)."""
    local = weight_diagnostics(model, gains, before)
    if probe is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        local.update({f"diag/{k}": v for k, v in probe.take().items()})
    elif probe is not None:
        probe.take()
    if ps.get_data_parallel_rank() != 0:
        local = {k: v for k, v in local.items() if ".expert" in k}  # experts differ across EP
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: dict[str, float] = {}
    for part in parts:
        merged.update(part or {})
    return dict(sorted(merged.items()))
