#!/usr/bin/env bash
# GPU call D (issue 22, 2026-12-06 third session): the GPU test suite on the final code (hooks),
# then the async server: 1716149 (call C's build, its example) against the final build (two
# numberings; the example makes the context current on the runtime's threads), user builds.
cd "$(dirname "$0")/.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
tar xJf .gpu/tests.tar.xz -C .gpu && echo "unpacked $(el) s"
[ -n "$SKIP_TESTS" ] || timeout 200 bash .gpu/run-tests.sh > $OUT/gpu-tests.txt 2>&1; echo "tests rc=$? $(el) s"; tail -1 $OUT/gpu-tests.txt
grep -E "FAILED|panicked|failed;" $OUT/gpu-tests.txt | grep -v " 0 failed" | head -20
for r in 1 2 3 4 5; do for m in async:64 async:0 blocking:0 shared:0; do for b in c-final final; do
  echo "{\"build\":\"$b\",\"rep\":$r,\"mode\":\"$m\",\"run\":$(timeout 20 .gpu/$b/async_server --n 10000 --workers 16 --mode ${m%:*} --cap ${m#*:} --json 2>&1 | tail -1)}" >> $OUT/async-server.jsonl
done; done; [ $(el) -gt 500 ] && break; done; echo "async $(el) s"
timeout 60 .gpu/final/cuda-stream-pool --driver cuda --repeat 3 --threads 1,16 --strategies floor,pool,pool-tls > $OUT/seed.txt 2>&1; echo "seed $(el) s"
grep -E "^short +pool |^prodcons +pool " $OUT/seed.txt
python3 - $OUT/async-server.jsonl <<'PY'
import json,sys,statistics as st
from collections import defaultdict
d=defaultdict(list)
for l in open(sys.argv[1]):
    try: r=json.loads(l); d[(r['build'],r['mode'])].append(r['run'])
    except Exception: print("bad", l[:150])
for k,v in sorted(d.items()):
    rps=[x['requests_per_s'] for x in v]
    print(k, [round(x/1e3,1) for x in rps], 'med', round(st.median(rps)/1e3,1), 'p99', [round(x['p99_us']/1e3) for x in v], 'enq', [round(x['enqueue_us_mean']) for x in v])
PY
