#!/usr/bin/env bash
# Build bench/.venv-trl: TRL's GRPOTrainer for bench/step.py, kept OUT of the project's venv
# (TRL is a peer we measure against, not a dependency). Same torch (2.13.0 CPU) and
# transformers major as the project so that both sides run the same kernels.
# Usage: bash bench/trl_env.sh   (idempotent; ~1-2 min with the CPU torch wheel on disk)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-trl"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/pip" install -q --upgrade pip
# torch first: 2.13.0+cpu sorts above PyPI's 2.13.0, so a CPU wheel on the find-links path wins
"$venv/bin/pip" install -q "torch==2.13.0"
"$venv/bin/pip" install -q "trl==1.16.0" "transformers<5.20" datasets
"$venv/bin/python" -c "import trl, torch, transformers; print('trl', trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
