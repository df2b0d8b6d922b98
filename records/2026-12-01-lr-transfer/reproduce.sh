#!/usr/bin/env bash
# Rerun this record into runs/records/2026-12-01-lr-transfer (OUT=... to change; records/ is never written).
# Resumable: rerun to continue. About 4 core-hours on CPU; the two width groups ran in parallel, one core each.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-01-lr-transfer}
export OMP_NUM_THREADS=1
sweep() {
  .venv/bin/megatron-md lr-sweep --config examples/lr_transfer/dense_cpu.yaml --corpus runs/records_data \
    --out "$OUT" --optimizers adamw,muon,muon_md --lrs 5 --k-range adamw=3:9 --seeds 1,2 --log-interval 5 \
    --no-plot "$@"
}
sweep --widths 64,128 &
sweep --widths 256
wait
# width 512: one seed, the LRs around the optimum of 64-256 (see README.md)
sweep --widths 512 --optimizers adamw,muon_md --k-range adamw=3:7 --k-range muon_md=11:13 --seeds 1
.venv/bin/python tools/plot_lr_transfer.py "$OUT/results.csv"
