#!/usr/bin/env bash
# Rerun this record into runs/records/2026-12-01-manifold-geometry/<set>/<preset> (OUT=... to change).
# Resumable. About 1.5 core-hours on CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-01-manifold-geometry}
export OMP_NUM_THREADS=1
run() {  # set lr seeds steps log-interval diagnostics-interval presets...
  local set=$1 lr=$2 seeds=$3 steps=$4 log=$5 diag=$6; shift 6
  for p in "$@"; do
    .venv/bin/megatron-md lr-sweep --config "examples/manifold_paper/tiny-gpt2_${p}_cpu.yaml" \
      --corpus runs/records_data --out "$OUT/$set/$p" --widths 64 --optimizers manifold_muon --lrs "$lr" \
      --seeds "$seeds" --steps "$steps" --warmups 2% --log-interval "$log" --no-plot -- \
      --diagnostics-interval "$diag" --eval-iters 32
  done
}
ALL=(unconstrained all-stiefel all-dgram hetero hetero-inv hetero-md)
run lr0.02 0.02 1,2,3 1000 10 50 "${ALL[@]}"
run lr0.1 0.1 1,2,3 1000 10 50 "${ALL[@]}"
run long-lr0.1 0.1 1 5000 25 100 all-dgram hetero-inv hetero
.venv/bin/python tools/plot_records.py "$OUT"
