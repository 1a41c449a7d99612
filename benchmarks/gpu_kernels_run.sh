#!/bin/bash
# One device call: build jaxdet (CUDA), run the kernel checks (default and sm_80-forced), a
# compute-sanitizer memcheck pass and a benchmark. Run from the repository root (or its copy);
# wheels of nvidia-cutlass in $WHEELS (default ../whl). Logs go to $OUT (default ./gpu-out).
# Usage: benchmarks/gpu_kernels_run.sh [benchmark arguments...]
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-../whl}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/jd . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "BUILD_SECONDS $(( $(date +%s) - t0 ))"
export PYTHONPATH=/tmp/jd:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 200 python3 benchmarks/gemm_kernels_check.py > "$OUT/check_default.log" 2>&1; echo "check default rc=$?"
grep -v "PASS accuracy" "$OUT/check_default.log" | cut -c1-260
JAXDET_GEMM_FORCE_SM80=1 timeout 120 python3 benchmarks/gemm_kernels_check.py --quick > "$OUT/check_sm80.log" 2>&1; echo "check sm80 rc=$?"
grep -E "FAIL|SUMMARY|INFO" "$OUT/check_sm80.log" | cut -c1-260
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 compute-sanitizer --tool memcheck --kernel-name kns=cutlass \
  python3 benchmarks/gemm_memcheck.py > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"
tail -4 "$OUT/memcheck.log"
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/matmul_bench.py --out "$OUT/bench.md" "$@" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -E "^(fwd|dA |dB )" "$OUT/bench.log"; sed -n '/Row 0 bits/,$p' "$OUT/bench.log"
