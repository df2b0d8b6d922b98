"""ManifoldMuon: module-wise Manifold Muon as a torch optimizer (docs/optimizers.md §2.1), pure torch.

Per matrix: sum-form momentum ``buf ← μ·buf + g``, ``u = g + μ·buf`` (Nesterov) as [MM-code], then
``manifold="none"``: plain Muon ``W ← W(1 - lr·wd) - lr·msign(u)`` (the only branch with weight decay);
otherwise ``W ← manifold_muon(W, u, lr)`` (dual solve + retraction, ``manifolds.py``).

Modes: ``faithful`` reproduces the reference loop per matrix (K = ``dual_steps`` msigns per step); ``fast``
batches same-shape matrices of a param group and amortises the dual ascent over optimizer steps
(``fast_dual_steps`` = 1 msign per step by default, a scale-free dual step, the correction carried to the
next step; ``manifolds.manifold_muon_fast``). Fused QKV is ONE matrix by default (the paper's geometry;
``WᵀW`` is invariant to Megatron's row interleaving); ``split_qkv=True`` constrains Q, K, V separately.

State per param (all tensors): ``momentum_buffer`` (fp32, like the param), ``dual_violation`` and
``dual_iters`` (last step's RMS tangent violation / dual iterations, max over blocks; 0-d tensors on the
param's device, written without a host sync and read only when reported) and, in fast mode,
``dual`` (or ``dual_q``/``dual_k``/``dual_v`` when split): the ``n x n`` warm-start correction,
``n = min(rows, cols)`` of the (block) matrix — ``n²`` extra floats per matrix, e.g. 2.4 MB for d = 768.

Tensor-parallel glue gathers the full matrix and calls ``manifold_step_(W_full, grad_full, state, hp)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .manifolds import (MANIFOLDS, RETRACTIONS, init_on_manifold, is_wide, manifold_muon, manifold_muon_fast,
                        polar_express)
from .blocks import qkv_row_index
from .md import matrix_params

MODES = ("faithful", "fast")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
_QKV_NAMES = ("q", "k", "v")


@dataclass
class ManifoldHyperParams:
    """Options of one ManifoldMuon param group."""

    lr: float
    manifold: str = "stiefel"
    mode: str = "faithful"
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.0  # used by manifold "none" only (the constrained branches have none, as [MM-code])
    dual_steps: int = 20
    dual_lr: float = 0.1
    tol: float = 1e-6
    msign_steps: int = 10
    # fast mode: amortised dual ascent (manifolds.manifold_muon_fast), a scale-free dual step
    fast_dual_steps: int = 1
    fast_dual_lr: float = 0.02
    fast_msign_steps: int = 8
    msign_dtype: Any = torch.float32  # the reference runs bf16; fp32 default for CPU accuracy
    column_preserving: bool = False  # DGram retraction variant
    retraction: str = "auto"  # fast-mode DGram retraction: exact (fp64 eigh), ns (GEMMs only), auto: ns off CPU
    radius: float | None = None  # sphere radius (None: keep the current one)
    split_qkv: bool = False
    qkv_split_shapes: tuple[int, int, int] | None = None

    @classmethod
    def from_group(cls, group: dict) -> "ManifoldHyperParams":
        names = {f.name for f in dataclasses.fields(cls)}
        hp = cls(**{k: v for k, v in group.items() if k in names})
        if isinstance(hp.msign_dtype, str):
            hp.msign_dtype = _DTYPES.get(hp.msign_dtype, hp.msign_dtype)
        return hp

    def validate(self) -> None:
        if self.manifold not in MANIFOLDS + ("none",):
            raise ValueError(f"unknown manifold {self.manifold!r}; choose one of {MANIFOLDS + ('none',)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {MODES}")
        if self.lr < 0 or not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"need lr >= 0 and momentum in [0, 1), got lr={self.lr}, momentum={self.momentum}")
        if self.msign_dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"msign_dtype must be fp32 or bf16, got {self.msign_dtype!r}")
        if self.retraction not in RETRACTIONS + ("auto",):
            raise ValueError(f"unknown retraction {self.retraction!r}; choose one of {RETRACTIONS + ('auto',)}")
        if self.dual_steps < 1 or self.fast_dual_steps < 1:
            raise ValueError(f"dual_steps and fast_dual_steps must be >= 1, got {self.dual_steps}, "
                             f"{self.fast_dual_steps}")


# ----------------------------------------------------------------------------------------------------
# Blocks (fused QKV split) and state


def qkv_blocks(p: torch.Tensor, hp: ManifoldHyperParams,
               n_rows: int | None = None) -> list[tuple[str, torch.Tensor | None]]:
    """``[(state_suffix, rows)]``: one whole-matrix entry, or the Q, K, V row sets with ``split_qkv``
    (``n_rows``: the full matrix's rows when ``p`` is a tensor-parallel shard)."""
    if not hp.split_qkv:
        return [("", None)]
    split = hp.qkv_split_shapes if hp.qkv_split_shapes is not None else getattr(p, "qkv_split_shapes", None)
    if split is None:
        raise ValueError("split_qkv=True needs qkv_split_shapes (group option or the param's attribute)")
    rows_total = p.shape[0] if n_rows is None else n_rows
    return [(f"_{name}", rows) for name, rows in zip(_QKV_NAMES, qkv_row_index(rows_total, split, p.device))]


def _block(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t.index_select(0, rows)


def init_state(p: torch.Tensor, state: dict, hp: ManifoldHyperParams,
               full_shape: tuple[int, int] | None = None) -> None:
    """Momentum, logging scalars and (fast mode) zero warm-start corrections (= a cold start), sized for
    the full matrix (``full_shape`` when ``p`` is a tensor-parallel shard: checkpoints hold full duals)."""
    state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
    # logging figures stay on the param's device: written each step without a host sync, read when logged
    state["dual_violation"] = torch.zeros((), dtype=torch.float32, device=p.device)
    state["dual_iters"] = torch.zeros((), dtype=torch.float32, device=p.device)
    if hp.mode == "fast" and hp.manifold != "none":
        rows_total, cols = full_shape or tuple(p.shape)
        for suffix, rows in qkv_blocks(p, hp, rows_total):
            m = rows_total if rows is None else rows.numel()
            n = min(m, cols)
            state["dual" + suffix] = torch.zeros(n, n, dtype=torch.float32, device=p.device)


def project_param_(p: torch.Tensor, hp: ManifoldHyperParams) -> None:
    """Put ``p`` on its manifold in place (each block separately when QKV is split)."""
    if hp.manifold == "none":
        return
    fn = polar_express(hp.msign_steps, hp.msign_dtype)
    for _, rows in qkv_blocks(p, hp):
        R = init_on_manifold(_block(p.data, rows).float(), hp.manifold, fn,
                             **_geometry_kw(hp)).to(p.dtype)
        p.data.copy_(R) if rows is None else p.data.index_copy_(0, rows, R)


def _geometry_kw(hp: ManifoldHyperParams) -> dict:
    if hp.manifold == "dgram":
        return {"column_preserving": hp.column_preserving}
    if hp.manifold == "sphere":
        return {"radius": hp.radius}
    return {}


def momentum_(grad: torch.Tensor, state: dict, hp: ManifoldHyperParams) -> torch.Tensor:
    """Sum-form momentum of [MM-code]: ``buf ← μ buf + g``; returns ``g + μ buf`` (Nesterov) or ``buf``."""
    return momenta_([grad], [state], hp)[0]


def momenta_(grads: list[torch.Tensor], states: list[dict], hp: ManifoldHyperParams) -> list[torch.Tensor]:
    """``momentum_`` of many matrices in a few ``torch._foreach_*`` dispatches (the same arithmetic)."""
    gs = [g.to(torch.float32) for g in grads]
    bufs = [st["momentum_buffer"] for st in states]
    torch._foreach_mul_(bufs, hp.momentum)
    torch._foreach_add_(bufs, gs)
    if not hp.nesterov:
        return [b.clone() for b in bufs]
    us = torch._foreach_mul(bufs, hp.momentum)
    torch._foreach_add_(us, gs)  # μ·buf + g, the same rounding as g + μ·buf
    return us


# ----------------------------------------------------------------------------------------------------
# The per-matrix step and the batched solve


@dataclass
class _Job:
    """One constrained matrix (a param, or one Q/K/V block of it) awaiting its solve."""

    W_full: torch.Tensor
    state: dict
    key: str
    rows: torch.Tensor | None
    W: torch.Tensor
    U: torch.Tensor


def _jobs(W_full: torch.Tensor, U: torch.Tensor, state: dict, hp: ManifoldHyperParams) -> list[_Job]:
    return [_Job(W_full, state, "dual" + suffix, rows, _block(W_full, rows).float(), _block(U, rows))
            for suffix, rows in qkv_blocks(W_full, hp)]


def _write(job: _Job, new_W: torch.Tensor, violation: torch.Tensor, iters: torch.Tensor) -> None:
    """Write one solved block; the logging figures are the max over a param's blocks, kept as tensors."""
    new_W = new_W.to(job.W_full.dtype)
    if job.rows is None:
        job.W_full.copy_(new_W)
    else:
        job.W_full.index_copy_(0, job.rows, new_W)
    for key, value in (("dual_violation", violation), ("dual_iters", iters)):
        torch.maximum(job.state[key], value.to(torch.float32), out=job.state[key])


def retraction_for(hp: ManifoldHyperParams, device: torch.device) -> str:
    """The DGram retraction of fast mode: ``auto`` is the GEMM-only one off CPU and the exact one on CPU
    (where eigh is cheap and the records of CPU runs stay those of the exact retraction)."""
    if hp.retraction != "auto":
        return hp.retraction
    return "exact" if device.type == "cpu" else "ns"


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t.index_select(1, rows)


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def solve_stacked(W: torch.Tensor, U: torch.Tensor, duals: dict, hp: ManifoldHyperParams,
                  blocks: list | None = None) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    """Fast-mode solve of a stack ``[B, m, n]`` of same-shape FULL matrices, no per-matrix work.

    ``duals``: the warm-start corrections ``{key: [B, n, n]}`` (a key missing or of another shape: cold
    start); ``blocks``: ``qkv_blocks`` of the matrices (default: whole). Same-shape Q/K/V blocks are solved
    in one batch. Returns the new weights ``[B, m, n]``, the new corrections ``{key: [B, n, n]}`` (fp32)
    and, per matrix, the RMS violation and dual iterations (fp32 ``[B]``, max over its blocks)."""
    blocks = blocks or [("", None)]
    B = W.shape[0]
    by_rows: dict[int, list] = {}
    for suffix, rows in blocks:
        by_rows.setdefault(W.shape[1] if rows is None else rows.numel(), []).append((suffix, rows))
    new_W = None if blocks[0][1] is None else torch.empty_like(W)
    new_duals, violation, iters = {}, None, None
    retraction = retraction_for(hp, W.device)
    for group in by_rows.values():
        Wb, Ub = _cat([_rows(W, r) for _, r in group]), _cat([_rows(U, r) for _, r in group])
        n = min(Wb.shape[-2:])
        ds = [duals.get("dual" + suffix) for suffix, _ in group]
        dual = _cat(ds) if all(d is not None and tuple(d.shape[1:]) == (n, n) for d in ds) else None
        out, corr, info = manifold_muon_fast(Wb, Ub, hp.manifold, hp.lr, dual, hp.fast_dual_steps,
                                             hp.fast_dual_lr, hp.tol, msign_steps=hp.fast_msign_steps,
                                             msign_dtype=hp.msign_dtype, retraction=retraction,
                                             **_geometry_kw(hp))
        v, it = info["rms_violation"].to(torch.float32), info["iters"].to(torch.float32)
        for i, (suffix, rows) in enumerate(group):
            part = slice(i * B, (i + 1) * B)
            if rows is None:
                new_W = out
            else:
                new_W.index_copy_(1, rows, out[part])
            new_duals["dual" + suffix] = corr[part].to(torch.float32)
            violation = v[part] if violation is None else torch.maximum(violation, v[part])
            iters = it[part] if iters is None else torch.maximum(iters, it[part])
    return new_W, new_duals, violation, iters


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if dst:
        torch._foreach_copy_(dst, src)


def write_stacked(Ws: list[torch.Tensor], states: list[dict], new_W: torch.Tensor, new_duals: dict,
                  violation: torch.Tensor, iters: torch.Tensor) -> None:
    """``solve_stacked``'s outputs into the matrices and their states, a few dispatches for the stack."""
    _copy_all(Ws, list(new_W.unbind(0)))
    for key, value in new_duals.items():
        values = list(value.unbind(0))
        olds = [st.get(key) for st in states]
        if all(o is not None and o.shape == value.shape[1:] and o.dtype == value.dtype for o in olds):
            _copy_all(olds, values)
        else:  # no correction yet (or one of another shape): a copy of its own, not a view of the stack
            for st, v in zip(states, values):
                st[key] = v.clone()
    _copy_all([st["dual_violation"] for st in states], list(violation.unbind(0)))
    _copy_all([st["dual_iters"] for st in states], list(iters.unbind(0)))


def run_jobs(jobs: list[_Job], hp: ManifoldHyperParams) -> None:
    """Solve and write back, faithful mode: one reference solve per matrix (block)."""
    for job in jobs:  # per-step logging restarts (max over the param's blocks)
        job.state["dual_violation"].zero_()
        job.state["dual_iters"].zero_()
    for job in jobs:
        new_W, _, info = manifold_muon(job.W, job.U, hp.manifold, hp.lr, hp.dual_steps, hp.dual_lr, hp.tol,
                                       msign_steps=hp.msign_steps, msign_dtype=hp.msign_dtype,
                                       return_info=True, **_geometry_kw(hp))
        _write(job, new_W, info["rms_violation"], info["iters"])


def solve_fast_(Ws: list[torch.Tensor], Us: list[torch.Tensor], states: list[dict], hp: ManifoldHyperParams,
                block_source: list[torch.Tensor] | None = None) -> None:
    """Fast mode on FULL matrices in place: one ``solve_stacked`` per shape (``block_source``: the tensors
    whose ``qkv_split_shapes`` attribute gives the Q/K/V blocks, default ``Ws``)."""
    by_shape: dict[tuple, list[int]] = {}
    for i, W in enumerate(Ws):
        by_shape.setdefault((tuple(W.shape), W.device), []).append(i)
    for idx in by_shape.values():
        src = (block_source or Ws)[idx[0]]
        W = torch.stack([Ws[i].float() for i in idx])
        U = torch.stack([Us[i] for i in idx])
        duals = {}
        for key in dual_keys(hp):
            ds = [states[i].get(key) for i in idx]
            if all(d is not None for d in ds) and len({tuple(d.shape) for d in ds}) == 1:
                duals[key] = torch.stack(ds)
        out = solve_stacked(W, U, duals, hp, qkv_blocks(src, hp) if hp.split_qkv else None)
        write_stacked([Ws[i] for i in idx], [states[i] for i in idx], *out)


def dual_keys(hp: ManifoldHyperParams) -> list[str]:
    """State keys of the warm-start corrections (fast mode of a constrained manifold), in a fixed order."""
    if hp.mode != "fast" or hp.manifold == "none":
        return []
    return ["dual" + suffix for suffix in (("_q", "_k", "_v") if hp.split_qkv else ("",))]


@torch.no_grad()
def solve_full_(Ws: list[torch.Tensor], Us: list[torch.Tensor], states: list[dict], hp: ManifoldHyperParams) -> None:
    """The step after momentum on FULL matrices, in place: ``W`` moves, ``states`` get the new duals and the
    logging scalars. ``manifold="none"``: plain Muon ``W(1 - lr·wd) - lr·msign(U)`` per block; else one solve
    (fast mode: stacked by shape). Whoever holds the whole matrix calls this (an engine's owner, or a single
    process)."""
    if hp.manifold == "none":
        fn = polar_express(hp.msign_steps, hp.msign_dtype)
        for W, U in zip(Ws, Us):
            if hp.weight_decay:
                W.mul_(1.0 - hp.lr * hp.weight_decay)
            for _, rows in qkv_blocks(W, hp):
                upd = (-hp.lr * fn(_block(U, rows))).to(W.dtype)
                W.add_(upd) if rows is None else W.index_add_(0, rows, upd)
        return
    if hp.mode == "fast":
        return solve_fast_(Ws, Us, states, hp)
    run_jobs([job for W, U, st in zip(Ws, Us, states) for job in _jobs(W, U, st, hp)], hp)


def msigns_per_step(hp: ManifoldHyperParams) -> tuple[int, int]:
    """(msign calls per matrix per step, NS steps of each): the dual iterations plus a Stiefel retraction."""
    if hp.manifold == "none":
        return 1, hp.msign_steps
    if hp.mode == "fast":
        return hp.fast_dual_steps + (hp.manifold == "stiefel"), hp.fast_msign_steps
    return hp.dual_steps + (hp.manifold == "stiefel"), hp.msign_steps


@torch.no_grad()
def manifold_step_(W_full: torch.Tensor, grad_full: torch.Tensor, state: dict, hp: ManifoldHyperParams) -> None:
    """One ManifoldMuon step on a full (gathered) matrix in place; ``state`` from ``init_state``."""
    solve_full_([W_full], [momentum_(grad_full, state, hp)], [state], hp)


# ----------------------------------------------------------------------------------------------------


class ManifoldMuon(torch.optim.Optimizer):
    """Module-wise Manifold Muon over 2-D matrices; param groups choose ``manifold`` and ``mode``.

    ``manifold`` ∈ {"stiefel", "dgram", "oblique", "sphere", "none"}; parameters are projected onto their
    manifold at construction (wide ones by transposition). 1-D parameters are refused (use AdamW).

    ``mode`` defaults to ``faithful`` here and to ``fast`` on the command line (``--manifold-mode``), on purpose:
    this class is what the paper's algorithm is checked against (the dual ascent run to ``tol`` each step, as the
    authors' code), while a training run wants the fast solve that continues the dual across steps (one msign
    per step; docs/optimizers.md §2).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        manifold: str = "stiefel",
        mode: str = "faithful",
        weight_decay: float = 0.0,
        dual_steps: int = 20,
        dual_lr: float = 0.1,
        tol: float = 1e-6,
        *,
        msign_steps: int = 10,
        fast_dual_steps: int = 1,
        fast_dual_lr: float = 0.02,
        fast_msign_steps: int = 8,
        msign_dtype: Any = torch.float32,
        column_preserving: bool = False,
        radius: float | None = None,
        retraction: str = "auto",
        split_qkv: bool = False,
        qkv_split_shapes: tuple[int, int, int] | None = None,
        project: bool = True,
    ):
        self._project = project
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, manifold=manifold, mode=mode,
            weight_decay=weight_decay, dual_steps=dual_steps, dual_lr=dual_lr, tol=tol,
            msign_steps=msign_steps, fast_dual_steps=fast_dual_steps, fast_dual_lr=fast_dual_lr,
            fast_msign_steps=fast_msign_steps, msign_dtype=msign_dtype,
            column_preserving=column_preserving, radius=radius, retraction=retraction, split_qkv=split_qkv,
            qkv_split_shapes=qkv_split_shapes,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        params = matrix_params(param_group, "ManifoldMuon")
        super().add_param_group({**param_group, "params": params})
        group = self.param_groups[-1]
        hp = ManifoldHyperParams.from_group(group)
        hp.validate()
        with torch.no_grad():
            for p in group["params"]:
                qkv_blocks(p, hp)  # fail early on split_qkv without split shapes
                if self._project:
                    project_param_(p, hp)
                if not self.state[p]:
                    init_state(p, self.state[p], hp)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hp = ManifoldHyperParams.from_group(group)
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:  # e.g. after loading weights without optimizer state
                    init_state(p, self.state[p], hp)
            states = [self.state[p] for p in params]
            if hp.mode == "fast" and hp.manifold != "none":
                # every same-shape matrix of the group in one stacked solve
                solve_fast_([p.data for p in params], momenta_([p.grad for p in params], states, hp), states, hp,
                            block_source=params)
            else:
                for p, state in zip(params, states):
                    manifold_step_(p.data, p.grad, state, hp)
        return loss

    def constraint_report(self) -> dict[int, dict[str, float]]:
        """Last step's dual-solve figures per param index (order of ``param_groups``)."""
        out, i = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p, {})
                out[i] = {"manifold": group["manifold"], "rms_violation": float(st.get("dual_violation", 0.0)),
                          "dual_iters": float(st.get("dual_iters", 0.0)), "wide": is_wide(p)}
                i += 1
        return out
