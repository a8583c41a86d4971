#!/usr/bin/env bash
# GPU call N (issue 22, 2026-12-06 sixth session): benches/pool.rs's uncontended and threads
# groups at 1 and 16 threads, f195f65 ("base": before 16d81d1, every shard CLOSING) against b07dcb3
# ("new"), five interleaved rounds; the async server (10,000 requests, 16 workers), five
# interleaved repeats of both builds; the seed's workloads on the new build; then the GPU test
# suite on b07dcb3 (hooks). Programs are user builds (--no-hooks --features cudarc,kernels).
cd "$(dirname "$0")/../.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
filter='^(uncontended/(pool|global_lock)|threads/(pool|global_lock)/(1|16))$'
for r in 1 2 3 4 5; do for b in base new; do
  timeout 60 .gpu/$b/pool --bench "$filter" --measurement-time 2 --warm-up-time 1 --noplot > $OUT/pool-$b-$r.txt 2>&1
  echo "$b $r rc=$? $(el) s"
done; done
for r in 1 2 3 4 5; do for m in async:64 async:0 blocking:0 shared:0; do for b in base new; do
  echo "{\"build\":\"$b\",\"rep\":$r,\"mode\":\"$m\",\"run\":$(timeout 20 .gpu/$b/async_server --n 10000 --workers 16 --mode ${m%:*} --cap ${m#*:} --json 2>&1 | tail -1)}" >> $OUT/async-server.jsonl
done; done; done; echo "async $(el) s"
timeout 150 .gpu/new/cuda-stream-pool --driver cuda --repeat 5 --threads 1,16 --strategies floor,pool,pool-tls > $OUT/demo-new.txt 2>&1; echo "demo rc=$? $(el) s"
grep -H "time:" $OUT/pool-*.txt | sed 's/ *time: */ /'
python3 scripts/async-server-summary.py $OUT/async-server.jsonl
grep -E "^(short|prodcons)" $OUT/demo-new.txt
tar xJf .gpu/tests.tar.xz -C .gpu && echo "unpacked $(el) s"
timeout 150 bash .gpu/run-tests.sh > $OUT/gpu-tests.txt 2>&1; echo "tests rc=$? $(el) s"; tail -1 $OUT/gpu-tests.txt
grep -E "FAILED|panicked|failed;" $OUT/gpu-tests.txt | grep -v " 0 failed" | head -20
