#!/usr/bin/env bash
# GPU call X (2026-12-07, twelfth session): the GPU test suite (hooks) on the session's final
# code, ${LABEL:-ea997964}, then the async server (10,000 requests, 16 workers) of that build
# against the eleventh session's (8353f45d, `async_server_old`), interleaved, ROUNDS repeats
# (default 5), with the blocking designs of the new build as the issue's baseline: does the
# waker's new holder (TaskWaker, one clone per poll before the scope) cost the async path?
#   scripts/gpu-bundle.sh --no-hooks --features cudarc,kernels --example async_server --bin cuda-stream-pool
#   (then in .gpu: tar cJf tests.tar.xz tests; rm -rf tests)
# and the old example from a worktree at 8353f45d, "model-hooks" dropped from its dev-dependency:
#   cargo build --release --features cudarc,kernels --example async_server (stripped, copied to
#   .gpu/bin/async_server_old).
cd "$(dirname "$0")/../.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
exec > >(tee -a "$OUT/x.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
tar xJf .gpu/tests.tar.xz -C .gpu && echo "unpacked $(el) s"
timeout 240 bash .gpu/run-tests.sh > $OUT/gpu-tests.txt 2>&1; echo "tests rc=$? $(el) s"; tail -1 $OUT/gpu-tests.txt
grep -E "FAILED|panicked|would run under" $OUT/gpu-tests.txt | head -20
b=.gpu/bin
for r in $(seq ${ROUNDS:-5}); do for m in new:async:64 old:async:64 new:blocking:0 new:shared:0; do
  IFS=: read build mode cap <<< "$m"
  bin=$b/async_server; [ "$build" = old ] && bin=$b/async_server_old
  echo "{\"build\":\"$build\",\"rep\":$r,\"mode\":\"$mode\",\"run\":$(timeout 20 $bin --n 10000 --workers 16 --mode $mode --cap $cap --json 2>&1 | tail -1)}"
done; done; echo "async $(el) s"
