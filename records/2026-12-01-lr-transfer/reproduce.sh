#!/usr/bin/env bash
# Rerun this record into runs/records/2026-12-01-lr-transfer (OUT=... to change; records/ is never written).
# Resumable: rerun to continue. About 2.5 core-hours on CPU; the two width groups ran in parallel, one core each.
# Each curve starts as three grid points around the optimum a probe found and --extend-edges walks it
# outwards until its optimum is strictly inside.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-01-lr-transfer}
export OMP_NUM_THREADS=1
sweep() {
  .venv/bin/megatron-md lr-sweep --config examples/lr_transfer/dense_cpu.yaml --corpus runs/records_data \
    --out "$OUT" --optimizers adamw,muon,muon_md --log-interval 5 --no-plot "$@"
}
sweep --widths 64,128 --seeds 1,2 --k-range adamw=8:10 --k-range muon=8:10 --k-range muon_md=11:13 --extend-edges 3 &
# width 256: one seed (a cell takes 3-6 minutes on one core)
sweep --widths 256 --seeds 1 --k-range adamw=7:9 --k-range muon=8:10 --k-range muon_md=11:13 --extend-edges 2
wait
.venv/bin/python tools/plot_lr_transfer.py "$OUT/results.csv"
