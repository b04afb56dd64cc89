#!/usr/bin/env bash
# The reliability figures of one H200 (issue 20; docs/benchmarks.md): a soak at the knee rate of
# the SmolLM2-135M shape (48 req/s through the engine-core process), then fault injection on the
# same engine (engine-core SIGKILL under load with its recovery time, a disconnect storm, SIGTERM
# under load). Needs the bench extra (aiohttp, matplotlib): pip install -e '.[bench]'.
#   OUT=/tmp/reliability benchmarks/reliability/h200_suite.sh            # 30-minute soak
#   DURATION=480 OUT=/tmp/reliability benchmarks/reliability/h200_suite.sh  # within a 10-min call
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/reliability}
DURATION=${DURATION:-1800}
RATE=${RATE:-48}
INTERVAL=${INTERVAL:-60}
SERVE=${SERVE:-"--config h200-throughput --model smollm2-135m --load-format dummy --max-num-seqs 1024 --max-num-batched-tokens 8192"}
mkdir -p "$OUT"
python3 benchmarks/reliability/soak.py --rate "$RATE" --duration "$DURATION" --interval "$INTERVAL" \
  --serve "$SERVE" --out "$OUT/soak.json" --plot "$OUT/soak.png" 2>&1 | tee "$OUT/soak.txt"
python3 benchmarks/reliability/fault_injection.py --rate "$RATE" --phase-s 20 --serve "$SERVE" \
  --log "$OUT/fault.server.log" 2>&1 | tee "$OUT/fault.txt"
