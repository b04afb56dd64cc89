#!/usr/bin/env bash
# One device call's worth of attention-kernel measurements, each part bounded in time, logs in $OUT.
#   PARTS="smoke grid prefill" OUT=/tmp/k benchmarks/kernels/gpu_suite.sh
#   smoke    mixed-step correctness on the GPU + the headline decode case with tuning variants
#   ncu      Nsight Compute sections of one headline decode call (opt-in: on 2026-11-29 it stalled
#            at 0% and, killed by its limit, left the GPU unusable for the rest of the call)
#   grid     decode: batch 1/32/256/512 x ctx 512/2048/8192 for LAYOUTS, ours and JAX's kernel
#   prefill  chunks of 512 to 8192 tokens, default tuning and explicit KV-block variants
#   wgs      decode: the default tuning against the same on one compute warpgroup (decode_wgs=1)
#   pingpong prefill: the default tuning (ping-pong) against it without, and KV-block variants
# Time limits per part: T_SMOKE, T_NCU, T_GRID, T_PREFILL, T_WGS, T_PP (seconds).
set -u
OUT=${OUT:-/tmp/kernel_suite}
PARTS=${PARTS:-"smoke grid prefill"}
LAYOUTS=${LAYOUTS:-"32q/8kv/128,32q/8kv/64,9q/3kv/64"}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
bench="python3 $(dirname "$0")/attention_bench.py --out $OUT"
for part in $PARTS; do
  echo "=== $part ($(date +%T))"
  case $part in
    smoke)   timeout ${T_SMOKE:-200} $bench --phase smoke > "$OUT/smoke.log" 2>&1; tail -12 "$OUT/smoke.log" ;;
    ncu)     timeout ${T_NCU:-150} ncu --clock-control none --kernel-name regex:'mosaic|attention' \
               --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
               --section WarpStateStats --section SchedulerStats --section Occupancy \
               --section LaunchStats $bench --phase decode --decode-list "32q/8kv/128,256,1024" \
               --no-jax-baseline --reps 1 --trials 1 > "$OUT/ncu.txt" 2>&1
             grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Stall|Warp Cycles|Eligible|Issued Warp|==PROF==|==ERROR==" "$OUT/ncu.txt" | head -40 ;;
    grid)    timeout ${T_GRID:-420} $bench --phase decode --layouts "$LAYOUTS" > "$OUT/grid.log" 2>&1
             grep -c '"kind": "decode"' "$OUT/grid.log"; sed -n '/^ceilings/,$p' "$OUT/grid.log" ;;
    wgs)     cases=$(for b in 32 256 512; do for c in 512 1024 2048 8192; do printf '32q/8kv/128,%s,%s;' $b $c; done; done
                     for l in 32q/8kv/64 9q/3kv/64; do for b in 256 512; do for c in 1024 2048; do printf '%s,%s,%s;' $l $b $c; done; done; done)
             timeout ${T_WGS:-240} $bench --phase decode --no-jax-baseline --trials 7 \
               --decode-list "${cases%;}" --decode-tunings defaultxwg1 > "$OUT/wgs.log" 2>&1
             sed -n '/^ceilings/,$p' "$OUT/wgs.log" ;;
    pingpong) timeout ${T_PP:-240} $bench --phase prefill --layouts "$LAYOUTS" --chunks 2048,8192,2048+6144 \
               --prefill-tunings defaultxnopp,64x3x1xpp,128x2x1xpp > "$OUT/pingpong.log" 2>&1
             sed -n '/^ceilings/,$p' "$OUT/pingpong.log" ;;
    prefill) timeout ${T_PREFILL:-200} $bench --phase prefill --layouts "$LAYOUTS" --chunks 512,2048,8192,2048+6144 \
               --prefill-variants > "$OUT/prefill.log" 2>&1
             sed -n '/^ceilings/,$p' "$OUT/prefill.log" ;;
  esac
done
echo "=== done ($(date +%T))"
