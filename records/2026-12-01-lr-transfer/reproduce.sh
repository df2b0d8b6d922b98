#!/usr/bin/env bash
# Rerun this record into runs/records/2026-12-01-lr-transfer (OUT=... to change; records/ is never written).
# Resumable: rerun to continue. About 10.7 core-hours on CPU (640 core-minutes measured, 492 of them at width
# 512; mostly two processes sharing 2 cores, some cells three); the width groups run two at a time.
# Each curve starts as three grid points around the optimum a probe found and --extend-edges walks it
# outwards until its optimum is strictly inside (or runs out of steps).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-01-lr-transfer}
export OMP_NUM_THREADS=1
sweep() {
  .venv/bin/megatron-md lr-sweep --config examples/lr_transfer/dense_cpu.yaml --corpus runs/records_data \
    --out "$OUT" --log-interval 5 --no-plot "$@"
}
# MuonMD's other LRs, fixed at every width: 10x the paper's 1e-3 / 3e-3, which are tuned for 50k steps at 181M
# and leave MuonMD ~0.7 nats behind after 300 steps here (the md-ablations record's paper-lrs variant).
MDLR=(--lr 0.01 --embedding-lr 0.03)
# megatron's Muon in fp32 Newton-Schulz (bf16 there is ~100x slower on CPU; the same as the CPU default now)
NS32=(--muon-fp32-matmul-prec highest)
{
  sweep --widths 64,128 --seeds 1,2 --optimizers muon_md --k-range muon_md=10:12 --extend-edges 3 -- "${MDLR[@]}"
  sweep --widths 64,128 --seeds 1,2 --optimizers adamw --k-range adamw=8:10 --extend-edges 3
  sweep --widths 64,128 --seeds 1,2 --optimizers muon --k-range muon=8:10 --extend-edges 3 -- "${NS32[@]}"
} &
# width 256: seeds 1 and 2 (a cell takes 3-6 minutes on one core)
sweep --widths 256 --seeds 1,2 --optimizers muon_md --k-range muon_md=10:12 --extend-edges 2 -- "${MDLR[@]}"
sweep --widths 256 --seeds 1,2 --optimizers adamw --k-range adamw=7:9 --extend-edges 2
sweep --widths 256 --seeds 1,2 --optimizers muon --k-range muon=8:10 --extend-edges 2 -- "${NS32[@]}"
wait
# width 512 (a cell takes 7-23 minutes on one core): seed 1 walks the ladder from a probe's optimum; seed 2
# runs the three LRs around seed 1's optimum, and walks on by itself if its own optimum is on an edge
{
  sweep --widths 512 --seeds 1 --optimizers muon_md --k-range muon_md=10:12 --extend-edges 2 -- "${MDLR[@]}"
  sweep --widths 512 --seeds 2 --optimizers muon_md --k-range muon_md=10:12 --extend-edges 2 -- "${MDLR[@]}"
  sweep --widths 512 --seeds 2 --optimizers adamw --k-range adamw=5:7 --extend-edges 3
} &
sweep --widths 512 --seeds 1 --optimizers adamw --k-range adamw=7:9 --extend-edges 2
# seed 2 walked AdamW down to k=2; seed 1 follows, so both seeds cover k=2..7
sweep --widths 512 --seeds 1 --optimizers adamw --k-range adamw=2:4
sweep --widths 512 --seeds 1 --optimizers muon --k-range muon=7:9 --extend-edges 5 -- "${NS32[@]}"
sweep --widths 512 --seeds 2 --optimizers muon --k-range muon=2:4 --extend-edges 2 -- "${NS32[@]}"
wait
.venv/bin/python tools/plot_lr_transfer.py "$OUT/results.csv"
