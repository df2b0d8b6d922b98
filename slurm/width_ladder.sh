#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# The MD paper's width ladder as one GPU LR sweep: the examples/md_paper recipes dense-181m, dense-307m,
# dense-457m, dense-827m and dense-1.29b (each at its own width, with its own init), LRS matrix LRs each
# around the recipes' own --matrix-lr (1.13e-2, ladder point k=7), SEEDS seeds; one array task per cell, on
# GPUS_PER_CELL GPUs of one node (slurm/lr_sweep.sbatch). Writes the grid with `megatron-md lr-sweep
# --slurm-grid`, then submits the array job.
#   bash slurm/width_ladder.sh --dry-run -- --data-path /data/fineweb_text_document --tokenizer-model /data/tok.model
#   STEPS=5000 SEEDS=1,2 bash slurm/width_ladder.sh -- --data-path ... --tokenizer-model ...
# --dry-run writes the grid and prints the sbatch command and every cell's command; it submits nothing.
# Arguments after -- go to every cell's `megatron-md train` (no spaces inside a value). Settings and defaults:
# docs/sweeps.md.
set -euo pipefail

here=${BASH_SOURCE[0]%/*}
[[ $here != "${BASH_SOURCE[0]}" ]] || here=.
MD_ROOT=$(cd "$here/.." && pwd)
MD_PROG=width_ladder.sh
# shellcheck source=common.sh
source "$MD_ROOT/slurm/common.sh"

usage() {
    cat <<EOF
usage: [VAR=value ...] bash slurm/width_ladder.sh [--dry-run] [-- TRAIN FLAGS...]
Variables (default): CONFIGS (the five md_paper dense recipes), OPTIMIZER (muon_md), LRS (5), K_CENTER (the
recipes' own LR), K_RANGE, K_STEP (1), SEEDS (1), STEPS (the recipes' train_iters), GPUS_PER_CELL (8),
CPUS_PER_CELL (8 per GPU), MAX_PARALLEL (all), GRID (runs/grids/width_ladder.tsv), OUT (runs/sweeps/<grid
name>-<array job id>), JOB_NAME (width-ladder), SBATCH_ARGS, PYTHON. Details: docs/sweeps.md.
EOF
}

DRY=${DRY_RUN:-0}
TRAIN_ARGS=()
while (($#)); do
    case $1 in
        --dry-run) DRY=1 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; TRAIN_ARGS+=("$@"); break ;;
        *) md_die "unknown argument '$1' (train flags go after --)" ;;
    esac
    shift
done

DEFAULT_CONFIGS=()
for size in 181m 307m 457m 827m 1.29b; do
    DEFAULT_CONFIGS+=("$MD_ROOT/examples/md_paper/dense-${size}_muon_md.yaml")
done
CONFIGS=${CONFIGS:-$(IFS=,; printf '%s' "${DEFAULT_CONFIGS[*]}")}
OPTIMIZER=${OPTIMIZER:-muon_md}
LRS=${LRS:-5}
SEEDS=${SEEDS:-1}
GPUS_PER_CELL=${GPUS_PER_CELL:-8}
[[ $GPUS_PER_CELL =~ ^[1-9][0-9]*$ ]] || md_die "GPUS_PER_CELL=$GPUS_PER_CELL: expected a positive integer"
CPUS_PER_CELL=${CPUS_PER_CELL:-$((8 * GPUS_PER_CELL))}
GRID=${GRID:-runs/grids/width_ladder.tsv}
JOB_NAME=${JOB_NAME:-width-ladder}
PYTHON=$(md_python)
md_check_python "$PYTHON"

# The grid's lr-sweep flags; the same flags with --collect OUT gather the results afterwards.
SWEEP=(--config "$CONFIGS" --optimizers "$OPTIMIZER" --lrs "$LRS" --seeds "$SEEDS")
if [[ -n ${K_CENTER:-} ]]; then
    SWEEP+=(--k-center "$OPTIMIZER=$K_CENTER")
fi
if [[ -n ${K_RANGE:-} ]]; then
    SWEEP+=(--k-range "$OPTIMIZER=$K_RANGE")
fi
if [[ -n ${K_STEP:-} ]]; then
    SWEEP+=(--k-step "$K_STEP")
fi
if [[ -n ${STEPS:-} ]]; then
    SWEEP+=(--steps "$STEPS")
fi
"$PYTHON" -m megatron_md.cli lr-sweep "${SWEEP[@]}" --gpus-per-cell "$GPUS_PER_CELL" --slurm-grid "$GRID" \
    -- "${TRAIN_ARGS[@]}" >/dev/null || md_die "megatron-md lr-sweep could not write the grid (its message is above)"
RANGE=$(bash "$MD_ROOT/slurm/lr_sweep.sbatch" --array-range "$GRID")
CELLS=$((${RANGE#0-} + 1))
ARRAY=$RANGE
if [[ -n ${MAX_PARALLEL:-} ]]; then
    ARRAY+="%$MAX_PARALLEL"
fi
SB_EXTRA=()
md_split_words SB_EXTRA "${SBATCH_ARGS:-}"
SBATCH=(sbatch --parsable --job-name="$JOB_NAME" --array="$ARRAY" --gpus-per-node="$GPUS_PER_CELL"
    --cpus-per-task="$CPUS_PER_CELL" "${SB_EXTRA[@]}" "$MD_ROOT/slurm/lr_sweep.sbatch")
ENV=(GRID="$GRID" GPUS_PER_CELL="$GPUS_PER_CELL")
if [[ -n ${OUT:-} ]]; then
    ENV+=(OUT="$OUT")
fi
collect_line() {
    md_quote "$PYTHON" -m megatron_md.cli lr-sweep "${SWEEP[@]}" --collect "$1" --out "${1%/}-results" -- "${TRAIN_ARGS[@]}"
}
STEM=${GRID##*/}
STEM=${STEM%.*}

md_info "wrote $GRID: $CELLS cells ($OPTIMIZER, $GPUS_PER_CELL GPU(s) each)"
if md_is_true "$DRY"; then
    md_quote "${ENV[@]}" "${SBATCH[@]}"
    # each cell's command, as array task N runs it (JOBID: the array job id sbatch will give)
    env "${ENV[@]}" OUT="${OUT:-runs/sweeps/$STEM-JOBID}" DRY_RUN=1 bash "$MD_ROOT/slurm/lr_sweep.sbatch"
    md_info "then collect with: $(collect_line "${OUT:-runs/sweeps/$STEM-JOBID}")"
    exit 0
fi

command -v sbatch >/dev/null 2>&1 || md_die "sbatch not found on PATH (run this on a login node, or use --dry-run)"
mkdir -p logs # SLURM does not create the --output directory
JOB=$(env "${ENV[@]}" "${SBATCH[@]}")
JOB=${JOB%%;*}
md_info "submitted array job $JOB ($CELLS cells); logs/$JOB_NAME-${JOB}_<task>.out"
md_info "collect (any time; unfinished cells are counted and left out): $(collect_line "${OUT:-runs/sweeps/$(md_safe_name "$STEM-$JOB")}")"
