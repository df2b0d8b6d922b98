#!/usr/bin/env bash
# Rerun this record into runs/records/2026-12-01-md-ablations/variants/<variant> (OUT=... to change).
# Resumable. About 8 core-minutes per variant on CPU (width 64).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-01-md-ablations}
export OMP_NUM_THREADS=1
variant() {
  local name=$1; shift
  .venv/bin/megatron-md lr-sweep --config examples/lr_transfer/dense_cpu.yaml --corpus runs/records_data \
    --out "$OUT/variants/$name" --widths 64 --optimizers muon_md --k-range muon_md=11:13 --seeds 1,2 \
    --log-interval 5 --extend-edges 2 --no-plot "$@"
}
# rowcol (the defaults) is the LR-transfer record's muon_md at width 64: its reproduce.sh runs those cells, and
#   python tools/keep_record.py runs/records/2026-12-01-lr-transfer <dest>/variants/rowcol --only 'muon_md-w64-*'
# keeps them here.
variant none -- --md-gains none          # Muon on the sphere, no gains
variant row -- --md-gains row
variant col -- --md-gains col
variant direct -- --md-gain-param direct
variant warmup-10pct --warmups 10%
.venv/bin/python tools/plot_records.py "$OUT"
