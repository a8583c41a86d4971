#!/usr/bin/env bash
# GPU call V (2026-12-07, twelfth session): the GPU test suite (hooks) on review 26's fixes
# (TaskWaker, the re-armed wake-up, CudarcUse refusing another stream), built with
#   scripts/gpu-bundle.sh --features cudarc,kernels --bin cuda-stream-pool   (the demo: its CLI tests run it; then in .gpu: tar cJf tests.tar.xz tests; rm -rf tests)
cd "$(dirname "$0")/../.."
start=$(date +%s); el() { echo $(( $(date +%s)-start )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
tar xJf .gpu/tests.tar.xz -C .gpu && echo "unpacked $(el) s"
timeout 240 bash .gpu/run-tests.sh > $OUT/gpu-tests.txt 2>&1; echo "tests rc=$? $(el) s"; tail -1 $OUT/gpu-tests.txt
grep -E "FAILED|panicked|failed;|would run under" $OUT/gpu-tests.txt | grep -v " 0 failed" | head -20
grep -E "a_cudarc_use_refuses_another_stream|cudarc_launch_on_another_owners_stream_is_a_use|event_tracking_off" $OUT/gpu-tests.txt
