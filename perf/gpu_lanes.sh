#!/usr/bin/env bash
# Two gpu_checks.sh lanes at once on a two-GPU machine, to halve the device time of a session:
#   perf/gpu_lanes.sh "STAGES FOR LANE A" "STAGES FOR LANE B"
# Lane A sees both GPUs (its multigpu tests need them) and runs on CPU cores 8 and up;
# lane B sees only the second GPU (as device 0) and runs on cores 0-7, so the two lanes'
# timings do not share a GPU or CPU cores. Both write into ${OUT:-/tmp/gpu-checks}.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/gpu-checks}"; mkdir -p "$out"
ncpu=$(nproc)
( export CUDA_VISIBLE_DEVICES=1 SANITIZE_WORKERS=4 TEST_WORKERS=4
  exec taskset -c 0-7 perf/gpu_checks.sh $2 ) > "$out/lane_b.txt" 2>&1 &
b=$!
taskset -c "8-$((ncpu - 1))" perf/gpu_checks.sh $1 2>&1 | sed 's/^/[A] /'
wait "$b"
sed 's/^/[B] /' "$out/lane_b.txt"; rm -f "$out/lane_b.txt"
