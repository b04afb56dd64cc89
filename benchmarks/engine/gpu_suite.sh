#!/usr/bin/env bash
# One device call's worth of engine benchmarks, each part bounded in time, logs under $OUT.
#   PARTS="offline llama profile scheduling serve hf" benchmarks/engine/gpu_suite.sh
# e.g. nori-jax against transformers on equal terms, one call:
#   PARTS="offline hf" OFFLINE_N=64 HF_N=64 OFFLINE_ONLY=smollm2-135m/pallas benchmarks/engine/gpu_suite.sh
# Needs the wheels the GPU image lacks (fastapi, uvicorn, gguf ...) on PYTHONPATH; see
# ../shared/tools/device-wheels.sh.
set -u
OUT=${OUT:-/tmp/gpu_suite}
PARTS=${PARTS:-"offline scheduling serve hf"}
export NORI_JAX_CACHE_DIR=${NORI_JAX_CACHE_DIR:-/tmp/nori_xla}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
here=$(dirname "$0")
for part in $PARTS; do
  echo "=== $part ($(date +%T))"
  case $part in
    offline)    timeout 330 python3 "$here/offline_suite.py" pallas-smollm2 --out "$OUT" --timeout 200 \
                  ${OFFLINE_N:+--num-prompts "$OFFLINE_N"} ${OFFLINE_ONLY:+--only "$OFFLINE_ONLY"} ;;
    llama)      timeout ${T_LLAMA:-330} python3 "$here/offline_suite.py" pallas-llama --out "$OUT" --timeout 200 \
                  ${LLAMA_N:+--num-prompts "$LLAMA_N"} ;;
    profile)    # the step as XLA launches it by default, then with CUDA graphs asked for everywhere
                for variant in default cmdbuf; do
                  flags=""
                  [ $variant = cmdbuf ] && flags="${CMDBUF_FLAGS:---xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1}"
                  echo "--- $variant ${flags}"
                  # XLA reads a non-flag XLA_FLAGS value (even " ") as a file name: set it only when needed
                  env ${flags:+XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flags"} timeout 200 python3 "$here/step_profile.py" \
                    --config h200-throughput --model smollm2-135m --load-format dummy \
                    --attention-backend pallas --batch 128 --context 1024 --steps 30 \
                    --json "$OUT/step_profile_$variant.json" 2>&1 | grep -v "^WARNING\|^I0000" | tail -16
                done ;;
    scheduling) timeout ${T_SCHED:-330} python3 "$here/offline_suite.py" scheduling --out "$OUT" --timeout 90 \
                  ${SCHED_RATE:+--rate "$SCHED_RATE"} \
                  ${SCHED_ONLY:+--only "$SCHED_ONLY"} ;;
    serve)      OUT="$OUT/serve" N=${SERVE_N:-100} RATES=${RATES:-4,8,16,32} timeout 300 "$here/serve_sweep.sh" 2>&1 | tail -25 ;;
    hf)         timeout 200 python3 "$here/hf_continuous_batching.py" --model smollm2-135m \
                  --num-prompts ${HF_N:-64} --result-json "$OUT/hf_smollm2.json" 2>&1 | tail -2 ;;
  esac
done
echo "=== done ($(date +%T))"
