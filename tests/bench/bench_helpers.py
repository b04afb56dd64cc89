"""Test helpers: the fake server process, small trained tokenizers, a config builder.

A module of its own (not conftest.py) so test files can import it by a name no other test
directory uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import tokenizers
from tokenizers import processors, trainers

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu the of and to "
    "in is was for on are with as at be by this had not but from or have an they which one you "
    "were her all she there would their we him been has when who will more no if out so said"
).split()


class FakeServer:
    def __init__(self) -> None:
        script = Path(__file__).with_name("bench_fake_server.py")
        path = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, path))}
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        self.base_url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(self.base_url + "/v1/models", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        # A fresh Python server is slow on its first requests (lazy imports, first-call paths);
        # warm both routes so no test measures that.
        for _ in range(3):
            for route, body in (
                ("/v1/completions", {"prompt": "a b", "max_tokens": 4}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
            ):
                httpx.post(self.base_url + route, json=body, timeout=30).raise_for_status()

    def set(self, **behaviour: Any) -> None:
        httpx.post(self.base_url + "/_control", json=behaviour, timeout=10).raise_for_status()

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.base_url + "/_stats", timeout=10).json()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _corpus(n_lines: int = 400) -> list[str]:
    import random

    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(n_lines)]


def save_tokenizer(tok: tokenizers.Tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def train_tokenizer(tok: tokenizers.Tokenizer, vocab_size: int, alphabet: list[str]) -> None:
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet
    )
    tok.train_from_iterator(_corpus(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )


def bench_config(server: FakeServer, workload: dict[str, Any] | None = None, **kw: Any) -> Any:
    """A small BenchConfig against the fake server; `workload` overrides WorkloadConfig fields."""
    from nori_jax.bench.config import BenchConfig
    from nori_jax.bench.workload import WorkloadConfig

    w = {"dataset": "fixed", "num_prompts": 20, "input_len": 32, "output_len": 8}
    base = {"model": "fake-model", "request_timeout_s": 30.0}
    return BenchConfig(server.base_url, WorkloadConfig(**(w | (workload or {}))), **(base | kw))


def run_bench(server: FakeServer, workload: dict[str, Any] | None = None, **kw: Any) -> Any:
    from nori_jax.bench.run import prepare_workload, run_once

    cfg = bench_config(server, workload, **kw)
    return run_once(cfg, prepare_workload(cfg), cfg.workload.request_rate, lambda n: None)
