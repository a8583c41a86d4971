#!/usr/bin/env python3
"""Summarises the async server's JSON lines of a GPU call (`{"build", "rep", "mode", "run"}` per
line, `run` being `async_server --json`'s last line): requests/s per repeat, their median, and
the p99 latencies (ms), per (build, mode)."""
import json
import statistics as st
import sys
from collections import defaultdict

d = defaultdict(list)
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
        d[(r["build"], r["mode"])].append(r["run"])
    except Exception:
        print("bad", line[:150])
for k, v in sorted(d.items()):
    rps = [x["requests_per_s"] for x in v]
    print(k, [round(x / 1e3, 1) for x in rps], "med", round(st.median(rps) / 1e3, 1),
          "p99", [round(x["p99_us"] / 1e3) for x in v])
