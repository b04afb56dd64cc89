#!/usr/bin/env bash
# The planner against the H200 (issue 26's validation): calibrate the SmolLM2-135M and
# Llama-3.2-1B shapes, measure offline runs and served sweeps of the same workload, and print
# predicted against measured (docs/planning.md, "How close it is"). The host drifts 15-30%
# between device calls, so a shape's calibration and its sweep belong in the same call:
#   PARTS="calibrate135 sweep135" OUT=/tmp/plan benchmarks/plan/h200_plan_suite.sh  # ~5 minutes
#   PARTS="calibrate1b sweep1b" OUT=/tmp/plan benchmarks/plan/h200_plan_suite.sh    # ~7 minutes (6 rates; estimated from 4 in N2)
#   PARTS=compare OUT=/tmp/plan benchmarks/plan/h200_plan_suite.sh     # CPU is enough
# (`calibrate` does both shapes; `offline` runs each shape's offline workload beside its
# simulation; `apiservers` measures the API servers' CPU per streamed token with a fake core.)
# compare passes the measured path outside the engine at the lowest rate (client mean TTFT less
# the engine's, from /metrics) as --frontend-latency-ms, and with `apiservers` run before, the
# API servers' cost per token as --frontend-us-per-token and per request as
# --frontend-ms-per-request (taken out of the fixed latency, which holds it at the lowest rate). The mixed-step device term: the
# calibration's own where `plan calibrate` fitted it (its mixed profiles); with `offline` run
# before, fit_mixed_kv.py fits it to that run too and prints that beside the calibrated one (the
# cross-check), or, for a calibration without a calibrated term, uses the offline fit.
# Then copy $OUT/calibration/*_tp1.yaml to configs/calibration/ (not the *_mixed.yaml of compare).
# Needs the bench extra, and the wheels the GPU image lacks on PYTHONPATH.
set -u
OUT=${OUT:-/tmp/plan}
export NORI_JAX_CACHE_DIR=${NORI_JAX_CACHE_DIR:-/tmp/nori_xla} PYTHONUNBUFFERED=1
# One step per launch: the preset runs multi-step decode, which the planner only composes from
# single steps when asked (`--num-scheduler-steps`, not validated) and calibrate never profiles;
# the offline run's step count must be its replay's for fit_mixed_kv.py.
SHAPES="--max-num-seqs 1024 --max-num-batched-tokens 8192 --num-scheduler-steps 1"
# Four API servers: one saturates near 128 req/s on the 135M shape, a cost the planner does not
# model (docs/benchmarks.md, "Served: sweep and knee").
SERVE="--api-server-count ${API_SERVERS:-4}"
# Rates that bracket each shape's knee on the H200 (docs/benchmarks.md), enough requests per
# rate for a steady state (fewer, and the longest outputs decoding alone bound the run).
RATES_135M=${RATES_135M:-144,192,256,320}
RATES_1B=${RATES_1B:-48,72,96,128,160,192}
N=${N:-5000}
N_1B=${N_1B:-3000}
here=$(dirname "$0")
quiet() { grep -v "^W1\|^I0000\|INFO"; }
mkdir -p "$OUT/calibration"
cal() { echo "$OUT/calibration/$1_bfloat16_kv-bfloat16_nvidia-h200_tp1.yaml"; }
for part in ${PARTS:-calibrate offline sweep135 sweep1b compare}; do
  echo "=== $part ($(date +%T))"
  case $part in
  calibrate|calibrate135|calibrate1b)
    models="smollm2-135m llama3.2-1b"
    [ "$part" = calibrate135 ] && models=smollm2-135m
    [ "$part" = calibrate1b ] && models=llama3.2-1b
    for m in $models; do
      timeout 280 python3 -m nori_jax.cli --log-level WARNING plan calibrate \
        --config h200-throughput --model "$m" $SHAPES --out "$OUT/calibration/" 2>&1 | quiet
    done ;;
  offline)
    # The benchmark workload: 2,000 requests (OFFLINE_MODELS picks the shapes).
    for m in ${OFFLINE_MODELS:-smollm2-135m llama3.2-1b}; do
      n=${N_OFFLINE:-2000}
      timeout 200 python3 -m nori_jax.cli bench offline --config h200-throughput --model "$m" \
        $SHAPES --num-prompts "$n" --result-json "$OUT/offline_$m.json" 2>&1 | quiet | \
        grep -E "Total token|Steps|p50 / p99"
      python3 -m nori_jax.cli plan simulate --calibration "$(cal "$m")" --num-prompts "$n" \
        --request-rate inf 2>&1 | grep -E "Total token|Median|P99 T|Simulated: steps"
    done ;;
  apiservers)
    # The API server processes alone (a fake engine core): CPU microseconds per streamed token.
    timeout 120 python3 "$here/../engine/api_server_bench.py" --runs 2 --json "$OUT/api_servers.json" \
      -- $SERVE 2>&1 | tail -4
    # And per request (the workload's mean prompt, one output token): what a request costs its server.
    timeout 80 python3 "$here/../engine/api_server_bench.py" --runs 2 --num-prompts 2000 \
      --output-len 1 --input-len 680 --json "$OUT/api_requests.json" -- $SERVE --max-model-len 2048 \
      2>&1 | tail -4 ;;
  sweep135)
    # The printed report is kept beside the JSON: the JSON of 1,000 requests a rate (per-request
    # arrays) is ~30 MB, more than a device call returns; report_to_sweep.py rebuilds its summary.
    OUT="$OUT/serve_smollm2-135m" MODEL=smollm2-135m RATES=$RATES_135M N=$N EXTRA="$SHAPES $SERVE" \
      timeout 560 "$here/../engine/serve_sweep.sh" 2>&1 | tee "$OUT/serve_smollm2-135m.log" | tail -12 ;;
  sweep1b)
    OUT="$OUT/serve_llama3.2-1b" MODEL=llama3.2-1b RATES=$RATES_1B N=$N_1B EXTRA="$SHAPES $SERVE" \
      timeout 560 "$here/../engine/serve_sweep.sh" 2>&1 | tee "$OUT/serve_llama3.2-1b.log" | tail -12 ;;
  compare)
    for m in smollm2-135m llama3.2-1b; do
      measured="$OUT/serve_$m/sweep.json"
      if [ ! -f "$measured" ] && [ -f "$OUT/serve_$m.log" ]; then
        measured="$OUT/serve_$m.summary.json"
        python3 "$here/report_to_sweep.py" "$OUT/serve_$m.log" > "$measured" || continue
      fi
      [ -f "$measured" ] || { echo "no measured sweep of $m"; continue; }
      n=$([ "$m" = smollm2-135m ] && echo "$N" || echo "$N_1B")
      latency=$(python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['runs'][0]; \
print(max(0.0, r['mean_ttft_ms'] - (r.get('server_mean_ttft_ms') or r['mean_ttft_ms'])))" "$measured")
      per_token=0
      if [ -f "$OUT/api_servers.json" ]; then  # the median run's
        per_token=$(python3 -c "import json, statistics, sys; \
print(statistics.median(r['api_server_us_per_token'] for r in json.load(open(sys.argv[1]))))" \
          "$OUT/api_servers.json")
      fi
      per_request=0
      if [ -f "$OUT/api_requests.json" ]; then  # its share of the fixed latency is taken out
        per_request=$(python3 -c "import json, statistics, sys; \
print(statistics.median(r['api_server_us_per_request'] for r in json.load(open(sys.argv[1]))) / 1e3)" \
          "$OUT/api_requests.json")
        latency=$(python3 -c "import sys; print(max(0.0, float(sys.argv[1]) - float(sys.argv[2])))" \
          "$latency" "$per_request")
      fi
      echo "$m: --frontend-latency-ms $latency --frontend-us-per-token $per_token" \
        "--frontend-ms-per-request $per_request"
      calibration=$(cal "$m")
      python3 -c "import sys; from nori_jax.plan.calibration import load_calibration as l; \
from nori_jax.plan.offline_fit import calibrated_mixed_kv as c; v = c(l(sys.argv[1])); \
print(f'{sys.argv[2]}: mixed-step term ' + ('not calibrated' if v is None else f'{v:.3g} s per KV token, calibrated'))" \
        "$calibration" "$m"
      if [ -f "$OUT/offline_$m.json" ]; then  # the offline fit: the cross-check, or the term
        calibration="$OUT/calibration/${m}_mixed.yaml"
        python3 "$here/fit_mixed_kv.py" "$(cal "$m")" "$OUT/offline_$m.json" \
          --out "$calibration" 2>&1 | grep -v "^W1\|^I0000" || continue
      fi
      python3 -m nori_jax.cli plan sweep --calibration "$calibration" --num-prompts "$n" \
        --frontend-servers "${API_SERVERS:-4}" --frontend-latency-ms "$latency" \
        --frontend-us-per-token "$per_token" --frontend-ms-per-request "$per_request" \
        --measured "$measured" --plot "$OUT/plan_vs_measured_$m.png" \
        --result-json "$OUT/plan_vs_measured_$m.json" 2>&1 | tail -14
    done ;;
  *) echo "unknown part $part" ;;
  esac
done
echo "=== done ($(date +%T))"
