#!/usr/bin/env bash
# One device call: the weight-quantization figures of docs/benchmarks.md. The fp8 / int8 / int4
# matmuls against bf16 on Llama-3.1-8B shapes (with what XLA lowered each to), then the offline
# benchmark workload (docs/benchmarks.md, Conventions) on the Llama-3.1-8B shape (random weights) in each weight mode, in the order
# given (alternate them for an A/B: MODES="none fp8 none fp8").
#   OUT=/tmp/quant benchmarks/engine/quant_suite.sh
#   PARTS=matmul TOKENS=16,256 MATMUL_SHAPES="gate/up 4096x14336" benchmarks/engine/quant_suite.sh
# Needs the wheels the GPU image lacks on PYTHONPATH (../shared/tools/device-wheels.sh) and qwix.
set -u
OUT=${OUT:-/tmp/quant}
PARTS=${PARTS:-"matmul offline"}
MODES=${MODES:-"none fp8 int4 int8"}
N=${N:-1000}
export NORI_JAX_CACHE_DIR=${NORI_JAX_CACHE_DIR:-/tmp/nori_xla} PYTHONUNBUFFERED=1
SHAPES="--max-num-seqs 1024 --max-num-batched-tokens 8192"
ALL_SHAPES="qkv-q 4096x4096,kv 4096x1024,gate/up 4096x14336,down 14336x4096"
mkdir -p "$OUT"
here=$(dirname "$0")
quiet() { grep -v "^W1\|^I0000\|INFO"; }
for part in $PARTS; do
  case $part in
    matmul)
      echo "=== matmuls, Llama-3.1-8B shapes ($(date +%T))"
      timeout ${T_MATMUL:-300} python3 "$here/../kernels/quant_matmul_bench.py" \
        --tokens "${TOKENS:-16,256,1024,4096}" --shapes "${MATMUL_SHAPES:-$ALL_SHAPES}" \
        --json "$OUT/matmul.json" 2>&1 | quiet | grep -E " T= *[0-9]+ |^device" ;;  # row by row:
      # a run stopped by its timeout still shows what it measured (2026-12-03: none of the
      # table, 110 s for two token counts)
    offline)
      for mode in $MODES; do
        flag=""; [ "$mode" != none ] && flag="--quantization $mode"
        echo "=== offline llama3.1-8b, weights ${mode/none/bf16}, $N requests ($(date +%T))"
        timeout ${T_OFFLINE:-200} python3 -m nori_jax.cli bench offline --config h200-throughput \
          --model llama3.1-8b $SHAPES $flag --num-prompts "$N" \
          --result-json "$OUT/offline_8b_$mode.json" > "$OUT/offline_8b_$mode.log" 2>&1
        grep -o "engine ready.*KV pages of [0-9]* tokens" "$OUT/offline_8b_$mode.log"
        grep -E "throughput|Recompiles|Preemptions|Tokens per step|Start-up|p50|Error|error" \
          "$OUT/offline_8b_$mode.log" | grep -v "^W1\|^I0000" | tail -12
      done ;;
  esac
done
echo "=== done ($(date +%T))"
