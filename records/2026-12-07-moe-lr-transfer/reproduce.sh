#!/usr/bin/env bash
# LR transfer across width on an MoE model: the dense record's second CPU regime (records/2026-12-04-lr-transfer)
# with an MoE layer in every layer (examples/lr_transfer/moe_cpu_sp512.yaml: 8 experts, top-2, experts 2x the
# width, aux loss 1e-2). Widths 64, 128, 256; AdamW and Muon (10% warmup, weight decay 0.1) against MuonMD
# (neither), seeds 1-3; then the probe's extra seeds, the expert-count axis and the diagnostics reruns.
# Rerun into runs/records/2026-12-07-moe-lr-transfer (OUT=... to change; records/ is never written). Resumable, a
# stopped cell too (--resume-cells: it checkpoints on SIGTERM and every 25 steps); two cells at a time (--jobs 2).
# Each curve starts as three LRs a factor 2 apart around where width 64 (or the dense record at that width) put its
# optimum, and --extend-edges walks it outwards until the optimum is strictly inside.
# Cost per cell on one core of two busy ones: 85-120 s at width 64, 2.5-4.5 min at 128, 6-15 min at 256 (AdamW the
# cheapest, Muon about 11.5 min, MuonMD up to 15).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-07-moe-lr-transfer}
export OMP_NUM_THREADS=1
CONFIG=examples/lr_transfer/moe_cpu_sp512.yaml
sweep() {
  .venv/bin/megatron-md lr-sweep --config "$CONFIG" --corpus runs/records_data_sp512 \
    --corpus-vocab 512 --out "$OUT" --log-interval 10 --no-plot --k-step 2 --extend-edges 3 --jobs 2 \
    --resume-cells --cell-save-interval 25 "$@"
}
MDLR=(--lr 3e-3 --embedding-lr 3e-3)       # MuonMD's fixed non-matrix LRs at every width (the dense record's)
NS32=(--muon-fp32-matmul-prec highest)      # megatron's Muon with fp32 Newton-Schulz (the CPU default)
run_width() {  # width, seeds, then the start ranges of muon_md, adamw and muon
  sweep --widths "$1" --seeds "$2" --optimizers muon_md --k-range "muon_md=$3" -- "${MDLR[@]}"
  sweep --widths "$1" --seeds "$2" --optimizers adamw --k-range "adamw=$4"
  sweep --widths "$1" --seeds "$2" --optimizers muon --k-range "muon=$5" -- "${NS32[@]}"
}
run_width 64 1,2,3 11:15 2:6 4:8
# Halfway points (odd k) for AdamW and Muon, whose factor-2 curves were flat at width 64:
sweep --widths 64 --seeds 1,2,3 --optimizers adamw --k-range adamw=7:9 --extend-edges 0
sweep --widths 64 --seeds 1,2,3 --optimizers muon --k-range muon=5:7 --extend-edges 0 -- "${NS32[@]}"
run_width 256 1,2,3 9:13 5:9 2:6  # around the dense record's width-256 optima (k=11, 7, 3)
run_width 128 1,2,3 9:13 6:10 3:7  # between widths 64 and 256

# The probe (does each curve rise by 2 standard errors a factor 2 either side of its optimum?): seeds 1-5 at the
# optimum and its factor-2 neighbours, in checks/probe; seeds 1-3 are the record's own cells, copied.
reuse() {  # copy the record's seed 1-3 cells of optimizer $1 at width $2, k from $3 to $4 (every second), into $5
  local k d
  for ((k = $3; k <= $4; k += 2)); do
    for d in "$OUT/cells/$1-w$2-k$k-s"[123]-*; do
      [ -e "$d" ] || continue
      [ -e "$5/cells/${d##*/}" ] || cp -r "$d" "$5/cells/"
    done
  done
}
probe() {  # width, seeds, then per optimizer the LO:HI of its probe ("" leaves that optimizer out)
  local w=$1 s=$2 p=$OUT/checks/probe
  mkdir -p "$p/cells"
  local o=(--out "$p" --extend-edges 0 --widths "$w" --seeds "$s")
  if [ -n "$3" ]; then reuse muon_md "$w" "${3%:*}" "${3#*:}" "$p"; sweep "${o[@]}" --optimizers muon_md \
    --k-range "muon_md=$3" -- "${MDLR[@]}"; fi
  if [ -n "$4" ]; then reuse adamw "$w" "${4%:*}" "${4#*:}" "$p"; sweep "${o[@]}" --optimizers adamw \
    --k-range "adamw=$4"; fi
  if [ -n "$5" ]; then reuse muon "$w" "${5%:*}" "${5#*:}" "$p"; sweep "${o[@]}" --optimizers muon \
    --k-range "muon=$5" -- "${NS32[@]}"; fi
}
probe 64 1,2,3,4,5 11:15 6:10 3:7
probe 256 1,2,3 9:13 "" 2:6      # MuonMD and Muon bend with the record's own three seeds
probe 256 1,2,3,4,5 "" 5:9 ""    # AdamW does not: seeds 4-5 (not run for the kept record; its README says so)

# The expert-count axis at width 128 (top-2 of 4, 8 and 16 experts; MuonMD and AdamW), one --out per count: the
# 8-expert sweep is the record's own width-128 cells, copied.
experts() {  # number of experts, then the start ranges of muon_md and adamw
  local e=(--out "$OUT/experts/$1" --widths 128 --seeds "1,2,3") n=(--num-experts "$1") d
  mkdir -p "$OUT/experts/$1/cells"
  if [ "$1" = 8 ]; then  # the recipe's own count: no flag, the same cells
    n=()
    for d in "$OUT"/cells/{muon_md,adamw}-w128-*; do
      [ -e "$d" ] || continue
      [ -e "$OUT/experts/8/cells/${d##*/}" ] || cp -r "$d" "$OUT/experts/8/cells/"
    done
  fi
  sweep "${e[@]}" --optimizers muon_md --k-range "muon_md=$2" -- "${MDLR[@]}" "${n[@]}"
  sweep "${e[@]}" --optimizers adamw --k-range "adamw=$3" -- "${n[@]}"
}
experts 8 9:13 6:10
experts 4 9:13 6:10
experts 16 9:13 6:10

# The diagnostics reruns: each width's optimum, seed 1, with per-matrix relative updates and the expert load logged;
# the dense ones rerun the dense record's cells (same flags, so each must end on that cell's loss).
DIAG=(--diagnostics-interval 20 --log-update-norms)
diagnose() {  # family (moe or dense), width, then the best k of muon_md, adamw and muon there
  local cfg=$CONFIG d=(--out "$OUT/checks/diagnostics-$1" --extend-edges 0 --jobs 1 --seeds 1 --widths "$2")
  [ "$1" = dense ] && cfg=examples/lr_transfer/dense_cpu_sp512.yaml
  CONFIG=$cfg sweep "${d[@]}" --optimizers muon_md --k-range "muon_md=$3:$3" -- "${MDLR[@]}" "${DIAG[@]}"
  CONFIG=$cfg sweep "${d[@]}" --optimizers adamw --k-range "adamw=$4:$4" -- "${DIAG[@]}"
  CONFIG=$cfg sweep "${d[@]}" --optimizers muon --k-range "muon=$5:$5" -- "${NS32[@]}" "${DIAG[@]}"
}
diagnose moe 64 13 8 5
diagnose moe 128 11 6 3
diagnose moe 256 11 7 4  # Muon's (k=4) was not run for the kept record
diagnose dense 64 13 8 5  # the dense record's optima (records/2026-12-04-lr-transfer/optima.csv)
diagnose dense 128 11 8 4
diagnose dense 256 11 7 3
.venv/bin/python tools/plot_lr_transfer.py "$OUT/results.csv"
.venv/bin/python tools/plot_lr_transfer.py "$OUT"/experts/{4,8,16}/results.csv --labels "4 experts,8 experts,16 experts" \
  --out "$OUT/experts.png"
