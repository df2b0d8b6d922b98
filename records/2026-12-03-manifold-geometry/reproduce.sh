#!/usr/bin/env bash
# The manifold paper's LR profile at CPU scale: 15k steps *into* a 50k-step schedule (warmup 1000 = 2%, cosine to
# 10% of peak at step 50000), so at step 15k the LR is still ~80% of its peak, as in the paper's run whose DGram
# attention diverged near 15k steps. tiny-gpt2 (0.37M parameters) on the first regime's corpus, matrix LR 0.1
# (the 2026-12-01 record's LR), diagnostics (sigma_max, max logit) every 250 steps.
# Rerun into runs/records/2026-12-03-manifold-geometry/lr0.1-15k-of-50k/<preset> (OUT=... to change; records/ is
# never written). The layout is a manifold-geometry record's (<set>/<preset>/results.csv), which the claims read.
# Resumable: finished cells are kept; a stopped cell continues from its checkpoint (on SIGTERM, every 1000 steps). About 12 minutes per cell on one core when the
# other core runs a cell like it (42 when it ran width-512 LR-transfer cells); 3 presets x 2 seeds = 6 cells, the
# kept record's cost 1.7 core-hours. Seeds go one at a time across the presets.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/records/2026-12-03-manifold-geometry}
SET=lr0.1-15k-of-50k
export OMP_NUM_THREADS=1
for seeds in 1 1,2; do
  for p in all-dgram hetero unconstrained; do
    .venv/bin/megatron-md lr-sweep --config "examples/manifold_paper/tiny-gpt2_${p}_cpu.yaml" \
      --corpus runs/records_data --out "$OUT/$SET/$p" --widths 64 --optimizers manifold_muon --lrs 0.1 \
      --seeds "$seeds" --steps 15000 --warmups 1000 --log-interval 50 --no-plot \
      --resume-cells --cell-save-interval 1000 -- \
      --lr-decay-iters 50000 --min-lr 3e-4 --diagnostics-interval 250 --eval-iters 32
  done
done
