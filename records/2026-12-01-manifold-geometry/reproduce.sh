#!/usr/bin/env bash
# Rerun this record into runs/records/2026-12-01-manifold-geometry/lr<LR>/<preset> (OUT=... to change).
# Resumable. About 65 core-minutes on CPU (measured, two processes sharing 2 cores: 35 for LR 0.1, 30 for
# LR 0.3). Seeds are added one at a time across all presets, so a run cut short still compares every preset.
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
.venv/bin/python tools/plot_records.py "$OUT"
