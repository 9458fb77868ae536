#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU (the CPU suite cannot reach these paths):
# tests/gpu (CUDA actor/engines/DCP checkpoint, an NCCL world, CUDA->CPU weight sync), and
# the data-plane benchmarks (rollout transport, weight sync and its fan-out) on the GPU node's
# own cores: a real node has many, CI's VM has two, and the transport's small-batch cost is
# thread and process hand-offs that two vCPUs serialise.
# Needs torch with CUDA plus this package's dependencies; where pip cannot reach an index,
# put wheels in .whl/ and they are installed to /tmp/site.
#   bash tools/gpu_check.sh [OUT_DIR]
#   GPU_CHECK_PARTS="dataplane" bash tools/gpu_check.sh OUT_DIR   # a subset (default: both)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/verl_hpc_gpu_check}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HOME=${VERL_HPC_GPU_HOME:-/tmp/verl_hpc_gpu_home}
nvidia-smi -L
python3 -c "import torch, transformers, pyarrow; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'pyarrow', pyarrow.__version__, 'cuda', torch.cuda.is_available())"
parts=" ${GPU_CHECK_PARTS:-tests dataplane} "
status=0
if [[ $parts == *" tests "* ]]; then
  timeout "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu \
    --junitxml="$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log" || status=1
fi
if [[ $parts == *" dataplane "* ]]; then
  for name in transport weight_sync; do
    timeout "${DATAPLANE_BENCH_TIMEOUT:-120}" python3 -m bench "$name" --out "$out" 2>&1 | tee -a "$out/dataplane.log" \
      || status=1
  done
fi
exit $status
