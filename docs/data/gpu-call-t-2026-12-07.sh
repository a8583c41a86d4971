#!/usr/bin/env bash
# GPU call T (issue 22, 2026-12-07 eleventh session): one build, ${LABEL:-fac51787}, every goal of
# issue 22 against its baseline in the same run: benches/pool.rs's uncontended and threads groups
# at 1 and 16 threads, ROUNDS rounds (default 7); benches/memory.rs's alloc+free of 4 KiB (raw, raw in its
# capture-mode pairs, DeviceBuffer), ROUNDS rounds (default 7); the async server (10,000 requests, 16 workers),
# five interleaved repeats of each mode; the poller (fault_probe_cost --reps 10), five runs; the
# seed's workloads; the demo's --devices 2 on a one-GPU machine (a clean error expected); the GPU
# test suite (hooks), first (the machine may be taken back before the end). Programs are user builds:
#   scripts/gpu-bundle.sh --no-hooks --features cudarc,kernels --bench pool --bench memory \
#     --example async_server --example completion_mechanisms --example fault_probe_cost \
#     --bin cuda-stream-pool
cd "$(dirname "$0")/../.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
tar xJf .gpu/tests.tar.xz -C .gpu && echo "unpacked $(el) s"
timeout 170 bash .gpu/run-tests.sh > $OUT/gpu-tests.txt 2>&1; echo "tests rc=$? $(el) s"; tail -1 $OUT/gpu-tests.txt
grep -E "FAILED|panicked|failed;" $OUT/gpu-tests.txt | grep -v " 0 failed" | head -20
b=.gpu/bin
filter='^(uncontended/(pool|global_lock)|threads/(pool|global_lock)/(1|16))$'
for r in $(seq ${ROUNDS:-7}); do
  timeout 60 $b/pool --bench "$filter" --measurement-time 2 --warm-up-time 1 --noplot > $OUT/pool-$r.txt 2>&1
  echo "pool $r rc=$? $(el) s"
  CSP_BENCH_DRIVER=cuda timeout 60 $b/memory --bench alloc_free_4KiB --measurement-time 3 --warm-up-time 1 --noplot > $OUT/memory-$r.txt 2>&1
  echo "memory $r rc=$? $(el) s"
done
for r in $(seq ${ROUNDS:-7}); do for m in async:64 async:0 blocking:0 shared:0; do
  echo "{\"build\":\"${LABEL:-fac51787}\",\"rep\":$r,\"mode\":\"$m\",\"run\":$(timeout 20 $b/async_server --n 10000 --workers 16 --mode ${m%:*} --cap ${m#*:} --json 2>&1 | tail -1)}" >> $OUT/async-server.jsonl
done; done; echo "async $(el) s"
for r in $(seq ${ROUNDS:-7}); do echo "== $r" >> $OUT/poller.txt; timeout 40 $b/fault_probe_cost --reps 10 >> $OUT/poller.txt 2>&1; done; echo "poller $(el) s"
timeout 150 $b/cuda-stream-pool --driver cuda --repeat 5 --threads 1,16 --strategies floor,pool,pool-tls > $OUT/demo.txt 2>&1; echo "demo rc=$? $(el) s"
timeout 30 $b/cuda-stream-pool --driver cuda --devices 2 --threads 16 --repeat 1 --strategies floor,pool > $OUT/devices2.txt 2>&1; echo "devices2 rc=$? $(el) s"; cat $OUT/devices2.txt | head -5
grep -H "time:" $OUT/pool-*.txt $OUT/memory-*.txt | sed 's/ *time: */ /'
python3 scripts/async-server-summary.py $OUT/async-server.jsonl
grep -E "released|CPU" $OUT/poller.txt
grep -E "^(short|prodcons)" $OUT/demo.txt
