#!/usr/bin/env bash
# One device call: the served sweep with one API server against several (--api-server-count),
# same engine shapes and workload, each sweep sampling the CPU of every process and thread (which
# one saturates), then the engine's own skip_temp pool sizing (issue 19's open checks).
#   OUT=/tmp/as COUNTS="1 4" RATES=48,96,144 N=1000 benchmarks/engine/api_servers_suite.sh
# Needs the bench extra and the wheels the GPU image lacks (../shared/tools/device-wheels.sh
# qwix==0.1.8 msgspec pyzmq httptools) on PYTHONPATH.
set -u
OUT=${OUT:-/tmp/api_servers}
export NORI_JAX_CACHE_DIR=${NORI_JAX_CACHE_DIR:-/tmp/nori_xla} PYTHONUNBUFFERED=1
SHAPES="--max-num-seqs 1024 --max-num-batched-tokens 8192"
here=$(dirname "$0")
mkdir -p "$OUT"
for count in ${COUNTS:-1 4}; do
  echo "=== served sweep, --api-server-count $count ($(date +%T))"
  OUT="$OUT/serve_$count" N=${N:-1000} RATES=${RATES:-48,96,144} \
    EXTRA="$SHAPES --api-server-count $count" timeout ${T_SWEEP:-270} "$here/serve_sweep.sh" \
    2>&1 | tail -14
done
echo "=== offline, --command-buffer-update skip_temp, the engine's own pool ($(date +%T))"
timeout ${T_OFFLINE:-150} python3 -m nori_jax.cli bench offline --config h200-throughput $SHAPES \
  --num-prompts 2000 --command-buffer-update skip_temp --result-json "$OUT/offline_skip.json" \
  > "$OUT/offline_skip.log" 2>&1
grep -E "KV pages of|Total token|Steps|Time: launch|Time: wait" "$OUT/offline_skip.log" | \
  sed 's/.*engine ready/engine ready/' | cut -c1-160
echo "=== done ($(date +%T))"
