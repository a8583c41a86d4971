#!/usr/bin/env bash
# GPU call F: which change moved async cap 64 between 1716149 and the final build: the crate's
# two numberings (final-nobind: the final crate with 1716149's example) or the example's context
# binding (final). User builds, interleaved.
cd "$(dirname "$0")/.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for r in 1 2 3 4 5 6; do for m in async:64 blocking:0 shared:0; do for b in c-final final-nobind final; do
  echo "{\"build\":\"$b\",\"rep\":$r,\"mode\":\"$m\",\"run\":$(timeout 20 .gpu/$b/async_server --n 10000 --workers 16 --mode ${m%:*} --cap ${m#*:} --json 2>&1 | tail -1)}" >> $OUT/async-server.jsonl
done; done; [ $(el) -gt 300 ] && break; done; echo "async $(el) s"
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
