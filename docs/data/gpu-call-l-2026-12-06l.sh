#!/usr/bin/env bash
# GPU call L (issue 22, 2026-12-06 fourth session): the GPU test suite on cb01670 (hooks), then
# benches/pool.rs's uncontended and threads groups at 1 and 16 threads: 6a19ce3 (before the
# per-shard context references) against cb01670, user builds, interleaved, three rounds.
cd "$(dirname "$0")/.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nproc
tar xJf .gpu/tests.tar.xz -C .gpu && echo "unpacked $(el) s"
[ -n "$SKIP_TESTS" ] || timeout 240 bash .gpu/run-tests.sh > $OUT/gpu-tests.txt 2>&1; echo "tests rc=$? $(el) s"; tail -1 $OUT/gpu-tests.txt
grep -E "FAILED|panicked|failed;" $OUT/gpu-tests.txt | grep -v " 0 failed" | head -20
filter='^(uncontended/(pool|global_lock)|threads/(pool|context_clone|global_lock)/(1|16))$'
for r in 1 2 3; do for b in base new; do
  timeout 120 .gpu/$b/pool --bench "$filter" --measurement-time 3 --warm-up-time 1 --noplot > $OUT/pool-$b-$r.txt 2>&1
  echo "$b $r rc=$? $(el) s"
  [ $(el) -gt 520 ] && break 2
done; done
grep -H -A1 -E "^(uncontended|threads)/" $OUT/pool-*.txt | grep "time:" | sed 's/ *time: */ /'
