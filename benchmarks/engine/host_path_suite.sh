#!/usr/bin/env bash
# One device call: the host-path figures of docs/benchmarks.md (offline 135M and 1B shapes, a
# served sweep beside the offline run, the step profile at 16 to 1,024 sequences with overlapped
# steps and with the device idle at each launch, the CUDA-graph launch bench, the staging bench).
#   OUT=/tmp/hp benchmarks/engine/host_path_suite.sh
# Needs the wheels the GPU image lacks on PYTHONPATH (../shared/tools/device-wheels.sh).
set -u
OUT=${OUT:-/tmp/host_path}
export NORI_JAX_CACHE_DIR=${NORI_JAX_CACHE_DIR:-/tmp/nori_xla} PYTHONUNBUFFERED=1
SHAPES="--max-num-seqs 1024 --max-num-batched-tokens 8192"
mkdir -p "$OUT"
here=$(dirname "$0")
quiet() { grep -v "^W1\|^I0000\|INFO"; }
echo "=== offline smollm2-135m, 2000 requests ($(date +%T))"
timeout 200 python3 -m nori_jax.cli bench offline --config h200-throughput $SHAPES \
  --num-prompts 2000 --result-json "$OUT/offline_135m.json" 2>&1 | quiet | tail -22
echo "=== served sweep smollm2-135m, ${N:-1000} requests per rate ($(date +%T))"
OUT="$OUT/serve" N=${N:-1000} RATES=${RATES:-48,96,144} EXTRA="$SHAPES" \
  timeout 330 "$here/serve_sweep.sh" 2>&1 | tail -12
echo "=== offline llama3.2-1b, 1000 requests ($(date +%T))"
timeout 200 python3 -m nori_jax.cli bench offline --config h200-throughput --model llama3.2-1b \
  $SHAPES --num-prompts 1000 --result-json "$OUT/offline_1b.json" 2>&1 | quiet | tail -22
for mode in "" --no-async-scheduling; do  # overlapped steps, then the device idle at each launch
  echo "=== step profile ${mode:-overlapped}, 16-1,024 sequences x context 1024 ($(date +%T))"
  timeout 150 python3 "$here/step_profile.py" --config h200-throughput $SHAPES \
    --num-scheduler-steps 1 --context 1024 --steps 30 --batch 16,64,256,1024 --no-trace $mode \
    --json "$OUT/profile${mode:+_idle}.json" 2>&1 | grep "^batch"
done
echo "=== CUDA-graph launch with moved and fixed buffers ($(date +%T))"
timeout 150 python3 "$here/graph_launch_bench.py" --json "$OUT/graph_launch.json" 2>&1 | quiet | tail -4
echo "=== the step buffer's route onto the device ($(date +%T))"
# (the pinned_host route crashed the runtime under the VMM allocator on 2026-12-04: left out)
timeout 90 python3 "$here/stage_bench.py" --routes device_put,no_transfer \
  --json "$OUT/stage_bench.json" 2>&1 | quiet | tail -6
echo "=== done ($(date +%T))"
