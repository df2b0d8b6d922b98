#!/usr/bin/env bash
# Rerun this record into runs/records/2026-12-01-manifold-geometry/lr<LR>/<preset> (OUT=... to change).
# Resumable. About 135 core-minutes on CPU (measured, two processes sharing 2 cores: 35 for LR 0.1, 30 for
# LR 0.3, 70 for the two 15k-step runs of lr0.1-15k). Seeds are added one at a time across all presets, so a run cut short still compares every preset.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-01-manifold-geometry}
export OMP_NUM_THREADS=1
for lr in 0.1 0.3; do
  for seeds in 1 1,2 1,2,3; do
    for p in hetero all-dgram all-stiefel unconstrained hetero-inv hetero-md; do
      .venv/bin/megatron-md lr-sweep --config "examples/manifold_paper/tiny-gpt2_${p}_cpu.yaml" \
        --corpus runs/records_data --out "$OUT/lr$lr/$p" --widths 64 --optimizers manifold_muon --lrs "$lr" \
        --seeds "$seeds" --steps 1000 --warmups 2% --log-interval 10 --no-plot -- \
        --diagnostics-interval 50 --eval-iters 32
    done
  done
done
# lr0.1-15k: one long run each (seed 1) of a DGram-attention and a Stiefel-attention preset, as long as the
# paper's run was when its DGram attention diverged (~15k steps)
for p in all-dgram hetero; do
  .venv/bin/megatron-md lr-sweep --config "examples/manifold_paper/tiny-gpt2_${p}_cpu.yaml" \
    --corpus runs/records_data --out "$OUT/lr0.1-15k/$p" --widths 64 --optimizers manifold_muon --lrs 0.1 \
    --seeds 1 --steps 15000 --warmups 2% --log-interval 50 --no-plot -- --diagnostics-interval 250 --eval-iters 32 &
done
wait
.venv/bin/python tools/plot_records.py "$OUT"
