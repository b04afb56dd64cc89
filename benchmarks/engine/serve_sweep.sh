#!/usr/bin/env bash
# Serve a random-weight preset and sweep the offered load with `nori-jax bench serve`.
#   MODEL=smollm2-135m RATES=4,8,16,32,64 N=150 OUT=/tmp/sweep benchmarks/engine/serve_sweep.sh
# On a CPU (about a minute): MODEL=tiny-llama CONFIG=tiny-cpu RATES=4,8 N=32 \
#   BENCH_EXTRA="--dataset fixed --input-len 64 --output-len 32" benchmarks/engine/serve_sweep.sh
# Prompts are token ids drawn from the server's own (byte-level dummy) vocabulary, which the bench
# rebuilds from the preset its /v1/models card names, so every request carries exactly the drawn
# number of input tokens. Needs the bench extra: pip install -e '.[bench]'.
set -u
MODEL=${MODEL:-smollm2-135m}
CONFIG=${CONFIG:-h200-throughput}
BACKEND=${BACKEND:-auto}
RATES=${RATES:-4,8,16,32,64}
N=${N:-150}
PORT=${PORT:-8123}
OUT=${OUT:-/tmp/serve_sweep}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
python3 -m nori_jax.cli --log-level INFO serve --config "$CONFIG" --model "$MODEL" --load-format dummy \
  --attention-backend "$BACKEND" --port "$PORT" --no-access-log $EXTRA > "$OUT/serve.log" 2>&1 &
PID=$!
for _ in $(seq 900); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $PID 2> /dev/null || { echo "server died"; tail -30 "$OUT/serve.log"; exit 1; }
  sleep 1
done
echo "server healthy after ${SECONDS}s"
# CPU per process and thread (API servers, engine core) during the sweep: which one saturates.
python3 "$(dirname "$0")/proc_cpu.py" $PID "$OUT/cpu.csv" &
python3 -m nori_jax.bench serve --base-url "http://127.0.0.1:$PORT" --prompt-format token-ids \
  --ignore-eos --num-prompts "$N" --warmup-requests 8 --sweep "$RATES" \
  --plot "$OUT/sweep.png" --result-json "$OUT/sweep.json" --result-csv "$OUT/requests.csv" \
  --disable-tqdm ${BENCH_EXTRA:-} 2>&1 | tee "$OUT/bench.log"
python3 - "$OUT/sweep.json" <<'PY'  # is the client keeping up? (docs/bench.md, client health)
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"{r['request_rate']:>6} req/s: {r['client_processes']} client processes, busiest "
          f"{r['client_cpu_util_max']:.0%} CPU, loop lag P99 {r['client_loop_lag_p99_ms']:.1f} ms, "
          f"send lag P99 {r['client_send_lag_p99_ms']:.1f} ms")
PY
curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics.txt"
python3 "$(dirname "$0")/proc_cpu.py" summarize "$OUT/cpu.csv"
kill -TERM $PID
wait $PID
