#!/usr/bin/env bash
# Build .venv with Python 3.12 (megatron-core >= 0.17 and emerging-optimizers need it).
# On our machines 3.12 comes from pyenv and is not the default interpreter, so look for it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

is312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; }

find_python312() {
    if [[ -n "${PYTHON312:-}" ]] && is312 "$PYTHON312"; then echo "$PYTHON312"; return; fi
    for c in python3.12 python3 python; do
        p=$(command -v "$c" 2>/dev/null) || continue
        if is312 "$p"; then echo "$p"; return; fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        root=$(pyenv root)
        for d in $(ls -d "$root"/versions/3.12* 2>/dev/null | sort -V -r); do
            if is312 "$d/bin/python3.12"; then echo "$d/bin/python3.12"; return; fi
        done
    fi
    for d in /usr/local/bin /usr/bin "$HOME/.pyenv/versions"/3.12*/bin; do
        if [[ -x "$d/python3.12" ]] && is312 "$d/python3.12"; then echo "$d/python3.12"; return; fi
    done
    return 1
}

if [[ -x "$VENV/bin/python" ]] && is312 "$VENV/bin/python"; then
    PY="$VENV/bin/python"
else
    BASE=$(find_python312) || {
        echo "error: Python 3.12 not found (megatron-core 0.19 needs it). Install it (e.g. 'pyenv install 3.12')" \
             "or point PYTHON312=/path/to/python3.12 at it, then rerun 'make'." >&2
        exit 1
    }
    echo "[setup] creating $VENV with $BASE"
    rm -rf "$VENV"
    "$BASE" -m venv "$VENV"
    PY="$VENV/bin/python"
fi

PIP="$PY -m pip --disable-pip-version-check -q"
# torch first and pinned: otherwise the resolver may pull a newer multi-GB CUDA build.
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    echo "[setup] installing torch==$TORCH_VERSION (large download on a fresh machine)"
    $PIP install "torch==$TORCH_VERSION"
fi
echo "[setup] installing megatron_md and its dependencies"
# eval: lm-eval for `megatron-md eval` and its test (about 600 MB: pyarrow, scipy, pandas, scikit-learn)
$PIP install -e ".[dev,eval]" "torch==$TORCH_VERSION"
echo "[setup] done: $($PY -c 'import sys, torch, megatron.core as m; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {m.__version__}")')"
