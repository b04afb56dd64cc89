"""An RL loop's side of the engine: rollouts, then the trainer's new weights, with the GPU lent
to the trainer in between (docs/models.md, "New weights without a restart").

    python examples/rl_weight_sync.py                                  # the embedded SmolLM2
    python examples/rl_weight_sync.py --model tiny-llama --load-format dummy --steps 2

Each step samples `--n` completions of each prompt, scores them, puts the engine to sleep
(level 2: its weights dropped, KV pages freed), runs the trainer, and wakes the engine with the
trainer's weights. The trainer here is a stand-in: it nudges the weights at random, so the
rewards say nothing; put your own update where `train` is. `get_weights` gives the trainer its
start, under Hugging Face names; `wake_up` (or `update_weights`, without sleeping) takes the same
names back. Over HTTP, `nori-jax serve --enable-weight-control` offers the same calls with
weights from a directory (docs/serving.md).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from nori_jax import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Two plus two equals", "The color of the sky is"]


def reward(text: str) -> float:
    """A stand-in reward: shorter answers score higher."""
    return -float(len(text.split()))


def train(weights: dict[str, np.ndarray], rewards: list[float], step: int, lr: float):
    """A stand-in trainer step: every weight nudged at random (seeded by the step). Yours takes
    the rollouts and their rewards and returns the policy's new weights, same names and shapes."""
    rng = np.random.default_rng(step)
    return {
        name: (w.astype(np.float32) + lr * rng.standard_normal(w.shape)).astype(w.dtype)
        for name, w in weights.items()
    }


def main(argv: list[str] | None = None) -> list[list[list[int]]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model preset or path (default: embedded)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--n", type=int, default=4, help="samples of each prompt per step")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args(argv)

    llm = LLM(args.model, load_format=args.load_format, max_num_seqs=64)
    weights = llm.get_weights()  # the trainer starts from the engine's model
    tokens_per_step = []
    for step in range(args.steps):
        params = SamplingParams(
            n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=step, ignore_eos=True
        )
        outs = llm.generate(PROMPTS, params)
        rewards = [reward(o.text) for o in outs]
        tokens_per_step.append([o.token_ids for o in outs])
        llm.sleep(level=2)  # the trainer has the device: KV pages freed, weights dropped
        start = time.perf_counter()
        weights = train(weights, rewards, step, args.lr)
        trained = time.perf_counter() - start
        llm.wake_up(weights)  # the new policy, placed straight on the device
        print(
            f"step {step}: {len(outs)} rollouts, mean reward {np.mean(rewards):.2f}, "
            f"trainer {trained:.2f}s, recompiles {llm.engine.num_recompiles}"
        )
    return tokens_per_step


if __name__ == "__main__":
    main()
