#!/usr/bin/env bash
# On a GPU machine (no network): build in place, run the whole test suite
# (CUDA tests included), run the GPU benchmarks and the demo, and write JSON
# results to $OUT (default bench/results/) with device, torch version and git
# commit.
#
#   bash bench/gpu_check.sh [PART ...]     PART: build tests bench offload capacity demo
#
# No PART runs them all in that order. The device tool allows 10 minutes per
# command, which all of them together may exceed: then run
# `build tests bench` in one call and `build offload capacity demo` in the
# next (build is quick once built).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(build tests bench offload capacity demo)

for part in "${parts[@]}"; do
  echo "== $part ($(date -u +%H:%M:%S))"
  case "$part" in
    build)
      "$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
      "$PY" -m effmem.cli info | tee "$OUT/info.txt" ;;
    tests)
      "$PY" -m pytest -q tests -rs --junitxml="$OUT/tests.xml" 2>&1 | tail -30 | tee "$OUT/tests.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bench)
      "$PY" bench/bench_adam.py --device cuda --json "$OUT/gpu_adam.json" || status=1
      "$PY" bench/bench_compress.py --device cuda --bits 8 --gpt --json "$OUT/gpu_compress.json" || status=1
      "$PY" bench/bench_compress.py --device cuda --bits 4 --json "$OUT/gpu_compress_4bit.json" || status=1 ;;
    offload)
      # Step time at 1.3B against FusedAdam, engine vs link bandwidth, GPU bytes/param.
      "$PY" bench/bench_offload.py --device cuda --json "$OUT/gpu_offload.json" || status=1 ;;
    capacity)
      # The largest Llama-shaped model each optimizer trains (each try in its own process).
      "$PY" bench/bench_offload.py --device cuda --size 125m --steps 2 --warmup 1 --capacity \
        --json "$OUT/gpu_offload_capacity.json" || status=1 ;;
    demo)
      "$PY" -m effmem.cli demo --json "$OUT/gpu_demo.json" || status=1 ;;
    *)
      echo "unknown part: $part (expected build tests bench offload capacity demo)"; exit 2 ;;
  esac
done
exit $status
