#!/usr/bin/env bash
# One device call: build with CUDA, run the GPU tests (and the rest of the suite with the GPU as the
# default device), compute-sanitizer on the kernels, then the benchmarks. Logs go to $OUT.
#   tools/gpu_session.sh [tests|report|dropout|clip|matmul|norm|softmax|attention|ncu-dropout|all] ...
#   A build made elsewhere for the device's Python (pip install --target .prebuilt/jaxdet-site, with
#   tools/gpu_session.sh stamp > .prebuilt/jaxdet-site/.jaxdet-stamp) is used when carried and current.
#   GPU_DEFAULT_PASS=0 skips the second test pass (all tests with the GPU as the default device);
#   MATMUL_BENCH=0 stops the matmul part after the sanitizers (MATMUL_BENCH_ARGS: options for the
#   benchmark); SANITIZE=0 skips the sanitizers.
#   and, not part of all: clip-trace (profiler view of the clip loops), db-chunks (dB at each
#   WGRAD_CHUNK_TOKENS in $DB_CHUNKS, default "2048 8192"), gemm-bits (result hashes of the GEMM,
#   to diff between two builds: benchmarks/gemm_schedule_bits.py).
set -uo pipefail
OUT=${OUT:-/tmp/jaxdet-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
what=("$@"); [ ${#what[@]} -eq 0 ] && what=(all)
has() { for w in "${what[@]}"; do [ "$w" = all ] || [ "$w" = "$1" ] && return 0; done; return 1; }
asked() { for w in "${what[@]}"; do [ "$w" = "$1" ] && return 0; done; return 1; }
repo=$(pwd)
source_stamp() { find cuda jaxdet CMakeLists.txt pyproject.toml -type f -not -name '*.pyc' -not -name '*.so' | sort | xargs cat | sha1sum | cut -c1-40; }
[ "${what[0]}" = stamp ] && { source_stamp; exit 0; }

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
start=$(date +%s)
# A machine kept warm between calls still has the last build: reuse it when the sources match.
stamp=$(source_stamp)
if [ -f .prebuilt/jaxdet-site/.jaxdet-stamp ] && [ "$(cat .prebuilt/jaxdet-site/.jaxdet-stamp)" = "$stamp" ]; then
  rm -rf /tmp/jaxdet-site && cp -r .prebuilt/jaxdet-site /tmp/jaxdet-site
  echo "build: carried (same sources)"
elif [ -f /tmp/jaxdet-site/.jaxdet-stamp ] && [ "$(cat /tmp/jaxdet-site/.jaxdet-stamp)" = "$stamp" ]; then
  echo "build: reused (same sources)"
else
  python3 -m pip install -q --no-build-isolation --no-deps --upgrade --target /tmp/jaxdet-site . > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  echo "$stamp" > /tmp/jaxdet-site/.jaxdet-stamp
  echo "build: $(( $(date +%s) - start )) s"
fi
export PYTHONPATH=/tmp/jaxdet-site${PYTHONPATH:+:$PYTHONPATH}
rm -rf /tmp/jaxdet-tests /tmp/benchmarks && cp -r tests /tmp/jaxdet-tests && cp -r benchmarks /tmp/benchmarks \
  && cp pyproject.toml README.md /tmp/
# From /tmp so that the installed package (not the source folder) is imported.
run_pytest() { (cd /tmp && python3 -m pytest -q -rs -p no:cacheprovider -c /tmp/pyproject.toml "$@"); }

if has tests; then
  files=(); for f in ${TEST_FILES:-}; do files+=("/tmp/jaxdet-tests/$f"); done
  [ ${#files[@]} -eq 0 ] && files=(/tmp/jaxdet-tests)
  echo "== GPU tests (README: pytest -m gpu)"
  run_pytest -m gpu "${files[@]}" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -6
  if [ "${GPU_DEFAULT_PASS:-1}" = 1 ]; then
    echo "== the same files with the GPU as the default device"
    run_pytest "${files[@]}" 2>&1 | tee "$OUT/pytest_all.log" | tail -6
  fi
fi
if has report; then
  echo "== python -m jaxdet"
  (cd /tmp && python3 -m jaxdet 2>/dev/null | tee "$OUT/report.txt")
fi

sanitize() {  # name, kernel regex, tool, command...  (SANITIZE=0 skips)
  local name=$1 regex=$2 tool=$3; shift 3
  [ "${SANITIZE:-1}" = 1 ] || { echo "compute-sanitizer $tool $name: skipped (SANITIZE=0)"; return; }
  (cd "$repo" && XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 300 \
    compute-sanitizer --tool "$tool" --kernel-name "regex=$regex" --error-exitcode 9 "$@" \
    > "$OUT/sanitize_${name}_${tool}.log" 2>&1)
  echo "compute-sanitizer $tool $name: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_${name}_${tool}.log" | tail -1)"
}
if has dropout; then
  sanitize dropout 'Dropout|Philox' memcheck python3 benchmarks/dropout_bench.py --sanitize
  echo "== dropout benchmark"
  python3 benchmarks/dropout_bench.py 2>&1 | tee "$OUT/bench_dropout.md"
fi
if has ncu-dropout; then
  timeout 240 ncu --clock-control none --kernel-name regex:DropoutKernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    python3 benchmarks/dropout_bench.py --shape 64x4096x1024 > "$OUT/ncu_dropout.txt" 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Warp|No Eligible|Stall|Executed Ipc A" "$OUT/ncu_dropout.txt" | head -30
fi
if has clip && [ -f benchmarks/clip_bench.py ]; then
  sanitize clip 'PartialKernel|FinalizeKernel|ApplyKernel' memcheck python3 benchmarks/clip_bench.py --sanitize
  sanitize clip 'PartialKernel|FinalizeKernel|ApplyKernel' racecheck python3 benchmarks/clip_bench.py --sanitize
  echo "== clip benchmark"
  timeout ${CLIP_BENCH_TIMEOUT:-400} python3 benchmarks/clip_bench.py > "$OUT/bench_clip.md" 2>&1; echo "rc=$?"
  grep -vE "^\[" "$OUT/bench_clip.md"
fi
if has norm; then
  sanitize norm 'Norm|RowStats|Segment' memcheck python3 benchmarks/norm_bench.py --sanitize
  sanitize norm 'Norm|RowStats|Segment' racecheck python3 benchmarks/norm_bench.py --sanitize
  echo "== norm benchmark"
  timeout ${NORM_BENCH_TIMEOUT:-200} python3 benchmarks/norm_bench.py > "$OUT/bench_norm.md" 2>&1; echo "rc=$?"
  grep -E "^\||^[A-Za-z]" "$OUT/bench_norm.md" | head -40
fi
if has softmax; then
  sanitize softmax 'Softmax|Xent' memcheck python3 benchmarks/softmax_bench.py --sanitize
  sanitize softmax 'Softmax|Xent' racecheck python3 benchmarks/softmax_bench.py --sanitize
  echo "== softmax benchmark"
  for dt in float32 bfloat16; do
    timeout ${SOFTMAX_BENCH_TIMEOUT:-200} python3 benchmarks/softmax_bench.py --dtype $dt > "$OUT/bench_softmax_$dt.md" 2>&1
    echo "rc=$?"; grep -E "^\||^[A-Za-z]" "$OUT/bench_softmax_$dt.md" | head -40
  done
fi
if has attention; then
  sanitize attention 'Fwd|Dq|Dkdv|Combine|Delta|TileRange' memcheck python3 benchmarks/attention_bench.py --sanitize
  sanitize attention 'Fwd|Dq|Dkdv|Combine|Delta|TileRange' racecheck python3 benchmarks/attention_bench.py --sanitize
  echo "== attention benchmark"
  timeout ${ATTENTION_BENCH_TIMEOUT:-300} python3 benchmarks/attention_bench.py > "$OUT/bench_attention.md" 2>&1; echo "rc=$?"
  grep -E "^\||^[A-Za-z#]" "$OUT/bench_attention.md" | head -60
fi
if has matmul; then
  # (The raw-kernel checks, default and sm_80-forced, run as tests/test_gemm_cuda_kernels.py.)
  sanitize matmul 'cutlass|Gemm|gemm|Sgemm' memcheck python3 benchmarks/gemm_memcheck.py
  sanitize matmul 'cutlass|Gemm|gemm|Sgemm' racecheck python3 benchmarks/gemm_memcheck.py
  if [ "${MATMUL_BENCH:-1}" = 1 ]; then
    echo "== matmul benchmark"
    timeout ${MATMUL_BENCH_TIMEOUT:-300} python3 benchmarks/matmul_bench.py ${MATMUL_BENCH_ARGS:-} --out "$OUT/bench_matmul.md" > "$OUT/bench_matmul.log" 2>&1
    echo "rc=$?"; grep -E "^\|" "$OUT/bench_matmul.log" | head -90; sed -n '/Row 0 bits/,$p' "$OUT/bench_matmul.log"
  else
    echo "matmul benchmark: skipped (MATMUL_BENCH=0)"
  fi
fi
if asked clip-trace; then
  echo "== clip in-jit loops under the profiler"
  timeout 240 python3 benchmarks/clip_bench.py --trace > "$OUT/clip_trace.txt" 2>&1; echo "rc=$?"
  grep -E "^(/|####)|^ +[0-9]" "$OUT/clip_trace.txt" | head -120
fi
if asked db-chunks; then
  for c in ${DB_CHUNKS:-2048 8192}; do
    echo "== dB with WGRAD_CHUNK_TOKENS=$c"
    timeout ${MATMUL_BENCH_TIMEOUT:-300} python3 benchmarks/matmul_bench.py --ops dB --chunk-tokens "$c" \
      --ms ${DB_MS:-1,128,1024,4096,16384} --reps 10 --inner 3 --out "$OUT/bench_db_$c.md" > "$OUT/bench_db_$c.log" 2>&1
    echo "rc=$?"; grep -E "^dB" "$OUT/bench_db_$c.log"
  done
fi
if asked gemm-bits; then
  python3 benchmarks/gemm_schedule_bits.py > "$OUT/gemm_bits.txt" 2>&1; echo "rc=$?"
  cat "$OUT/gemm_bits.txt"
fi
