#!/usr/bin/env bash
# LR transfer across width in the second CPU regime (records/2026-12-03-regime-probe): widths 64-512, AdamW and
# Muon (10% warmup, weight decay 0.1) against MuonMD (neither), seeds 1-3 (width 512: 1-2).
# Rerun into runs/records/2026-12-04-lr-transfer (OUT=... to change; records/ is never written). Resumable, a
# stopped cell too (--resume-cells: it checkpoints on SIGTERM and every 25 steps); two cells at a time (--jobs 2). Each curve starts as three LRs a factor 2 apart around where the probe (or the next
# smaller width) put its optimum, and --extend-edges walks it outwards until the optimum is strictly inside.
# Cost per cell on one core of two busy ones: ~65 s at width 64, ~2.5 min at 128, 5.5 (AdamW) to 8 min at 256,
# ~20 (AdamW) to ~40 min (Muon, MuonMD: Newton-Schulz grows as width^3) at 512.
# The kept record ran Muon's width-512 cells on one H200 (the same flags plus --device cuda; see its README for the
# measured CPU/GPU difference, <= 0.0016); this script runs them on the CPU.
# The widths 64 and 256 cells are the probe's (same flags, same names): copy its cells/ into $OUT to reuse them.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-04-lr-transfer}
export OMP_NUM_THREADS=1
sweep() {
  .venv/bin/megatron-md lr-sweep --config examples/lr_transfer/dense_cpu_sp512.yaml --corpus runs/records_data_sp512 \
    --corpus-vocab 512 --out "$OUT" --log-interval 10 --no-plot --k-step 2 --extend-edges 3 --jobs 2 \
    --resume-cells --cell-save-interval 25 "$@"
}
MDLR=(--lr 3e-3 --embedding-lr 3e-3)       # MuonMD's fixed non-matrix LRs at every width (the probe's)
NS32=(--muon-fp32-matmul-prec highest)      # megatron's Muon with fp32 Newton-Schulz (the CPU default)
run_width() {  # width, seeds, then the start ranges of muon_md, adamw and muon
  sweep --widths "$1" --seeds "$2" --optimizers muon_md --k-range "muon_md=$3" -- "${MDLR[@]}"
  sweep --widths "$1" --seeds "$2" --optimizers adamw --k-range "adamw=$4"
  sweep --widths "$1" --seeds "$2" --optimizers muon --k-range "muon=$5" -- "${NS32[@]}"
}
run_width 64 1,2,3 11:15 2:6 4:8
run_width 256 1,2,3 9:13 4:8 2:6
# The probe's halfway points (k odd for AdamW and Muon), where its curves were flat at the factor-2 grid:
sweep --widths 64 --seeds 1,2,3 --optimizers adamw --k-range adamw=7:9 --extend-edges 0
sweep --widths 64 --seeds 1,2,3 --optimizers muon --k-range muon=3:7 --extend-edges 0 -- "${NS32[@]}"
sweep --widths 256 --seeds 1,2,3 --optimizers adamw --k-range adamw=5:9 --extend-edges 0
sweep --widths 256 --seeds 1,2,3 --optimizers muon --k-range muon=1:5 --extend-edges 0 -- "${NS32[@]}"
run_width 128 1,2,3 11:15 4:8 2:6
run_width 512 1,2 9:13 5:9 1:5  # around width 256's optima (k=11, 7, 3)
.venv/bin/python tools/plot_lr_transfer.py "$OUT/results.csv"
