#!/usr/bin/env bash
# GPU benchmark on one device: dense-181m (vocab 131072) at sequence 4096 in bf16 with adam, muon,
# muon_md and manifold_muon (tokens/s, MFU, optimizer-step time and share, peak memory), a large bf16
# GEMM, a save/resume check, a small MoE, each optimizer under --attention-backend local and sdpa with a
# profile of its optimizer step, the DGram retraction micro-benchmark and moe-6.7b whole on one device.
# Writes ${OUT:-runs/gpu_bench}/gpu_bench.json (and gpu_bench.log); sections are in benchmarks/gpu_bench.py.
# In two calls that each fit one 600-s command on a lent GPU: PART=1 (the headline: GEMM, adam and muon_md
# under both backends, 300 s of sections, about 6 minutes with the wheels) then PART=2 (the rest, 480 s),
# which merges part 1's JSON when it is in $OUT.
#
#   PART=1 bash tools/gpu_bench.sh             # uses ./.venv if present, else python3
#   PART=2 bash tools/gpu_bench.sh             # adds its sections to $OUT/gpu_bench.json
#   DRY_RUN=1 PART=1 bash tools/gpu_bench.sh   # the sections and their commands; no GPU, runs nothing
#   STEPS=20 BUDGET_S=300 bash tools/gpu_bench.sh --sections gemm,train   # extra args go to gpu_bench.py
#
# Offline machines: put wheels for megatron-core, emerging-optimizers (and optionally
# transformer-engine) in ./.whl; they are installed to /tmp/site first. The TE layer spec is used
# when transformer_engine imports, the local spec otherwise (as tools/gpu_smoke.sh).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUTDIR=${OUT:-runs/gpu_bench}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-5}
PART=${PART:-all}
case "$PART" in
    1) BUDGET_S=${BUDGET_S:-300} ;;  # all sections of the part; the wheels and checks come on top (~30 s)
    2) BUDGET_S=${BUDGET_S:-480} ;;
    all) BUDGET_S=${BUDGET_S:-780} ;;
    *) echo "[gpu_bench] error: PART must be 1, 2 or all (got '$PART')" >&2; exit 2 ;;
esac
MERGE_ARGS=()
if [[ "$PART" == 2 && -f "$OUTDIR/gpu_bench.json" ]]; then
    MERGE_ARGS=(--merge "$OUTDIR/gpu_bench.json")  # part 1's sections stay in the JSON
fi
PY=${PY:-}
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [[ -n "${DRY_RUN:-}" ]]; then
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    exec "$PY" benchmarks/gpu_bench.py --dry-run --part "$PART" --budget-s "$BUDGET_S" --steps "$STEPS" \
        --warmup "$WARMUP" "$@"
fi
if compgen -G ".whl/*.whl" > /dev/null; then
    echo "[gpu_bench] installing carried wheels from .whl/"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
$PY - <<'PY' || exit 1
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("[gpu_bench] error: no CUDA device visible; this benchmark needs a GPU")
print(f"[gpu_bench] torch {torch.__version__}, {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
try:
    import transformer_engine.pytorch  # noqa: F401
    print("[gpu_bench] transformer_engine imports: TE layer spec")
except Exception as e:
    print(f"[gpu_bench] transformer_engine unavailable ({type(e).__name__}): local layer spec")
import megatron.core, emerging_optimizers  # noqa: E401,F401  (fail here, not in every section)
PY
mkdir -p "$OUTDIR"
# The driver keeps to BUDGET_S itself and writes its JSON after every section; this outer limit only
# catches a hang (SIGTERM: it writes what it has; SIGKILL 15 s later).
timeout -k 15 $((${BUDGET_S%.*} + 45)) env PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu_bench.py \
    --out "$OUTDIR/gpu_bench.json" --log "$OUTDIR/gpu_bench.log" \
    --steps "$STEPS" --warmup "$WARMUP" --budget-s "$BUDGET_S" --part "$PART" "${MERGE_ARGS[@]}" "$@"
rc=$?
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "[gpu_bench] stopped by the outer time limit; $OUTDIR/gpu_bench.json holds the sections finished before"
fi
exit $rc
