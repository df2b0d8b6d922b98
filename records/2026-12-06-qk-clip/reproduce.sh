#!/usr/bin/env bash
# QK-clip against the two papers' open questions, at CPU scale.
# A. The manifold paper's profile (records/2026-12-03-manifold-geometry: tiny-gpt2, no QK-norm, Manifold Muon fast
#    mode, matrix LR 0.1, 15k steps into a 50k-step cosine, seeds 1-2) for all-dgram with --qk-clip at Megatron-LM's
#    and Kimi K2's default threshold 100; all-dgram and hetero without it are that record's cells (same flags).
#    About 12 minutes per cell on one core of two.
# B. MuonMD at the second CPU regime's width 256 and its optimal matrix LR (records/2026-12-04-lr-transfer: k=11,
#    QK-norm on, 300 steps, seeds 1-3), with --qk-clip at τ 100 (never reached: the run is the unclipped run, and
#    logs its logits), at τ 4 (below the logits MuonMD reaches, so it clips from early on) and "off" (neither the
#    clip nor the probe: τ 100's control on this code). About 7 minutes a cell, two side by side.
# Rerun into runs/records/2026-12-06-qk-clip (OUT=... to change; records/ is never written). Resumable.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-06-qk-clip}
export OMP_NUM_THREADS=1
part=${1:-all}
if [[ $part == all || $part == A ]]; then
  .venv/bin/megatron-md lr-sweep --config examples/manifold_paper/tiny-gpt2_all-dgram_cpu.yaml \
    --corpus runs/records_data --out "$OUT/lr0.1-15k-of-50k/all-dgram-qk-clip" --widths 64 --optimizers manifold_muon \
    --lrs 0.1 --seeds 1,2 --steps 15000 --warmups 1000 --log-interval 50 --no-plot --jobs 2 \
    --resume-cells --cell-save-interval 1000 -- \
    --lr-decay-iters 50000 --min-lr 3e-4 --diagnostics-interval 250 --eval-iters 32 --qk-clip --qk-clip-threshold 100
fi
if [[ $part == all || $part == B ]]; then
  # "off": the same cells with neither the clip nor the max-logit probe, on this code (the control for τ 100)
  for arm in tau100 tau4 off; do
    case $arm in
      off) extra=(--no-log-max-logit) ;;
      *) extra=(--qk-clip --qk-clip-threshold "${arm#tau}") ;;
    esac
    .venv/bin/megatron-md lr-sweep --config examples/lr_transfer/dense_cpu_sp512.yaml --corpus runs/records_data_sp512 \
      --corpus-vocab 512 --out "$OUT/muon_md-w256/$arm" --log-interval 10 --no-plot --k-step 2 --extend-edges 0 \
      --jobs 2 --resume-cells --cell-save-interval 25 --widths 256 --seeds 1,2,3 --optimizers muon_md \
      --k-range muon_md=11:11 -- --lr 3e-3 --embedding-lr 3e-3 "${extra[@]}"
  done
fi
