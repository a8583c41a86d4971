#!/usr/bin/env bash
# GPU call U (issue 22, 2026-12-07, twelfth session): one build, ${LABEL:-8353f45d}, every goal of
# issue 22 against its baseline in the same run, in two parts (one call each, 600 s limit):
#   PART=1: the GPU test suite (hooks); benches/pool.rs's uncontended and threads groups at 1 and
#           16 threads and benches/memory.rs's alloc+free of 4 KiB (raw, raw in its capture-mode
#           pairs, DeviceBuffer), ROUNDS interleaved rounds (default 5).
#   PART=2: the poller (fault_probe_cost --reps 10), this build and the old sleep-polling poller
#           (fff5dcd, the same example source, `fault_probe_cost_old`) interleaved, ROUNDS runs
#           each; the async server (10,000 requests, 16 workers; async with a cap of 64, and
#           with 8 workers as a probe of the cause), ROUNDS interleaved repeats of each mode;
#           the seed's workloads; the demo's --devices 2.
# Programs are user builds:
#   scripts/gpu-bundle.sh --no-hooks --features cudarc,kernels --bench pool --bench memory \
#     --example async_server --example completion_mechanisms --example fault_probe_cost \
#     --bin cuda-stream-pool
#   (then in .gpu: mv bin/memory-* bin/memory; mv bin/pool-* bin/pool;
#    tar cJf tests.tar.xz tests; rm -rf tests)
# and the old poller: `git worktree add ../old fff5dcd`, the example file copied from this build,
# "model-hooks" dropped from its dev-dependency, `cargo build --release --features kernels
# --example fault_probe_cost`, stripped, copied to .gpu/bin/fault_probe_cost_old.
# Everything lands in $OUT/u$PART.txt (the tool brings back few files).
cd "$(dirname "$0")/../.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
R=${ROUNDS:-5}; b=.gpu/bin; log=$OUT/u${PART:-1}.txt
exec > >(tee -a "$log") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
if [ "${PART:-1}" = 1 ]; then
  if [ -z "${SKIP_TESTS:-}" ]; then   # SKIP_TESTS=1: the suite ran already in this call
  tar xJf .gpu/tests.tar.xz -C .gpu && echo "unpacked $(el) s"
  timeout 200 bash .gpu/run-tests.sh > $OUT/gpu-tests.txt 2>&1; echo "tests rc=$? $(el) s"; tail -1 $OUT/gpu-tests.txt
  grep -E "FAILED|panicked|failed;" $OUT/gpu-tests.txt | grep -v " 0 failed" | head -20
  fi
  filter='^(uncontended/(pool|global_lock)|threads/(pool|global_lock)/(1|16))$'
  for r in $(seq $R); do
    echo "== pool round $r"; timeout 60 $b/pool --bench "$filter" --measurement-time 2 --warm-up-time 1 --noplot 2>&1 | grep -E "^[a-z_/0-9]+ +time:|time:" ; echo "pool $r $(el) s"
    echo "== memory round $r"; CSP_BENCH_DRIVER=cuda timeout 60 $b/memory --bench alloc_free_4KiB --measurement-time 3 --warm-up-time 1 --noplot 2>&1 | grep -E "time:|^[a-z]" ; echo "memory $r $(el) s"
  done
else
  for r in $(seq $R); do
    echo "== poller new $r"; timeout 40 $b/fault_probe_cost --reps 10 2>&1 | grep -E "released|CPU"
    echo "== poller old $r"; timeout 40 $b/fault_probe_cost_old --reps 10 2>&1 | grep -E "released|CPU"
  done; echo "poller $(el) s"
  for r in $(seq $R); do for m in async:64:16 async:64:8 blocking:0:16 shared:0:16; do
    IFS=: read mode cap w <<< "$m"
    echo "{\"build\":\"${LABEL:-8353f45d}\",\"rep\":$r,\"mode\":\"$mode\",\"workers_arg\":$w,\"run\":$(timeout 20 $b/async_server --n 10000 --workers $w --mode $mode --cap $cap --json 2>&1 | tail -1)}"
  done; done; echo "async $(el) s"
  timeout 170 $b/cuda-stream-pool --driver cuda --repeat 5 --threads 1,16 --strategies floor,pool,pool-tls 2>&1 | grep -E "^(device|short|prodcons)"; echo "demo rc=$? $(el) s"
  timeout 120 $b/cuda-stream-pool --driver cuda --workloads prodcons,short --repeat 5 --threads 16 --strategies floor,pool 2>&1 | grep -E "^(short|prodcons)"; echo "demo16 $(el) s"
  timeout 30 $b/cuda-stream-pool --driver cuda --devices 2 --threads 16 --repeat 1 --strategies floor,pool 2>&1 | head -3; echo "devices2 $(el) s"
fi
echo "done $(el) s"
