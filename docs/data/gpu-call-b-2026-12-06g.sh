#!/usr/bin/env bash
# GPU call B: acquire+release, alloc+free and the seed workloads, before (79462db) and after
# (094c001), user builds (no model hooks), interleaved rounds.
cd "$(dirname "$0")/.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
f='uncontended/(pool|global_lock)|threads/(pool|global_lock|context_clone)/(1|16)$|waiters/queue_and_serve/(1000|10000)'
for r in 1 2 3; do for b in before after; do echo "== round $r $b" >> $OUT/bench-pool.txt
  CSP_BENCH_DRIVER=cuda timeout 40 .gpu/$b/pool --bench "$f" --warm-up-time 0.5 --measurement-time 1.5 --noplot >> $OUT/bench-pool.txt 2>&1
done; done; echo "pool $(el) s"
for r in 1 2 3; do for b in before after; do echo "== round $r $b" >> $OUT/bench-memory.txt
  CSP_BENCH_DRIVER=cuda timeout 30 .gpu/$b/memory --bench alloc_free_4KiB --warm-up-time 0.5 --measurement-time 1.5 --noplot >> $OUT/bench-memory.txt 2>&1
done; done; echo "memory $(el) s"
for b in before after; do echo "== $b" >> $OUT/seed.txt
  timeout 130 .gpu/$b/cuda-stream-pool --driver cuda --repeat 5 --threads 1,16 --strategies floor,pool,pool-tls >> $OUT/seed.txt 2>&1; echo "seed $b rc=$? $(el) s"
done
grep -E "^== |time:" $OUT/bench-pool.txt | awk '/^==/{r=$0; next} {print r, $1, $(NF-3), $(NF-2)}'
grep -E "^== |time:" $OUT/bench-memory.txt | awk '/^==/{r=$0; next} {print r, $1, $(NF-3), $(NF-2)}'
grep -E "^== |pool|floor" $OUT/seed.txt | tail -30
