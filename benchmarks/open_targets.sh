#!/usr/bin/env bash
# The GPU runs the open issues still need, one device call per part (each fits the device's
# 10-minute limit), logs under $OUT. Without PARTS it picks by the GPU it finds: on an H200 the
# 8B pair (only an H200 answers it), on an H100 the prefill runs. docs/benchmarks.md, "Not
# measured yet", says what each answers.
#   OUT=/tmp/open benchmarks/open_targets.sh               # the GPU's default part
#   PARTS="prefill64 floor" OUT=/tmp/open benchmarks/open_targets.sh
#   DRY=1 PARTS=floor benchmarks/open_targets.sh            # CPU: the script's flow only
#   pair8b     issue 22 item 1: Llama-3.1-8B shape, bf16 against fp8 weights + fp8 pages,
#              600 requests, alternated twice (target >= 1.5x on the H200)
#   prefill64  issue 22 item 3: the prefill kernel against cuDNN's flash attention at the
#              engine's 64-token pages, chunks of 512-8,192 tokens, every layout
#   floor      issue 22 item 3: what a Mosaic GPU kernel pays before its work starts
#              (first_copy_probe.py: the fixed 2-2.6 us behind cuDNN on 512-token chunks)
#   client     issue 19 item 2: the launch with XLA's TFRT GPU client against the default one
#              (pjrt_client_ab.sh, one round)
#   fp8decode  issue 22: the decode kernel's device time on fp8 pages against bf16 and the copy
#              rate, at the engine's 64-token pages (the H200 has not run today's kernel)
#   launch     issue 19 item 2: the launch's host work at 16-1,024 sequences with the device idle
#              at each launch (--no-async-scheduling, so no wait on the device is in the launch
#              clock), TFRT against the default client, then TFRT with overlapped steps
#   pil        issue 22 item 3: prefill tiles of one Q box on both compute warpgroups
#              (prefill_interleave, which default_tuning gives the 135M layout's 512-token
#              bucket) against the same buckets without it and cuDNN, chunks of 512-2,048 tokens
#              from position 0 and after a cached prefix, 64-token pages, two rounds in one call
#              (measured on an H100 only)
#   pils       issue 22 item 3: prefill_interleave="per_step" (each call's plan picks
#              interleaved one-box tiles or paired ones with ping-pong) against both static
#              forms and cuDNN, 9q/3kv/64 and 32q/8kv/64, chunks of 512-2,048 tokens from
#              position 0 and after a cached prefix, 64-token pages, two rounds in one call
#              (PILS_ROUNDS; PILS_TUNINGS replaces the list of tunings, which also times
#              paired tiles cut into two KV parts)
#   pilsengine issue 22 item 3: the engine with prefill tiles picked per call in every bucket
#              under 2,048 tokens (--attention-tuning) against its default schedule, the 135M
#              shape's offline workload (2,000 requests), alternated twice in one call;
#              PILSENGINE_RULE replaces the override
#   splitengine issue 22 item 3: the engine with prefill tiles cut in KV parts in the 135M
#              layout's 1,024- and 2,048-token buckets: the default schedule (4 parts at 2,048
#              tokens, none at 1,024) against paired tiles in two parts in both (the candidate
#              RULES row) and against no parts at 2,048 (no merge after the kernel), the 135M
#              shape's offline workload (2,000 requests), alternated twice in one call
#              (SPLITENGINE_ARMS picks among "default ks2 ks1")
#   tfrt       what the TFRT client (gpu_client="auto" on one GPU) has not been run on: served
#              load (4 API servers, 1,000 requests at 128 and 256 req/s, auto against
#              --gpu-client default) and fp8 weights + fp8 pages (greedy tokens, tfrt against
#              the default client)
# Needs the wheels the GPU image lacks on PYTHONPATH (../shared/tools/device-wheels.sh).
set -u
OUT=${OUT:-/tmp/open_targets}
here=$(cd "$(dirname "$0")" && pwd)
export NORI_JAX_CACHE_DIR=${NORI_JAX_CACHE_DIR:-/tmp/nori_xla} PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-$here/..}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [ -z "${PARTS:-}" ]; then
  case $gpu in *H200*) PARTS=pair8b ;; *) PARTS="prefill64 floor" ;; esac
fi
echo "=== $gpu: $PARTS ($(date +%T))"
dry=""; [ -n "${DRY:-}" ] && dry=--dry  # DRY=1: the kernel parts' CPU dry runs (flow only)
quiet() { grep -v "^W1\|^I0000\|INFO"; }
# engine_ab NAME LIMIT_S PROMPTS ARGS...: ab_offline.py's engines (ARGS: its --tree and
# --tree-args) alternating on the 135M shape's offline workload, logs under $OUT/NAME
engine_ab() {
  local name=$1 limit=$2 prompts=$3; shift 3
  timeout "$limit" python3 "$here/engine/ab_offline.py" "$@" --cache-dir /tmp/nori_xla_ab \
    --out "$OUT/$name" -- --config h200-throughput --max-num-seqs 1024 \
    --max-num-batched-tokens 8192 --num-prompts "$prompts" > "$OUT/$name.log" 2>&1
  echo "rc $?"; tail -9 "$OUT/$name.log"
}
for part in $PARTS; do
  echo "=== $part ($(date +%T))"
  case $part in
    pair8b)
      for round in 1 2; do
        for mode in bf16 fp8; do
          flags=""; [ $mode = fp8 ] && flags="--quantization fp8 --kv-cache-dtype fp8"
          log="$OUT/pair8b_${mode}_$round.log"
          timeout ${T_RUN:-140} python3 -m nori_jax.cli bench offline --config h200-throughput \
            --model llama3.1-8b --load-format dummy --max-num-seqs 1024 \
            --max-num-batched-tokens 8192 --num-scheduler-steps 1 --num-prompts 600 $flags \
            --result-json "$OUT/pair8b_${mode}_$round.json" > "$log" 2>&1
          echo "--- $mode, round $round (rc $?)"
          grep -E "engine ready|throughput|Recompiles|Tokens per step|waiting" "$log" | quiet | tail -6
        done
      done ;;
    prefill64)
      timeout ${T_PREFILL:-420} python3 "$here/kernels/attention_bench.py" --out "$OUT" \
        --phase prefill --page-size 64 --cudnn-baseline --device-times $dry \
        > "$OUT/prefill64.log" 2>&1
      echo "rc $?"; sed -n '/^ceilings/,$p' "$OUT/prefill64.log" ;;
    floor)
      timeout ${T_FLOOR:-240} python3 "$here/kernels/first_copy_probe.py" --out "$OUT" $dry \
        > "$OUT/floor.log" 2>&1
      echo "rc $?"; quiet < "$OUT/floor.log" | tail -20 ;;
    pil)
      for round in 1 2; do
        timeout ${T_PIL:-280} python3 "$here/kernels/attention_bench.py" --out "$OUT/pil$round" \
          --phase prefill --page-size 64 --layouts 9q/3kv/64,32q/8kv/64,32q/8kv/128 \
          --chunks 512,1024,2048,512+7680,1024+7168 --device-times --cudnn-baseline $dry \
          --prefill-tunings "defaultxnopilxpp,defaultxpil,128x4x1xpilxwg2xpw4" \
          > "$OUT/pil$round.log" 2>&1
        echo "--- round $round: rc $?"
        python3 "$here/kernels/prefill_rows.py" "$OUT/pil$round.log"
      done
      echo "--- fp8 pages (e4m3), the 512- and 1,024-token buckets with and without it"
      timeout ${T_PILFP8:-240} python3 "$here/kernels/fp8_kv_check.py" --skip-checks --device-times \
        --page-size 64 --alternations 2 --out "$OUT/pilfp8" $dry --decode-list "" \
        --prefill-list "9q/3kv/64,512,0;9q/3kv/64,512,7680;9q/3kv/64,1024,0" \
        --fp8-tunings "defaultxpil" > "$OUT/pilfp8.log" 2>&1
      echo "rc $?"; quiet < "$OUT/pilfp8.log" | grep -v "^{" | tail -12 ;;
    client)
      OUT="$OUT/client" ROUNDS=1 timeout ${T_CLIENT:-500} bash "$here/engine/pjrt_client_ab.sh" ;;
    fp8decode)
      timeout ${T_FP8DEC:-300} python3 "$here/kernels/fp8_kv_check.py" --skip-checks --device-times \
        --page-size 64 --alternations 1 --out "$OUT" $dry --decode-list \
        "9q/3kv/64,256,1024;9q/3kv/64,1024,1024;9q/3kv/64,256,4096;32q/8kv/128,256,1024;32q/8kv/128,1024,1024" \
        > "$OUT/fp8decode.log" 2>&1
      echo "rc $?"; quiet < "$OUT/fp8decode.log" | tail -24 ;;
    launch)
      for arm in "tfrt --no-async-scheduling" "default --no-async-scheduling" "tfrt"; do
        set -- $arm
        echo "--- step profile, gpu client $arm ($(date +%T))"
        timeout ${T_LAUNCH:-150} python3 "$here/engine/step_profile.py" --config h200-throughput \
          --load-format dummy --max-num-seqs 1024 --max-num-batched-tokens 8192 \
          --num-scheduler-steps 1 --context 1024 --steps 30 --batch 16,64,256,1024 --no-trace \
          --gpu-client "$@" --json "$OUT/launch_${1}${2:+_idle}.json" 2>&1 | grep "^batch"
      done ;;
    tfrt)
      for c in auto default; do
        echo "--- served, gpu client $c ($(date +%T))"
        # the sweep's many files stay outside $OUT (the device tool returns a few files a call)
        MODEL=smollm2-135m RATES=128,256 N=1000 OUT="/tmp/serve_$c" \
          EXTRA="--max-num-seqs 1024 --max-num-batched-tokens 8192 --api-server-count 4 --gpu-client $c" \
          timeout ${T_SERVE:-200} bash "$here/engine/serve_sweep.sh" > "$OUT/serve_$c.txt" 2>&1
        echo "rc $?"; grep -E "healthy|Knee|req/s:" "$OUT/serve_$c.txt" | head -6
        cp "/tmp/serve_$c/sweep.json" "$OUT/sweep_$c.json" 2>/dev/null
        grep -h "gpu client" "/tmp/serve_$c/serve.log" | grep -o "gpu client [a-z]*" | head -1
        pkill -f "nori_jax.cli --log-level INFO serve"; sleep 3
      done
      for c in tfrt default; do  # auto keeps fp8 engines on the default client: ask for tfrt
        timeout ${T_FP8:-240} python3 "$here/engine/greedy_tokens.py" --config h200-throughput \
          --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --gpu-client $c \
          --num-prompts 32 --max-tokens 16 --out "$OUT/greedy_fp8_$c.json" > "$OUT/fp8_$c.log" 2>&1
        echo "--- fp8 greedy, gpu client $c: rc $?"
      done
      python3 - "$OUT" <<'PY'
import json, os, sys
a, b = (f"{sys.argv[1]}/greedy_fp8_{c}.json" for c in ("tfrt", "default"))
if os.path.exists(a) and os.path.exists(b):
    x, y = json.load(open(a)), json.load(open(b))
    print(f"fp8 greedy tokens: {sum(p == q for p, q in zip(x, y))} of {len(x)} identical")
else:
    print("fp8 greedy tokens: not compared (a run did not finish)")
PY
      ;;
    pils)
      # paired, interleaved, per call; and paired tiles cut in two KV parts, for the 32q/8kv/64
      # 512-token chunk (128 paired tiles for 132 SMs, 2 us behind cuDNN)
      pils_tunings="defaultxnopilxcw2xks1xpp,defaultxpil,defaultxpilsxpp,defaultxnopilxcw2xks2xpp"
      for round in $(seq ${PILS_ROUNDS:-2}); do
        timeout ${T_PILS:-270} python3 "$here/kernels/attention_bench.py" --out "$OUT/pils$round" \
          --phase prefill --page-size 64 --layouts 9q/3kv/64,32q/8kv/64 \
          --chunks 512,1024,2048,512+7680,1024+7168 --device-times --cudnn-baseline $dry \
          --prefill-tunings "${PILS_TUNINGS:-$pils_tunings}" \
          > "$OUT/pils$round.log" 2>&1
        echo "--- round $round: rc $?"
        python3 "$here/kernels/prefill_rows.py" "$OUT/pils$round.log"
      done ;;
    pilsengine)
      # the candidate RULES row, or PILSENGINE_RULE (an attention_tuning string)
      rule=${PILSENGINE_RULE:-"tokens<2048: prefill_interleave=per_step,pingpong=true"}
      engine_ab pilsengine ${T_PILSENGINE:-560} ${PILSENGINE_PROMPTS:-2000} \
        --tree default="$here/.." --tree pils="$here/.." \
        --tree-args "pils:--attention-tuning '$rule'" \
        --rounds ${PILSENGINE_ROUNDS:-2} --timeout ${T_PILSRUN:-200} ;;
    splitengine)
      # the merge of a cut tile's parts runs after the kernel in every layer of every step of
      # the bucket (partial_merge.py), decode-only steps included: only the engine weighs it
      # (a selector has one bound: the second clause gives buckets of 4,096+ their default back)
      ks2="tokens>=1024: compute_wgs=2,pingpong=true,prefill_kv_splits=2"
      ks2="$ks2; tokens>=4096: compute_wgs=3,pingpong=false,prefill_kv_splits=1"
      arms=()
      for arm in ${SPLITENGINE_ARMS:-default ks2 ks1}; do
        arms+=(--tree "$arm=$here/..")
        case $arm in
          ks2) arms+=(--tree-args "ks2:--attention-tuning '$ks2'") ;;
          ks1) arms+=(--tree-args "ks1:--attention-tuning 'tokens>=2048: prefill_kv_splits=1'") ;;
        esac
      done
      engine_ab splitengine ${T_SPLITENGINE:-550} ${SPLITENGINE_PROMPTS:-2000} "${arms[@]}" \
        --rounds ${SPLITENGINE_ROUNDS:-2} --timeout ${T_SPLITRUN:-170} ;;
    *) echo "unknown part: $part" ;;
  esac
done
echo "=== done ($(date +%T))"
