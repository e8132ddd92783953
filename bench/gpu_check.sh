#!/usr/bin/env bash
# One call on a GPU machine (no network): build in place, run the whole test
# suite (CUDA tests included), run the GPU benchmarks and the demo, and write
# JSON results to $OUT (default bench/results/) with device, torch version and
# git commit. Usage: bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0

echo "== build"
"$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
"$PY" -m effmem.cli info | tee "$OUT/info.txt"

echo "== tests"
"$PY" -m pytest -q tests -rs --junitxml="$OUT/tests.xml" 2>&1 | tail -30 | tee "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== benchmarks"
"$PY" bench/bench_adam.py --device cuda --json "$OUT/gpu_adam.json" || status=1
"$PY" bench/bench_compress.py --device cuda --bits 8 --gpt --json "$OUT/gpu_compress.json" || status=1
"$PY" bench/bench_compress.py --device cuda --bits 4 --json "$OUT/gpu_compress_4bit.json" || status=1
# Step time at 1.3B against FusedAdam, transfer bandwidth, GPU bytes/param; then
# the largest model each optimizer trains (EFFMEM_CAPACITY=0 skips that part).
cap=""; [ "${EFFMEM_CAPACITY:-1}" = "1" ] && cap="--capacity"
"$PY" bench/bench_offload.py --device cuda $cap --json "$OUT/gpu_offload.json" || status=1

echo "== demo"
"$PY" -m effmem.cli demo --json "$OUT/gpu_demo.json" || status=1
exit $status
