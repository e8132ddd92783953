#!/usr/bin/env bash
# Fresh machine -> .venv with torch, the build tools and effmem built against
# that torch (editable). Safe to run again: it reuses .venv and rebuilds.
#
# transformers, accelerate and matplotlib are test dependencies: the tests build Hugging Face
# models from configs, with random weights (no downloads), train one with transformers'
# Trainer (which needs accelerate), and draw effmem plan's PNG chart. pytest-xdist runs the README's test command on two workers.
#
# Settings (environment): PYTHON (default python3), EFFMEM_TORCH (the torch
# requirement, default torch==2.14.1), CUDA_HOME (the CUDA toolkit's folder;
# found under /usr/local when unset), EFFMEM_CUDA (AUTO|ON|OFF) and
# EFFMEM_CUDA_ARCHITECTURES (e.g. "90"), passed on to CMake.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet "${EFFMEM_TORCH:-torch==2.14.1}" numpy \
  pytest pytest-timeout pytest-xdist pytest-benchmark hypothesis transformers accelerate matplotlib \
  "scikit-build-core>=0.10" "cmake>=3.25" ninja

# CUDA_HOME must name the toolkit's own folder: an nvcc on PATH may be a
# wrapper script from which CMake cannot find the CUDA runtime.
if [ -z "${CUDA_HOME:-}" ]; then
  for dir in /usr/local/cuda /usr/local/cuda-*; do
    if [ -x "$dir/bin/nvcc" ]; then
      export CUDA_HOME="$dir"
      break
    fi
  done
fi
python -m pip install --quiet --no-build-isolation --no-deps -e .
python -c "import effmem; print('effmem built for torch', effmem.build_info.TORCH_VERSION, '| CUDA compiled:', effmem.build_info.CUDA_COMPILED, effmem.build_info.CUDA_ARCHITECTURES)"
