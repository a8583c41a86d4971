#!/usr/bin/env bash
# GPU call M (issue 22, 2026-12-06 fourth session): benches/pool.rs's uncontended and threads
# groups at 1 and 16 threads, then the async server (10,000 requests, 16 workers), 6a19ce3
# (before the per-shard context references and the pool's credits) against a70513d, user builds
# (--features cudarc,kernels), interleaved; then the GPU test suite on a70513d (hooks).
cd "$(dirname "$0")/.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
filter='^(uncontended/(pool|global_lock)|threads/(pool|global_lock)/(1|16))$'
for r in 1 2 3; do for b in base new; do
  timeout 60 .gpu/$b/pool --bench "$filter" --measurement-time 2 --warm-up-time 1 --noplot > $OUT/pool-$b-$r.txt 2>&1
  echo "$b $r rc=$? $(el) s"
done; done
for r in 1 2 3; do for m in async:64 async:0 blocking:0 shared:0; do for b in base new; do
  echo "{\"build\":\"$b\",\"rep\":$r,\"mode\":\"$m\",\"run\":$(timeout 20 .gpu/$b/async_server --n 10000 --workers 16 --mode ${m%:*} --cap ${m#*:} --json 2>&1 | tail -1)}" >> $OUT/async-server.jsonl
done; done; done; echo "async $(el) s"
grep -H "time:" $OUT/pool-*.txt | sed 's/ *time: */ /'
python3 - $OUT/async-server.jsonl <<'PY'
import json,sys,statistics as st
from collections import defaultdict
d=defaultdict(list)
for l in open(sys.argv[1]):
    try: r=json.loads(l); d[(r['build'],r['mode'])].append(r['run'])
    except Exception: print("bad", l[:150])
for k,v in sorted(d.items()):
    rps=[x['requests_per_s'] for x in v]
    print(k, [round(x/1e3,1) for x in rps], 'med', round(st.median(rps)/1e3,1), 'p99', [round(x['p99_us']/1e3) for x in v])
PY
tar xJf .gpu/tests.tar.xz -C .gpu && echo "unpacked $(el) s"
timeout 120 bash .gpu/run-tests.sh > $OUT/gpu-tests.txt 2>&1; echo "tests rc=$? $(el) s"; tail -1 $OUT/gpu-tests.txt
grep -E "FAILED|panicked|failed;" $OUT/gpu-tests.txt | grep -v " 0 failed" | head -20
