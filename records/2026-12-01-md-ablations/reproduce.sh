#!/usr/bin/env bash
# Rerun this record into runs/records/2026-12-01-md-ablations/variants/<variant> (OUT=... to change).
# Resumable. About 6-10 core-minutes per variant on CPU (width 64; measured, two processes sharing 2 cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-01-md-ablations}
export OMP_NUM_THREADS=1
variant() {
  local name=$1; shift
  .venv/bin/megatron-md lr-sweep --config examples/lr_transfer/dense_cpu.yaml --corpus runs/records_data \
    --out "$OUT/variants/$name" --widths 64 --optimizers muon_md --seeds 1,2 --log-interval 5 --extend-edges 2 \
    --no-plot "$@"
}
MDLR=(--lr 0.01 --embedding-lr 0.03)  # MuonMD's fixed non-matrix LRs in the LR-transfer record
# rowcol (the defaults) is the LR-transfer record's muon_md at width 64: its reproduce.sh runs those cells, and
#   python tools/keep_record.py runs/records/2026-12-01-lr-transfer <dest>/variants/rowcol --only 'muon_md-w64-*'
# keeps them here.
variant none --k-range muon_md=10:12 -- "${MDLR[@]}" --md-gains none   # Muon on the sphere, no gains
variant row --k-range muon_md=10:12 -- "${MDLR[@]}" --md-gains row
variant col --k-range muon_md=10:12 -- "${MDLR[@]}" --md-gains col
variant direct --k-range muon_md=10:12 -- "${MDLR[@]}" --md-gain-param direct
variant warmup-10pct --k-range muon_md=10:12 --warmups 10% -- "${MDLR[@]}"
variant paper-lrs --k-range muon_md=11:13   # the paper's --lr 1e-3 --embedding-lr 3e-3
.venv/bin/python tools/plot_records.py "$OUT"
