#!/usr/bin/env bash
# Install verl-hpc into ./.venv (created if missing).
#
#   bash tools/install.sh          # the package
#   bash tools/install.sh test     # the package + test tools (pytest, hypothesis, ruff)
#
# Why torch first: on a machine without a GPU, a bare `pip install torch` pulls a
# multi-GB CUDA build. We install the pinned CPU build explicitly (set TORCH_INDEX_URL,
# e.g. https://download.pytorch.org/whl/cpu, where your pip does not already resolve
# torch==$TORCH_VERSION to the CPU wheel), then the package, whose torch range it satisfies.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VERL_HPC_VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${1:-}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[install] GPU found: installing torch==$TORCH_VERSION (CUDA build)"
    "${PIP[@]}" install -q "torch==$TORCH_VERSION"
  else
    echo "[install] no GPU: installing torch==$TORCH_VERSION (CPU build)"
    "${PIP[@]}" install -q "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  fi
fi
spec="."
[ -n "$EXTRAS" ] && spec=".[$EXTRAS]"
echo "[install] installing verl-hpc ($spec)"
"${PIP[@]}" install -q -e "$spec"
echo "[install] done: $("$VENV/bin/verl-hpc" --version) in $VENV"
