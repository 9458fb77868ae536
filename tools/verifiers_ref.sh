#!/usr/bin/env bash
# verifiers 0.4.0 (prime-rl's environments) in a venv of its own, for tests/e2e/test_verifiers_env.py.
#
#   bash tools/verifiers_ref.sh        # idempotent: prints the venv's directory, installs only when missing
#
# Why a venv of its own: verifiers pins openai>=2.54 and mcp==2.0.0 and brings ~580 MB (anthropic, prime-*,
# renderers, transformers without torch) that the project never imports: its harness runs in its own
# processes and reaches the model over HTTP (`verl-hpc serve`). uv comes with it: verifiers' null harness
# and tool servers are uv scripts and packages (their few dependencies are fetched from PyPI once, then
# cached). ~45 s from a warm pip cache, 1-5 min from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${VERIFIERS_REF_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/verl-hpc/verifiers-0.4.0}
PY=${VERL_HPC_PYTHON:-.venv/bin/python}  # its base interpreter makes the new venv
PINS=(verifiers==0.4.0 renderers==0.1.12 uv==0.13.10)
want="${PINS[*]}"
source tools/ref_lock.sh
take_ref_lock "$DIR" "$want"  # returns here only to install
rm -rf "$DIR"
trap 'rm -rf "$DIR"' EXIT  # a half-built venv is never taken for an installed one
start=$(date +%s)
# a venv's scripts name its own path: it is built where it stays
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip --disable-pip-version-check install -q "${PINS[@]}" >&2
"$DIR/bin/python" -c "import verifiers.v1, renderers" >&2
echo "$want" >"$DIR/.installed"
trap - EXIT
echo "verifiers_ref.sh: verifiers 0.4.0 installed in $(( $(date +%s) - start )) s" >&2
echo "$DIR"
