#!/usr/bin/env bash
# One device call: build with CUDA, run the GPU tests (and the rest of the suite on the GPU as the
# default device), compute-sanitizer on the kernels, then the benchmarks. Logs go to $OUT.
#   tools/gpu_session.sh [dropout|clip|matmul|all] ...
set -uo pipefail
OUT=${OUT:-/tmp/jaxdet-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
what=("$@"); [ ${#what[@]} -eq 0 ] && what=(all)
has() { for w in "${what[@]}"; do [ "$w" = all ] || [ "$w" = "$1" ] && return 0; done; return 1; }

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
start=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps --upgrade --target /tmp/jaxdet-site . 2>&1 | tail -20 | tee "$OUT/build.log"
echo "build: $(( $(date +%s) - start )) s"
export PYTHONPATH=/tmp/jaxdet-site${PYTHONPATH:+:$PYTHONPATH}
cd /tmp && cp -r "$OLDPWD/tests" /tmp/jaxdet-tests && cp "$OLDPWD/pyproject.toml" /tmp/ && cd "$OLDPWD"

echo "== GPU tests (README: pytest -m gpu)"
(cd /tmp && python3 -m pytest -q -m gpu -p no:cacheprovider -c /tmp/pyproject.toml /tmp/jaxdet-tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15)
echo "== whole suite with the GPU as default device"
(cd /tmp && python3 -m pytest -q -p no:cacheprovider -c /tmp/pyproject.toml /tmp/jaxdet-tests 2>&1 | tee "$OUT/pytest_all.log" | tail -8)
echo "== python -m jaxdet"
(cd /tmp && python3 -m jaxdet 2>/dev/null | tee "$OUT/report.txt")

sanitize() {  # name, kernel regex, tool, command...
  local name=$1 regex=$2 tool=$3; shift 3
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 compute-sanitizer --tool "$tool" --kernel-name "regex=$regex" \
    --error-exitcode 9 "$@" > "$OUT/sanitize_${name}_${tool}.log" 2>&1
  echo "compute-sanitizer $tool $name: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitize_${name}_${tool}.log" | tail -1)"
}
if has dropout; then
  sanitize dropout 'Dropout|Philox' memcheck python3 benchmarks/dropout_bench.py --sanitize
  echo "== dropout benchmark"
  python3 benchmarks/dropout_bench.py 2>&1 | tee "$OUT/bench_dropout.md"
fi
if has clip && [ -f benchmarks/clip_bench.py ]; then
  sanitize clip 'Clip|Norm|clip|norm' memcheck python3 benchmarks/clip_bench.py --sanitize
  sanitize clip 'Clip|Norm|clip|norm' racecheck python3 benchmarks/clip_bench.py --sanitize
  echo "== clip benchmark"
  python3 benchmarks/clip_bench.py 2>&1 | tee "$OUT/bench_clip.md"
fi
if has matmul && [ -f benchmarks/matmul_bench.py ]; then
  sanitize matmul 'Gemm|gemm|cutlass|Kernel' memcheck python3 benchmarks/matmul_bench.py --sanitize
  echo "== matmul benchmark"
  python3 benchmarks/matmul_bench.py 2>&1 | tee "$OUT/bench_matmul.md"
fi
