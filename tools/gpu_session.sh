#!/usr/bin/env bash
# One device call: build with CUDA, run the GPU tests (and the rest of the suite with the GPU as the
# default device), compute-sanitizer on the kernels, then the benchmarks. Logs go to $LOGS, packed
# at exit into $OUT/logs.tgz (the device tool returns at most 8 files from $OUT).
#   tools/gpu_session.sh [tests|report|dropout|clip|matmul|norm|softmax|attention|ncu-dropout|all] ...
#   A build made elsewhere for the device's Python is used when carried and current:
#   .prebuilt/jaxdet-site.txz, an xz tar of jaxdet-site/ (pip install --target) holding
#   .jaxdet-stamp (the output of `tools/gpu_session.sh stamp` for the sources it was built from).
#   GPU_DEFAULT_PASS=0 skips the second test pass (all tests with the GPU as the default device);
#   MATMUL_BENCH=0 stops the matmul part after the sanitizers (MATMUL_BENCH_ARGS: options for the
#   benchmark); SANITIZE=0 skips the sanitizers; BENCH=0 skips every benchmark.
#   and, not part of all: decoder (the reference decoder's training step against plain JAX with
#   XLA and with cuDNN attention: benchmarks/decoder_step_bench.py; DECODER_BENCH_ARGS, default
#   '--layers 8 --batch 4'), clip-trace (profiler view of the clip loops), db-chunks (dB at each
#   WGRAD_CHUNK_TOKENS in $DB_CHUNKS, default "2048 8192"), gemm-bits (result hashes of the GEMM,
#   to diff between two builds: tools/gemm_schedule_bits.py), attention-bits (the same for
#   attention: tools/attention_schedule_bits.py), ncu-attention (Nsight Compute sections of the
#   attention forward's first kernel; NCU_ATTENTION_ARGS='--head-dim 64'), ncu-decode (the same for
#   batch-1 decode steps' kernels), buckets (the M-bucket tests, tests/test_gemm_buckets.py;
#   BUCKET_TESTS=-k ... selects), tile-sweep (every forced tile of the bucketed kernel sets timed
#   against jnp.dot; SWEEP_ARGS adds options, SWEEP_SM80=1 also sweeps the sm_80 kernels),
#   matmul-sm80 (the matmul benchmark with JAXDET_TESTING=gemm=sm80; SM80_BENCH_ARGS),
#   sanitize-sm80 (memcheck and racecheck of the sm_80 kernels, forced), multi-gpu (two or more
#   GPUs: the device-count and multi-process GPU tests, the all-reduce, sharded-matmul and
#   data-parallel step benchmarks; NVLink multicast off).
#   One-off CUDA probes (tools/experiments/; each compiles its own file, no package build):
#   mma-latency (clocks per dependent k16 step of wgmma and mma.sync: mma_chain_latency.cu),
#   mma-zero-step (a k16 step of zero products on every kind of float32 accumulator:
#   mma_zero_step.cu), narrow-stages (the forward's 16x32 GEMM tile by pipeline depth:
#   gemm_narrow_stages.cu), narrow-ws (a warp-specialized narrow tile against the package's:
#   gemm_narrow_ws.cu), decode-read (a batch-1 decode step's KV cache read in the split
#   kernels' pattern and in contiguous pieces: decode_read_pattern.cu), cluster-sweep (Hopper GEMM
#   tiles and thread block clusters side by side, bits compared: gemm_cluster_sweep.cu;
#   SWEEP_ROUNDS, SWEEP_ONLY=dA, dB or rows).
#   PYTEST_ARGS: options for the tests mode, as shell words (PYTEST_ARGS='-k "not every_tile"').
#   Build cache: the build runs in /tmp/jaxdet-build from a copy of the tree in /tmp/jaxdet-src and
#   leaves its objects and the sources' SHA-1s in $OUT/gpu-cache.txz.part-* (xz, 15 MiB pieces).
#   Put those files in build/gpu-cache/ and carry that folder: the next call recompiles only what
#   changed (sources whose SHA-1 still matches get an old mtime, so ninja sees their objects as up
#   to date).
set -uo pipefail
OUT=${OUT:-/tmp/jaxdet-out}
LOGS=${LOGS:-/tmp/jaxdet-logs}  # two sessions may run side by side with their own LOGS (after one has built)
rm -rf "$LOGS" && mkdir -p "$OUT" "$LOGS"
trap 'exit 143' TERM
trap 'tar czf "$OUT/$(basename "$LOGS").tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"' EXIT
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
what=("$@"); [ ${#what[@]} -eq 0 ] && what=(all)
has() { for w in "${what[@]}"; do [ "$w" = all ] || [ "$w" = "$1" ] && return 0; done; return 1; }
asked() { for w in "${what[@]}"; do [ "$w" = "$1" ] && return 0; done; return 1; }
repo=$(pwd)
source_stamp() { find cuda jaxdet CMakeLists.txt pyproject.toml -type f -not -name '*.pyc' -not -name '*.so' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-40; }
[ "${what[0]}" = stamp ] && { source_stamp; exit 0; }

if [ -d .whl ]; then
  if [ ! -f /tmp/site/.jaxdet-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.jaxdet-wheels
  fi
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$LOGS/device.txt"
start=$(date +%s)
src=/tmp/jaxdet-src; bdir=/tmp/jaxdet-build; old=@946684800  # 2000-01-01
# A machine kept warm between calls still has the last build: reuse it when the sources match.
stamp=$(source_stamp)
# The CUDA probes of tools/experiments/ compile their own file and need no package build.
standalone_only() {
  for w in "${what[@]}"; do
    case "$w" in narrow-stages | narrow-ws | cluster-sweep | mma-zero-step | decode-read | mma-latency) ;; *) return 1 ;; esac
  done
}
if standalone_only; then
  echo "build: skipped (standalone CUDA probes only)"
elif [ -f /tmp/jaxdet-site/.jaxdet-stamp ] && [ "$(cat /tmp/jaxdet-site/.jaxdet-stamp)" = "$stamp" ]; then
  echo "build: reused (same sources)"
elif [ -f .prebuilt/jaxdet-site.txz ] && rm -rf /tmp/prebuilt && mkdir /tmp/prebuilt \
    && xz -dc .prebuilt/jaxdet-site.txz | tar xf - -C /tmp/prebuilt \
    && [ "$(cat /tmp/prebuilt/jaxdet-site/.jaxdet-stamp)" = "$stamp" ]; then
  rm -rf /tmp/jaxdet-site && mv /tmp/prebuilt/jaxdet-site /tmp/jaxdet-site
  echo "build: carried (same sources)"
else
  rm -rf "$src" && mkdir -p "$src" \
    && tar cf - --exclude=./build --exclude=./.whl --exclude=./.git . | tar xf - -C "$src"
  (cd "$src" && find . -type f | sort | xargs -d '\n' sha1sum) > /tmp/jaxdet-src.sha1
  if [ ! -d "$bdir" ] && ls build/gpu-cache/gpu-cache.txz.part-* > /dev/null 2>&1; then
    cat build/gpu-cache/gpu-cache.txz.part-* | tar xJf - -C /tmp && echo "build: cache restored ($(du -sh "$bdir" | cut -f1))"
  fi
  if [ -f "$bdir/.src-sha1" ]; then
    # unchanged sources, and the pinned CUTLASS wheel's headers, are older than the cached objects
    grep -Fxf "$bdir/.src-sha1" /tmp/jaxdet-src.sha1 | cut -c43- | (cd "$src" && xargs -d '\n' -r touch -d "$old")
    [ -d /tmp/site/cutlass_library ] && find /tmp/site/cutlass_library -exec touch -h -d "$old" {} +
    echo "build: $(grep -vFxf "$bdir/.src-sha1" /tmp/jaxdet-src.sha1 | wc -l) files changed since the cached build"
  fi
  (cd "$src" && python3 -m pip install -q --no-build-isolation --no-deps --upgrade -Cbuild-dir="$bdir" \
     --target /tmp/jaxdet-site .) > "$LOGS/build.log" 2>&1 || { tail -40 "$LOGS/build.log"; exit 1; }
  echo "$stamp" > /tmp/jaxdet-site/.jaxdet-stamp
  cp /tmp/jaxdet-src.sha1 "$bdir/.src-sha1"
  rm -f "$OUT"/gpu-cache.txz.part-*
  tar cf - -C /tmp --exclude='*.so' jaxdet-build | xz -T0 -6 | split -b 15M - "$OUT/gpu-cache.txz.part-"
  echo "build: $(( $(date +%s) - start )) s; cache $(cat "$OUT"/gpu-cache.txz.part-* | wc -c) bytes in $(ls "$OUT"/gpu-cache.txz.part-* | wc -l) pieces"
fi
export PYTHONPATH=/tmp/jaxdet-site${PYTHONPATH:+:$PYTHONPATH}
# The tests run from /tmp; a session beside it may be running them, so only the modes that run
# tests copy. (No test imports or runs anything of benchmarks/.)
if has tests || asked buckets || asked multi-gpu; then
  rm -rf /tmp/jaxdet-tests /tmp/notebooks && cp -r tests /tmp/jaxdet-tests && cp -r notebooks /tmp/notebooks \
    && cp pyproject.toml README.md /tmp/  # tests/test_rl.py imports notebooks/rl_toy.py
fi
# From /tmp so that the installed package (not the source folder) is imported.
run_pytest() { (cd /tmp && python3 -m pytest -q -rs -p no:cacheprovider -c /tmp/pyproject.toml "$@"); }

if has tests; then
  echo "== GPU tests (README: pytest -m gpu)"
  eval "extra=(${PYTEST_ARGS:-})"  # shell words: PYTEST_ARGS='-k "not every_tile"'
  # TEST_SHARDS: pytest processes side by side, one per space-separated word of comma-separated
  # files (default: one process, TEST_FILES or every file). Each stops after TEST_TIMEOUT seconds
  # so that the logs (one line per test) still come back.
  shards=(${TEST_SHARDS:-${TEST_FILES:-.}}); [ -n "${TEST_SHARDS:-}" ] || shards=("$(echo ${TEST_FILES:-.} | tr ' ' ,)")
  # Side by side, no process (nor the subprocesses some tests start) may take XLA's default 75% of
  # the GPU's memory up front: the others would fail to create their streams.
  [ ${#shards[@]} -gt 1 ] && export XLA_PYTHON_CLIENT_PREALLOCATE=false
  i=0
  for shard in "${shards[@]}"; do
    files=(); for f in ${shard//,/ }; do files+=("/tmp/jaxdet-tests/$f"); done
    (timeout "${TEST_TIMEOUT:-1800}" bash -c "$(declare -f run_pytest); run_pytest -v -m gpu --durations=8 \"\$@\"" _ \
      "${extra[@]}" "${files[@]}" > "$LOGS/pytest_gpu_$i.log" 2>&1; echo "shard $i (${shard}): rc=$?") &
    i=$((i + 1))
  done
  wait
  for log in "$LOGS"/pytest_gpu_*.log; do echo "-- $log"; grep -E "FAILED|ERROR|passed|failed|skipped|selected" "$log" | tail -15; done
  if [ "${GPU_DEFAULT_PASS:-1}" = 1 ]; then
    echo "== the same files with the GPU as the default device"
    run_pytest /tmp/jaxdet-tests 2>&1 | tee "$LOGS/pytest_all.log" | tail -6
  fi
fi
if has report; then
  echo "== python -m jaxdet"
  (cd /tmp && python3 -m jaxdet 2>/dev/null | tee "$LOGS/report.txt")
fi

sanitize() {  # name, kernel regex, tool, command...  (SANITIZE=0 skips)
  local name=$1 regex=$2 tool=$3; shift 3
  [ "${SANITIZE:-1}" = 1 ] || { echo "compute-sanitizer $tool $name: skipped (SANITIZE=0)"; return; }
  (cd "$repo" && XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 300 \
    compute-sanitizer --tool "$tool" --kernel-name "regex=$regex" --error-exitcode 9 "$@" \
    > "$LOGS/sanitize_${name}_${tool}.log" 2>&1)
  echo "compute-sanitizer $tool $name: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/sanitize_${name}_${tool}.log" | tail -1)"
}
benching() { [ "${BENCH:-1}" = 1 ] || { echo "$1 benchmark: skipped (BENCH=0)"; return 1; }; echo "== $1 benchmark"; }
if has dropout; then
  sanitize dropout 'Dropout|Philox' memcheck python3 benchmarks/dropout_bench.py --sanitize
  benching dropout && python3 benchmarks/dropout_bench.py 2>&1 | tee "$LOGS/bench_dropout.md"
fi
if has ncu-dropout; then
  timeout 240 ncu --clock-control none --kernel-name regex:DropoutKernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    python3 benchmarks/dropout_bench.py --shape 64x4096x1024 > "$LOGS/ncu_dropout.txt" 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Warp|No Eligible|Stall|Executed Ipc A" "$LOGS/ncu_dropout.txt" | head -30
fi
if asked ncu-attention; then
  # the third forward launch (first launch of the pair: FwdKernel<..., false>) at batch 8, 2048 tokens
  timeout 300 ncu --clock-control none --kernel-name regex:FwdKernel --launch-skip 4 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section InstructionStats \
    python3 benchmarks/attention_bench.py --profile ${NCU_ATTENTION_ARGS:-} > "$LOGS/ncu_attention.txt" 2>&1
  grep -E "FwdKernel|Duration|Throughput|Registers Per|Occupancy|Issued Warp|No Eligible|Stall|Ipc|Pipe|Shared" \
    "$LOGS/ncu_attention.txt" | head -60
fi
if asked ncu-decode; then
  # batch-1 decode steps (4096 and 32768 positions), the KV cache left in L2 between replays as a
  # generation loop leaves it (no preallocation: each replay saves and restores the allocated memory)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 ncu --clock-control none --cache-control none \
    --kernel-name regex:'DecodeSplitKernel|CombineKernel|FwdKernel' --launch-skip 0 --launch-count 12 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section SchedulerStats --section WarpStateStats \
    --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python3 benchmarks/attention_bench.py --profile-decode > "$LOGS/ncu_decode.txt" 2>&1
  grep -E "Kernel|Duration|Throughput|Registers Per|Occupancy|Issued Warp|No Eligible|Stall|stalled|Grid Size|Cluster|Active Cycles|Elapsed Cycles" \
    "$LOGS/ncu_decode.txt" | head -150
fi
if has clip && [ -f benchmarks/clip_bench.py ]; then
  sanitize clip 'PartialKernel|FinalizeKernel|ApplyKernel' memcheck python3 benchmarks/clip_bench.py --sanitize
  sanitize clip 'PartialKernel|FinalizeKernel|ApplyKernel' racecheck python3 benchmarks/clip_bench.py --sanitize
  if benching clip; then
    timeout ${CLIP_BENCH_TIMEOUT:-400} python3 benchmarks/clip_bench.py > "$LOGS/bench_clip.md" 2>&1; echo "rc=$?"
    grep -vE "^\[" "$LOGS/bench_clip.md"
  fi
fi
if has norm; then
  sanitize norm 'Norm|RowStats|Segment' memcheck python3 benchmarks/norm_bench.py --sanitize
  sanitize norm 'Norm|RowStats|Segment' racecheck python3 benchmarks/norm_bench.py --sanitize
  if benching norm; then
    timeout ${NORM_BENCH_TIMEOUT:-200} python3 benchmarks/norm_bench.py > "$LOGS/bench_norm.md" 2>&1; echo "rc=$?"
    grep -E "^\||^[A-Za-z]" "$LOGS/bench_norm.md" | head -40
  fi
fi
if has softmax; then
  sanitize softmax 'Softmax|Xent|Cluster|Segment|RowStats' memcheck python3 benchmarks/softmax_bench.py --sanitize
  sanitize softmax 'Softmax|Xent|Cluster|Segment|RowStats' racecheck python3 benchmarks/softmax_bench.py --sanitize
  JAXDET_TESTING=softmax=passes sanitize softmax-passes 'Softmax|Xent|Segment|RowStats' memcheck \
    python3 benchmarks/softmax_bench.py --sanitize
  benching softmax && for dt in float32 bfloat16; do
    timeout ${SOFTMAX_BENCH_TIMEOUT:-200} python3 benchmarks/softmax_bench.py --dtype $dt > "$LOGS/bench_softmax_$dt.md" 2>&1
    echo "rc=$?"; grep -E "^\||^[A-Za-z]" "$LOGS/bench_softmax_$dt.md" | head -40
  done
fi
if has attention; then
  sanitize attention 'Fwd|Decode|Dq|Dkdv|Combine|Delta|TileRange' memcheck python3 benchmarks/attention_bench.py --sanitize
  sanitize attention 'Fwd|Decode|Dq|Dkdv|Combine|Delta|TileRange' racecheck python3 benchmarks/attention_bench.py --sanitize
  if benching attention; then
    timeout ${ATTENTION_BENCH_TIMEOUT:-300} python3 benchmarks/attention_bench.py > "$LOGS/bench_attention.md" 2>&1
    echo "rc=$?"; grep -E "^\||^[A-Za-z#]" "$LOGS/bench_attention.md" | head -60
  fi
fi
if asked decoder; then  # the reference decoder's step: jaxdet vs plain JAX (XLA and cuDNN attention)
  if benching decoder; then
    timeout ${DECODER_BENCH_TIMEOUT:-500} python3 benchmarks/decoder_step_bench.py ${DECODER_BENCH_ARGS:---layers 8 --batch 4} \
      > "$LOGS/bench_decoder.md" 2>&1
    echo "rc=$?"; grep -E "^\||^[A-Za-z\[]" "$LOGS/bench_decoder.md" | head -30
  fi
fi
if has matmul; then
  # (The raw-kernel checks, default and sm_80-forced, are tests/test_gemm_cuda_kernels.py.)
  sanitize matmul 'cutlass|Gemm|gemm|Sgemm' memcheck python3 benchmarks/matmul_bench.py --sanitize
  sanitize matmul 'cutlass|Gemm|gemm|Sgemm' racecheck python3 benchmarks/matmul_bench.py --sanitize
  if [ "${MATMUL_BENCH:-1}" = 1 ] && benching matmul; then
    timeout ${MATMUL_BENCH_TIMEOUT:-300} python3 benchmarks/matmul_bench.py ${MATMUL_BENCH_ARGS:-} --out "$LOGS/bench_matmul.md" > "$LOGS/bench_matmul.log" 2>&1
    echo "rc=$?"; grep -E "^\|" "$LOGS/bench_matmul.log" | head -90; sed -n '/Row 0 bits/,$p' "$LOGS/bench_matmul.log"
  else
    echo "matmul benchmark: skipped (MATMUL_BENCH=0)"
  fi
fi
if asked clip-trace; then
  echo "== clip in-jit loops under the profiler"
  timeout 240 python3 benchmarks/clip_bench.py --trace > "$LOGS/clip_trace.txt" 2>&1; echo "rc=$?"
  grep -E "^(/|####)|^ +[0-9]" "$LOGS/clip_trace.txt" | head -120
fi
if asked db-chunks; then
  for c in ${DB_CHUNKS:-2048 8192}; do
    echo "== dB with WGRAD_CHUNK_TOKENS=$c"
    timeout ${MATMUL_BENCH_TIMEOUT:-300} python3 benchmarks/matmul_bench.py --ops dB --chunk-tokens "$c" \
      --ms ${DB_MS:-1,128,1024,4096,16384} --reps 10 --inner 3 --out "$LOGS/bench_db_$c.md" > "$LOGS/bench_db_$c.log" 2>&1
    echo "rc=$?"; grep -E "^dB" "$LOGS/bench_db_$c.log"
  done
fi
if asked buckets; then
  echo "== M-bucket tests (tests/test_gemm_buckets.py)"
  run_pytest -m gpu ${BUCKET_TESTS:-} /tmp/jaxdet-tests/test_gemm_buckets.py 2>&1 | tee "$LOGS/pytest_buckets.log" | tail -15
fi
if asked tile-sweep; then
  echo "== tile sweep"
  timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/matmul_bench.py --tile-sweep all --ops fwd,dA \
    ${SWEEP_ARGS:-} --out "$LOGS/tile_sweep.md" > "$LOGS/tile_sweep.log" 2>&1; echo "rc=$?"
  grep -E "^\||^sweep" "$LOGS/tile_sweep.log"
  if [ "${SWEEP_SM80:-0}" = 1 ]; then
    echo "== tile sweep, sm_80 kernels"
    JAXDET_TESTING=gemm=sm80 timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/matmul_bench.py --tile-sweep all \
      --ops fwd,dA ${SWEEP_SM80_ARGS:-} --out "$LOGS/tile_sweep_sm80.md" > "$LOGS/tile_sweep_sm80.log" 2>&1; echo "rc=$?"
    grep -E "^\||^sweep" "$LOGS/tile_sweep_sm80.log"
  fi
fi
if asked sanitize-sm80; then
  sanitize matmul_sm80 'cutlass|Gemm|gemm|Sgemm' memcheck env JAXDET_TESTING=gemm=sm80 python3 benchmarks/matmul_bench.py --sanitize
  sanitize matmul_sm80 'cutlass|Gemm|gemm|Sgemm' racecheck env JAXDET_TESTING=gemm=sm80 python3 benchmarks/matmul_bench.py --sanitize
fi
if asked matmul-sm80; then
  echo "== matmul benchmark, sm_80 kernels"
  JAXDET_TESTING=gemm=sm80 timeout ${MATMUL_BENCH_TIMEOUT:-300} python3 benchmarks/matmul_bench.py ${SM80_BENCH_ARGS:-} \
    --out "$LOGS/bench_matmul_sm80.md" > "$LOGS/bench_matmul_sm80.log" 2>&1; echo "rc=$?"
  grep -E "^\|" "$LOGS/bench_matmul_sm80.log" | head -120
fi
if asked attention-bits; then
  python3 tools/attention_schedule_bits.py > "$LOGS/attention_bits.txt" 2>&1; echo "rc=$?"
  cat "$LOGS/attention_bits.txt"
fi
if asked narrow-stages; then
  nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I cuda -I /tmp/site/cutlass_library/source/include \
    tools/experiments/gemm_narrow_stages.cu -o /tmp/gemm_narrow_stages && /tmp/gemm_narrow_stages | tee "$LOGS/narrow_stages.md"
fi
if asked narrow-ws; then
  nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I cuda -I /tmp/site/cutlass_library/source/include \
    tools/experiments/gemm_narrow_ws.cu -o /tmp/gemm_narrow_ws && /tmp/gemm_narrow_ws | tee "$LOGS/narrow_ws.md"
fi
if asked cluster-sweep; then  # GEMM tiles and thread block clusters side by side (SWEEP_ROUNDS rounds)
  for p in 0 1 2 3 4 main; do
    def=$([ $p = main ] || echo -DSWEEP_PART=$p)
    nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -I cuda \
      -I /tmp/site/cutlass_library/source/include $def -c tools/experiments/gemm_cluster_sweep.cu -o /tmp/sweep_$p.o &
  done
  wait
  nvcc /tmp/sweep_*.o -o /tmp/gemm_cluster_sweep && /tmp/gemm_cluster_sweep ${SWEEP_ROUNDS:-5} ${SWEEP_ONLY:-} | tee "$LOGS/cluster_sweep.md"
fi
if asked mma-zero-step; then  # does a k16 step of zero products leave the accumulators unchanged?
  nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I cuda tools/experiments/mma_zero_step.cu -o /tmp/mma_zero_step \
    && /tmp/mma_zero_step | tee "$LOGS/mma_zero_step.txt"
fi
if asked decode-read; then  # a batch-1 decode step's KV cache read in the split kernels' pattern and contiguously
  nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I cuda tools/experiments/decode_read_pattern.cu -o /tmp/decode_read_pattern \
    && /tmp/decode_read_pattern | tee "$LOGS/decode_read_pattern.txt"
fi
if asked mma-latency; then
  nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a tools/experiments/mma_chain_latency.cu -o /tmp/mma_chain_latency \
    && /tmp/mma_chain_latency | tee "$LOGS/mma_chain_latency.txt"
fi
if asked multi-gpu; then  # nvidia-h200-x2 and larger: the device-count tests and the multi-GPU benchmarks
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: no multicast
  nvidia-smi topo -m | tee "$LOGS/topology.txt"
  echo "== multi-GPU tests"
  run_pytest -v -m gpu /tmp/jaxdet-tests/test_parallel.py /tmp/jaxdet-tests/test_multiprocess.py \
    /tmp/jaxdet-tests/test_invariant_sharding.py 2>&1 \
    | tee "$LOGS/pytest_multi_gpu.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tail -15
  if benching multi-GPU; then
    for b in allreduce_bench sharded_matmul_bench dp_step_bench; do
      timeout ${MULTI_BENCH_TIMEOUT:-300} python3 benchmarks/$b.py --out "$LOGS/$b.md" > "$LOGS/$b.log" 2>&1
      echo "$b: rc=$?"; grep -E "^\||^[A-Z]" "$LOGS/$b.log" | grep -v "^[A-Z][0-9]" | head -20
    done
  fi
fi
if asked gemm-bits; then
  python3 tools/gemm_schedule_bits.py > "$LOGS/gemm_bits.txt" 2>&1; echo "rc=$?"
  cat "$LOGS/gemm_bits.txt"
fi
