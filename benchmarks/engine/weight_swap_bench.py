"""What an RL loop's weight traffic costs the engine: new weights in, sleep and wake-up.

    python benchmarks/engine/weight_swap_bench.py --config h200-throughput --model llama3.1-8b \
        --load-format dummy [--rounds 2] [--json F]

Takes the engine's own weights under their Hugging Face names (`LLM.get_weights`), then times,
each `--rounds` times: `update_weights` with them (checked on the host, placed one tensor at a
time), `sleep()` and `wake_up()` (weights to pinned host memory and back, KV pages freed and made
again), `sleep(level=2)` and `wake_up(weights)` (weights dropped, then placed anew), each
followed by a short greedy batch whose tokens must equal the first one's (the same weights
throughout) and no recompile. The engine's own log lines say how an update's time splits between
checking and laying out the tensors on the host and placing them. On a CPU the times say nothing
of a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from nori_jax import LLM, SamplingParams
from nori_jax.engine_args import add_engine_args, engine_config_from_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("nori_jax.weight_control").setLevel(logging.INFO)  # the update's split
    llm = LLM.from_config(engine_config_from_args(args))
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(64)] for i in range(8)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def tokens() -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, greedy)]

    reference = tokens()
    start = time.perf_counter()
    weights = llm.get_weights()
    rows = [("get_weights", time.perf_counter() - start, None)]
    steps = {
        "update_weights": lambda: llm.update_weights(weights),
        "sleep": llm.sleep,
        "wake_up": llm.wake_up,
        "sleep(level=2)": lambda: llm.sleep(level=2),
        "wake_up(weights)": lambda: llm.wake_up(weights),
    }
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
            same = None if llm.engine.is_sleeping else tokens() == reference
            rows.append((name, seconds, same))
    gib = sum(a.nbytes for a in weights.values()) / 2**30
    print(f"weights: {len(weights)} tensors, {gib:.2f} GiB on the host")
    print(f"{'what':<20}{'seconds':>10}  tokens as before")
    for name, seconds, same in rows:
        print(f"{name:<20}{seconds:>10.3f}  {'' if same is None else same}")
    print(f"recompiles: {llm.engine.num_recompiles}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "weights_gib": gib,
                    "rows": [{"what": n, "seconds": s, "same_tokens": t} for n, s, t in rows],
                    "recompiles": llm.engine.num_recompiles,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
