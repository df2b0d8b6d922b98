#!/usr/bin/env bash
# GPU smoke test: tiny-dense and tiny-moe for a few steps with NCCL and bf16 on one node.
#
#   bash tools/gpu_smoke.sh            # uses ./.venv if present, else python3
#   NPROC=2 STEPS=30 bash tools/gpu_smoke.sh
#
# Offline machines: put wheels for megatron-core, emerging-optimizers (and optionally
# transformer-engine) in ./.whl; they are installed to /tmp/site first. The TE layer spec is
# used when transformer_engine imports, the local spec otherwise. Prints tokens/s per model.
# A check of an install (minutes). The few-second check the SLURM scripts run on every node before a job
# (GPUs visible, one all-reduce across all ranks) is slurm/smoke.py.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
STEPS=${STEPS:-20}
NPROC=${NPROC:-1}
OUTDIR=${OUTDIR:-runs/gpu_smoke}
PY=${PY:-}
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if compgen -G ".whl/*.whl" > /dev/null; then
    echo "[gpu_smoke] installing carried wheels from .whl/"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
$PY - <<'PY' || exit 1
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
print(f"[gpu_smoke] torch {torch.__version__}, {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
try:
    import transformer_engine.pytorch  # noqa: F401
    print("[gpu_smoke] transformer_engine imports: TE layer spec")
except Exception as e:
    print(f"[gpu_smoke] transformer_engine unavailable ({type(e).__name__}): local layer spec")
PY
status=0
mkdir -p "$OUTDIR"
for model in tiny-dense tiny-moe; do
    run="$OUTDIR/$model-$(date +%s)"
    extra=()
    if [[ $model == tiny-moe && $NPROC -ge 2 ]]; then extra=(--expert-model-parallel-size 2); fi
    echo "[gpu_smoke] $model: $STEPS steps, bf16, nccl, $NPROC process(es)"
    $PY -m megatron_md.cli train --model "$model" --mock-data --device cuda --bf16 \
        --nproc-per-node "$NPROC" --train-iters "$STEPS" --micro-batch-size 8 --seq-length 256 \
        --log-interval 5 --run-dir "$run" --wandb-mode disabled "${extra[@]}" || { status=1; continue; }
    $PY - "$run" "$model" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"lm_loss"' in l]
last = recs[-1]
tps = sorted(r["tokens_per_s"] for r in recs[1:] or recs)[len(recs[1:] or recs) // 2]
print(f"[gpu_smoke] {sys.argv[2]}: median tokens/s {tps:.0f}, final lm loss {last['lm_loss']:.4f}, "
      f"iter {last['iter_time_ms']:.1f} ms")
PY
done
exit $status
