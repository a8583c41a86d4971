#!/usr/bin/env bash
# GPU call C (issue 22, 2026-12-06 third session): the GPU test suite on 1716149 (hooks),
# then user builds interleaved: the seed workloads (before 79462db, mid 094c001, final), alloc+free
# (before, final = 1716149; longer measurements), the async server (before, final).
cd "$(dirname "$0")/.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
tar xJf .gpu/tests.tar.xz -C .gpu && echo "unpacked $(el) s"
timeout 200 bash .gpu/run-tests.sh > $OUT/gpu-tests.txt 2>&1; echo "tests rc=$? $(el) s"; tail -1 $OUT/gpu-tests.txt
grep -E "FAILED|panicked|failed;" $OUT/gpu-tests.txt | grep -v " 0 failed" | head -20
for r in 1 2; do for b in before mid final; do echo "== $r $b" >> $OUT/seed.txt
  timeout 60 .gpu/$b/cuda-stream-pool --driver cuda --repeat 3 --threads 1,16 --strategies floor,pool,pool-tls >> $OUT/seed.txt 2>&1
done; done; echo "seed $(el) s"
for r in 1 2 3; do for b in before final; do echo "== round $r $b" >> $OUT/bench-memory.txt
  CSP_BENCH_DRIVER=cuda timeout 40 .gpu/$b/memory --bench alloc_free_4KiB --warm-up-time 1 --measurement-time 3 --noplot >> $OUT/bench-memory.txt 2>&1
done; [ $(el) -gt 420 ] && break; done; echo "memory $(el) s"
for r in 1 2 3 4 5; do for m in async:64 blocking:0 shared:0; do for b in before final; do
  echo "{\"build\":\"$b\",\"rep\":$r,\"mode\":\"$m\",\"run\":$(timeout 20 .gpu/$b/async_server --n 10000 --workers 16 --mode ${m%:*} --cap ${m#*:} --json 2>&1 | tail -1)}" >> $OUT/async-server.jsonl
done; done; [ $(el) -gt 540 ] && break; done; echo "async $(el) s"
grep -E "^== |^short +pool |^prodcons +pool " $OUT/seed.txt
grep -E "^== |time:" $OUT/bench-memory.txt | awk '/^==/{r=$0; next} {print r, $1, $(NF-3), $(NF-2)}'
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
