#!/usr/bin/env bash
# The probe of the second CPU regime (README.md here): does each optimizer's final loss rise one grid step
# (a factor 2 in LR) either side of its optimum, by more than the seed noise, at widths 64 and 256?
# Rerun this record into runs/records/2026-12-03-regime-probe (OUT=... to change; records/ is never written).
# Resumable: rerun to continue (finished cells are kept); two cells at a time (--jobs 2). Each curve starts as
# three LRs a factor 2 apart and --extend-edges walks it outwards (same spacing) until its optimum is inside.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-03-regime-probe}
export OMP_NUM_THREADS=1
sweep() {
  .venv/bin/megatron-md lr-sweep --config examples/lr_transfer/dense_cpu_sp512.yaml --corpus runs/records_data_sp512 \
    --corpus-vocab 512 --out "$OUT" --log-interval 10 --no-plot --k-step 2 --extend-edges 3 --jobs 2 "$@"
}
# MuonMD's other LRs: --lr 3e-3 --embedding-lr 3e-3 at every width (a first one-seed probe without the paper's
# architecture options: 3e-3/3e-3 beat the paper's 1e-3/3e-3 there). Muon: fp32 Newton-Schulz (the CPU default).
# Width 64: each curve starts as three LRs around a guess; width 256 starts from what width 64 showed (the
# optimum one grid step lower for AdamW and Muon; MuonMD's k=11 and k=13 had run under a 11:15 start).
sweep --widths 64 --seeds 1,2,3 --optimizers muon_md --k-range muon_md=11:15 -- --lr 3e-3 --embedding-lr 3e-3
sweep --widths 64 --seeds 1,2,3 --optimizers adamw --k-range adamw=2:6
sweep --widths 64 --seeds 1,2,3 --optimizers muon --k-range muon=4:8 -- --muon-fp32-matmul-prec highest
sweep --widths 256 --seeds 1,2,3 --optimizers adamw --k-range adamw=4:8
sweep --widths 256 --seeds 1,2,3 --optimizers muon --k-range muon=2:6 -- --muon-fp32-matmul-prec highest
sweep --widths 256 --seeds 1,2,3 --optimizers muon_md --k-range muon_md=9:13 -- --lr 3e-3 --embedding-lr 3e-3
# Width 64 with 3 seeds left AdamW's upper side (0.8 SE) and Muon's lower side (0.1 SE) short of 2 SE: two more
# seeds at their optimum and neighbours, and Muon one more LR below.
sweep --widths 64 --seeds 1,2,3,4,5 --optimizers adamw --k-range adamw=6:10
sweep --widths 64 --seeds 1,2,3,4,5 --optimizers muon --k-range muon=2:8 -- --muon-fp32-matmul-prec highest
# With 5 seeds AdamW's width-64 curve still rose by only 1.5 and 1.3 unpaired SE (seed std ~0.04): seeds 6-10.
sweep --widths 64 --seeds 1,2,3,4,5,6,7,8,9,10 --optimizers adamw --k-range adamw=6:10
# Muon's width-64 optimum sat between k=4 and k=6 (equal within 0.3 SE): the points halfway (k=3, 5, 7).
sweep --widths 64 --seeds 1,2,3,4,5 --optimizers muon --k-range muon=3:7 -- --muon-fp32-matmul-prec highest
# Muon's width-256 curve is flat from k=2 to k=4 (0.007 apart) and steep above: the points halfway (k=1, 3, 5).
sweep --widths 256 --seeds 1,2,3 --optimizers muon --k-range muon=1:5 -- --muon-fp32-matmul-prec highest
# MuonMD's width-256 upper side rose 1.9 SE with 3 seeds: seeds 4 and 5 at its optimum and both neighbours.
sweep --widths 256 --seeds 1,2,3,4,5 --optimizers muon_md --k-range muon_md=9:13 -- --lr 3e-3 --embedding-lr 3e-3
# AdamW's width-64 upper side still rose only 1.7 SE with 10 seeds: the halfway points (k=7, 9), then a last
# stage of seeds 11-15 at its optimum and neighbours (declared the last before it ran; the result is kept as is).
sweep --widths 64 --seeds 1,2,3,4,5,6,7,8,9,10 --optimizers adamw --k-range adamw=7:9 --extend-edges 0
sweep --widths 64 --seeds 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 --optimizers adamw --k-range adamw=6:10 --extend-edges 0
# AdamW's width-256 upper side rose 1.0 SE: the halfway points (k=5, 7), which moved the optimum to k=7, then its
# upper neighbour k=9 and seeds 4 and 5 at k=5, 7, 9 (the last stage).
sweep --widths 256 --seeds 1,2,3 --optimizers adamw --k-range adamw=5:7 --extend-edges 0
sweep --widths 256 --seeds 1,2,3,4,5 --optimizers adamw --k-range adamw=5:9 --extend-edges 0
.venv/bin/python tools/probe_curvature.py "$OUT/results.csv"
