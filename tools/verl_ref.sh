#!/usr/bin/env bash
# verl 0.9.1 from PyPI as a reference implementation for tests/algo/test_verl_parity.py.
#
#   bash tools/verl_ref.sh        # idempotent: prints the directory, installs only when missing
#
# Why a --target directory beside the project's venv rather than a venv of its own: the
# parity tests need only `verl.trainer.ppo.core_algos` and `verl.utils.reward_score`, and
# the project's venv already holds torch, numpy, transformers, packaging and pyarrow. So
# verl is installed with --no-deps, plus exactly what its import reaches that the venv
# lacks (ray: core_algos -> verl.workers.config -> verl.single_controller imports it;
# tensordict, omegaconf, codetiming, orjson, msgpack, pyvers), pinned, into one folder
# the tests put first on PYTHONPATH of a subprocess. Nothing of it enters the project's
# venv, and no second torch is downloaded. ~30-40 s from PyPI, ~265 MB (ray is 250 of it).
# verl pins transformers<5.11; the venv's newer one is never called by these functions.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${VERL_REF_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/verl-hpc/verl-0.9.1}
PY=${VERL_HPC_PYTHON:-.venv/bin/python}
PINS=(verl==0.9.1 ray==2.60.0 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.3.0
      antlr4-python3-runtime==4.9.3 codetiming==1.4.0 msgpack==1.2.4 orjson==3.13.0)
want="${PINS[*]} (without verl's tests/)"
source tools/ref_lock.sh
take_ref_lock "$DIR" "$want"  # returns here only to install
tmp="$DIR.partial.$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
"$PY" -m pip --disable-pip-version-check install -q --no-deps --target "$tmp" "${PINS[@]}" >&2
# verl's wheel ships its own test suite as a top-level `tests` package, which would shadow ours
rm -rf "$tmp/tests"
PYTHONPATH="$tmp" "$PY" -c "import verl.trainer.ppo.core_algos, verl.utils.reward_score" >&2
echo "$want" >"$tmp/.installed"
rm -rf "$DIR"
mv "$tmp" "$DIR"
trap - EXIT
echo "verl_ref.sh: verl 0.9.1 reference installed in $(( $(date +%s) - start )) s" >&2
echo "$DIR"
