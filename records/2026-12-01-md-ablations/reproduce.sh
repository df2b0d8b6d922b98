#!/usr/bin/env bash
# Rerun this record into runs/records/2026-12-01-md-ablations/variants/<variant> (OUT=... to change).
# Resumable. About 45 core-minutes per variant on CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-01-md-ablations}
export OMP_NUM_THREADS=1
variant() {
  local name=$1; shift
  .venv/bin/megatron-md lr-sweep --config examples/lr_transfer/dense_cpu.yaml --corpus runs/records_data \
    --out "$OUT/variants/$name" --widths 128 --optimizers muon_md --lrs 5 --seeds 1,2 --log-interval 5 --no-plot "$@"
}
variant rowcol          # the defaults (the same cells as the LR-transfer record's muon_md at width 128)
variant row -- --md-gains row
variant col -- --md-gains col
variant none -- --md-gains none          # Muon on the sphere, no gains
variant direct -- --md-gain-param direct
variant warmup-10pct --warmups 10%
.venv/bin/python tools/plot_records.py "$OUT"
