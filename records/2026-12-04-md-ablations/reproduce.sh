#!/usr/bin/env bash
# MuonMD ablations in the second CPU regime (records/2026-12-03-regime-probe): width 64, seeds 1-3, one LR sweep
# per variant (matrix LR, factor 2 apart, walked outwards until the optimum is inside).
# Rerun into runs/records/2026-12-04-md-ablations/variants/<variant> (OUT=... to change; records/ is never written).
# Resumable; two cells at a time (--jobs 2). About 10 core-minutes per variant (9 cells of ~65 s on one core of
# two busy ones).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-04-md-ablations}
export OMP_NUM_THREADS=1
variant() {
  local name=$1; shift
  .venv/bin/megatron-md lr-sweep --config examples/lr_transfer/dense_cpu_sp512.yaml --corpus runs/records_data_sp512 \
    --corpus-vocab 512 --out "$OUT/variants/$name" --widths 64 --seeds 1,2,3 --log-interval 10 --no-plot \
    --k-step 2 --extend-edges 3 --jobs 2 "$@"
}
MD=(--optimizers muon_md --k-range muon_md=11:15)
MDLR=(--lr 3e-3 --embedding-lr 3e-3)  # MuonMD's fixed non-matrix LRs in this regime (the probe's)
# rowcol (the defaults: row and column gains, softplus, no warmup, no weight decay) is the probe's muon_md at
# width 64 (the same cells); keep them with
#   python tools/keep_record.py runs/records/2026-12-03-regime-probe <dest>/variants/rowcol --only 'muon_md-w64-*'
variant none "${MD[@]}" -- "${MDLR[@]}" --md-gains none   # Muon on the sphere, no gains
variant flat "${MD[@]}" -- "${MDLR[@]}" --md-gains flat   # one learnable scalar per matrix
variant row "${MD[@]}" -- "${MDLR[@]}" --md-gains row
variant col "${MD[@]}" -- "${MDLR[@]}" --md-gains col
variant direct "${MD[@]}" -- "${MDLR[@]}" --md-gain-param direct
variant offset "${MD[@]}" -- "${MDLR[@]}" --md-gain-param offset
variant warmup-10pct "${MD[@]}" --warmups 10% -- "${MDLR[@]}"
variant wd-0.1 "${MD[@]}" --weight-decays 0.1 -- "${MDLR[@]}"
variant lion --optimizers lion_md --k-range lion_md=11:15 -- "${MDLR[@]}"   # the Lion base update
# --hs-u (normalise the base update onto the sphere) is an Adam-base option: Muon's update already has the
# sphere's norm (up to Newton-Schulz's inexactness). With it Adam's relative step is the LR itself, so its
# ladder sits where MuonMD's does; without it Adam's step is ~sqrt(width) x larger, and its ladder lower.
variant adam --optimizers adam_md --k-range adam_md=5:9 -- "${MDLR[@]}"
variant adam-hs-u --optimizers adam_md --k-range adam_md=11:15 -- "${MDLR[@]}" --md-normalize-update
.venv/bin/python tools/plot_records.py "$OUT"
