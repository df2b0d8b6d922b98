"""The DGram retraction of fast Manifold Muon: exact (fp64 eigh of the Gram) against GEMM-only (ns), one run.

Times ``DGram.retract_gram`` with ``retraction="exact"`` and ``"ns"`` (``manifolds.retract_gram_ns``, in
fp32) on a stack of DGram points after a small step, at dense-181m's MLP shapes (12 layers of fc1 2048x512;
fc2 512x2048 is the same problem transposed), and prints each median, the ratio and the accuracy of ns
(distance to exact relative to ‖R‖_F, off-Gram ‖Off(RᵀR)‖_F / tr(RᵀR)). The entry point for other scripts
(e.g. a GPU run) is ``dgram_retraction_bench``; it returns the figures as a dict.

    python benchmarks/dgram_retraction.py                      # CPU, [12, 2048, 512]
    python benchmarks/dgram_retraction.py --batch 2 --repeats 1 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _point_after_step(batch: int, m: int, n: int, lr: float, device: torch.device, seed: int) -> torch.Tensor:
    """A stack of tall DGram points (column norms of an N(0, 1/n) init) moved by a spectral step lr·‖W‖_op."""
    from megatron_md.optim import manifolds as M

    g = torch.Generator().manual_seed(seed)
    W = torch.randn(batch, m, n, generator=g) / n**0.5
    W = M.DGram().retract(W)
    A = M.polar_express(8)(M.DGram().tangent(W, torch.randn(batch, m, n, generator=g)))
    return (W - lr * W.norm(dim=-2).amax(dim=-1)[:, None, None] * A).to(device)


def _time(fn, X, repeats: int, device: torch.device) -> tuple[float, torch.Tensor]:
    out = fn(X)  # warm-up (kernels, workspaces)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn(X)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def dgram_retraction_bench(batch: int = 12, m: int = 2048, n: int = 512, repeats: int = 3, lr: float = 0.02,
                           device: str = "cpu", seed: int = 0) -> dict:
    """Median seconds of the exact and the ns DGram retraction on ``[batch, m, n]`` fp32 (m >= n) and the
    accuracy of ns against exact. Returns {"exact_s", "ns_s", "exact/ns", "dist", "off_gram_ns",
    "off_gram_exact", "shape", "device"}."""
    from megatron_md.optim import manifolds as M

    dev = torch.device(device)
    X = _point_after_step(batch, m, n, lr, dev, seed)
    exact_s, exact = _time(M.DGram(retraction="exact").retract_gram, X, repeats, dev)
    ns_s, ns = _time(M.DGram(retraction="ns").retract_gram, X, repeats, dev)

    def off(R):
        G = R.double().mT @ R.double()
        diag = torch.diagonal(G, dim1=-2, dim2=-1)
        return float(((G - torch.diag_embed(diag)).norm(dim=(-2, -1)) / diag.sum(-1)).max())

    dist = float(((ns.double() - exact.double()).norm(dim=(-2, -1)) / exact.double().norm(dim=(-2, -1))).max())
    return {"shape": [batch, m, n], "device": str(dev), "exact_s": exact_s, "ns_s": ns_s,
            "exact/ns": exact_s / ns_s, "dist": dist, "off_gram_ns": off(ns), "off_gram_exact": off(exact)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = dgram_retraction_bench(args.batch, args.m, args.n, args.repeats, args.lr, args.device)
    print(f"DGram retraction {r['shape']} fp32 on {r['device']}: exact (fp64 eigh) {r['exact_s'] * 1e3:.1f} ms, "
          f"ns (GEMMs) {r['ns_s'] * 1e3:.1f} ms, exact/ns {r['exact/ns']:.2f}; ns: distance to exact "
          f"{r['dist']:.1e}, off-Gram {r['off_gram_ns']:.1e} (exact in fp32: {r['off_gram_exact']:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
