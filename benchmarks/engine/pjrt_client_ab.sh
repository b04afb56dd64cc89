#!/usr/bin/env bash
# One device call: the engine's launch (issue 19's item 2) with XLA's TFRT GPU client
# (XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1, which JAX passes to the CUDA plugin as
# use_tfrt_gpu_client) against the default PjRt client, alternating, and whether both give the same
# greedy tokens. The default client's per-buffer work is most of the forward pass's dispatch
# (docs/benchmarks.md, "The per-buffer cost of a launch"); the TFRT client is XLA's other
# implementation of the same runtime interface.
#   OUT=/tmp/pjrt benchmarks/engine/pjrt_client_ab.sh
# CPU dry run of the script's flow (the variable changes nothing there):
#   CONFIG=tiny-cpu SHAPES= BATCHES=4 CONTEXT=64 PROMPTS=4 MAXLEN=200 ROUNDS=1 \
#     benchmarks/engine/pjrt_client_ab.sh
# Needs the wheels the GPU image lacks on PYTHONPATH (../shared/tools/device-wheels.sh).
set -u
OUT=${OUT:-/tmp/pjrt_client_ab}
CONFIG=${CONFIG:-h200-throughput}
SHAPES=${SHAPES---max-num-seqs 1024 --max-num-batched-tokens 8192}
BATCHES=${BATCHES:-16,64,256,1024}
CONTEXT=${CONTEXT:-1024}
PROMPTS=${PROMPTS:-32}
MAXLEN=${MAXLEN:-1500}
ROUNDS=${ROUNDS:-2}
export NORI_JAX_CACHE_DIR=${NORI_JAX_CACHE_DIR:-/tmp/nori_xla} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
here=$(dirname "$0")
with_client() {  # with_client tfrt|default COMMAND...
  local var=XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT
  # =0, not unset: the engine's gpu_client "auto" takes TFRT on one GPU where the variable is unset
  if [ "$1" = tfrt ]; then shift; env "$var=1" "$@"; else shift; env "$var=0" "$@"; fi
}
for client in default tfrt; do
  echo "=== greedy tokens, $client client ($(date +%T))"
  with_client $client timeout 150 python3 "$here/greedy_tokens.py" --config "$CONFIG" \
    --load-format dummy $SHAPES --num-prompts "$PROMPTS" --max-tokens 16 --max-prompt-len "$MAXLEN" \
    --out "$OUT/greedy_$client.json" 2>&1 | tail -1
done
python3 - "$OUT" <<'PY'
import json, os, sys
paths = [f"{sys.argv[1]}/greedy_{c}.json" for c in ("default", "tfrt")]
missing = [p for p in paths if not os.path.exists(p)]
if missing:
    print(f"greedy tokens: not compared, no output in {missing} (see the run above)")
else:
    a, b = (json.load(open(p)) for p in paths)
    print(f"greedy tokens: {sum(x == y for x, y in zip(a, b))} of {len(a)} prompts identical")
PY
for round in $(seq "$ROUNDS"); do
  for client in tfrt default; do  # alternating: the host drifts within a call
    echo "=== step profile, $client client, round $round ($(date +%T))"
    with_client $client timeout 150 python3 "$here/step_profile.py" --config "$CONFIG" \
      --load-format dummy $SHAPES --num-scheduler-steps 1 --context "$CONTEXT" --steps 30 \
      --batch "$BATCHES" --no-trace --json "$OUT/profile_${client}_$round.json" 2>&1 | grep "^batch"
  done
done
echo "=== done ($(date +%T))"
