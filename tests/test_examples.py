"""examples/rl_weight_sync.py runs as documented, and after each step the engine samples from
the trainer's weights: its second step's rollouts are those of an engine given those weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from nori_jax import LLM, SamplingParams

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rl_weight_sync_serves_the_trainers_weights():
    rl = _load("rl_weight_sync")
    args = ["--model", "tiny-llama", "--load-format", "dummy", "--steps", "2", "--n", "2"]
    got = rl.main([*args, "--max-tokens", "6", "--lr", "0.5"])
    llm = LLM("tiny-llama", load_format="dummy", max_num_seqs=64)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1, ignore_eos=True)
    before = [o.token_ids for o in llm.generate(rl.PROMPTS, params)]
    llm.update_weights(rl.train(llm.get_weights(), [], 0, 0.5))
    after = [o.token_ids for o in llm.generate(rl.PROMPTS, params)]
    assert after != before  # the trainer's step changes what is sampled
    assert got[1] == after
