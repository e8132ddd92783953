#!/usr/bin/env bash
# On a GPU machine (no network): build in place, run the whole test suite
# (CUDA tests included), run the GPU benchmarks and the demo, and write JSON
# results to $OUT (default bench/results/gpu-<date>/) with device, torch version and git
# commit.
#
#   EFFMEM_GIT_COMMIT=<sha> bash bench/gpu_check.sh [PART ...]
#   PART: build tests bench demo offload capacity capacity_small linear_ce plan activations
#
# No PART runs them all in that order. The device tool allows 10 minutes per
# command, which all of them together exceed; calls that fit (the build is about
# a minute on 16 cores, seconds when the machine is still warm):
#   build tests bench demo          the suite, FusedAdam/quantize benchmarks, the demo
#   build offload capacity_small    OffloadAdam's modes at 1.3B; capacity at 3B and 1.3B
#   build capacity                  capacity at 7B and 13B (issue 12's MFU and host-memory targets)
#   build linear_ce / build plan / build activations, one call each
# The device gets a copy of the working tree without
# .git, so pass the commit it holds in EFFMEM_GIT_COMMIT (from
# `git rev-parse HEAD` here); it goes into every JSON.
#
# Each part runs under its own time limit, so one hang cannot eat the call,
# and output is unbuffered, so a killed run still shows how far it got.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-$(date -u +%F)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(build tests bench demo offload capacity capacity_small linear_ce plan activations)

limit() { timeout -k 10 "$@"; }

for part in "${parts[@]}"; do
  echo "== $part ($(date -u +%H:%M:%S))"
  case "$part" in
    build)
      # EFFMEM_CUDA=ON: a machine where nvcc is not found fails here, instead of
      # building for the CPU only and failing every CUDA test.
      EFFMEM_CUDA=ON limit 300 "$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
        || { tail -50 "$OUT/build.log"; exit 1; }
      "$PY" -m effmem.cli info | tee "$OUT/info.txt" ;;
    tests)
      # Every test has a time limit (pytest-timeout). Under pytest-xdist a test that
      # hangs (thread method: stacks dumped, worker ended) or kills its interpreter
      # fails alone and the rest still run; tests.xml lists every outcome.
      # Each worker gets 2 of the 16 cores: 8 workers at torch's default of 16 threads
      # each starved the CPU tests (the demo fixture timed out). -v prints each outcome
      # as it comes, so even a run cut off by the limit says how far it got.
      par=()
      if "$PY" -c "import xdist" 2>/dev/null; then
        par=(-n 8 --dist loadfile -p no:benchmark --timeout-method thread)
      fi
      OMP_NUM_THREADS=2 limit 360 "$PY" -m pytest -v tests -rfEs --timeout 240 "${par[@]}" \
        --junitxml="$OUT/tests.xml" >"$OUT/tests.txt" 2>&1
      [ $? -eq 0 ] || status=1
      grep -E "^(FAILED|ERROR)|Timeout|passed|failed" "$OUT/tests.txt" | tail -40 ;;
    bench)
      limit 120 "$PY" bench/bench_adam.py --device cuda --json "$OUT/gpu_adam.json" || status=1
      limit 180 "$PY" bench/bench_compress.py --device cuda --bits 8 --gpt --json "$OUT/gpu_compress.json" || status=1
      limit 90 "$PY" bench/bench_compress.py --device cuda --bits 4 --json "$OUT/gpu_compress_4bit.json" || status=1 ;;
    demo)
      limit 150 "$PY" -m effmem.cli demo --json "$OUT/gpu_demo.json" || status=1 ;;
    offload)
      # Step time at 1.3B against FusedAdam, engine vs link bandwidth, GPU bytes/param.
      limit 200 "$PY" bench/bench_offload.py --device cuda --json "$OUT/gpu_offload.json" || status=1 ;;
    capacity)
      # For each size the fastest configuration that trains, its tokens/s, MFU, GPU peak and host memory,
      # against FusedAdam and torch AdamW + AMP (each run its own process): 7B and 13B, the targets.
      limit 560 "$PY" bench/bench_capacity.py --sizes 7b,13b --json "$OUT/gpu_capacity.json" || status=1 ;;
    capacity_small)
      limit 330 "$PY" bench/bench_capacity.py --sizes 3b,1.3b --timeout 120 \
        --json "$OUT/gpu_capacity_small.json" || status=1 ;;
    linear_ce)
      # Fused linear cross-entropy at 16k tokens x 128k vocabulary x 4096, bf16, against the
      # unfused path eager and compiled: time, extra peak memory, targets.
      limit 300 "$PY" bench/bench_linear_ce.py --device cuda --json "$OUT/gpu_linear_ce.json" || status=1 ;;
    plan)
      # effmem plan's predicted peak and step against measured, 36 configurations, and its pick.
      limit 480 "$PY" bench/bench_plan.py --json "$OUT/gpu_plan.json" || status=1 ;;
    activations)
      # Activation-memory techniques on a TinyLlama-shaped Llama (issue 10, item 5), in two runs that fit
      # one call with the build (330 + 130 s). First every row at TinyLlama's shape (22 layers, bf16,
      # batch 8 x 2048) for 12 steps (8 timed): step time, peak, saved and held memory. Its losses after
      # 12 steps are early descent, and 200 steps of 9 rows there (4 compiled: a minute or more each) take
      # far longer, so the loss comparison is a second run: 4 layers, batch 8 x 1024, 200 steps, the eager
      # rows. Each JSON is written after every row, so a run cut off by its limit keeps what it measured.
      limit 330 "$PY" bench/bench_activations.py --device cuda --steps 12 \
        --json "$OUT/gpu_activations.json" || status=1
      limit 130 "$PY" bench/bench_activations.py --device cuda --layers 4 --seq 1024 --steps 200 --no-compile \
        --json "$OUT/gpu_activations_loss.json" || status=1 ;;
    *)
      echo "unknown part: $part (expected build tests bench demo offload capacity capacity_small linear_ce plan activations)"; exit 2 ;;
  esac
done
exit $status
