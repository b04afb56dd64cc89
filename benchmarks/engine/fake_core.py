"""A fake engine-core process: the real process loop (engine_core_process.py), no model, no JAX.

    python benchmarks/engine/fake_core.py INPUT_ADDRS OUTPUT_ADDRS LOG_LEVEL [REPLICA] < config

It runs `engine_core_process`'s own message loop and client routing (several API servers
included) over a fake core: it announces a byte-level tokenizer of the config's model preset,
admits up to `max_num_seqs` requests (the rest wait in order), and every `FAKE_CORE_STEP_MS`
milliseconds (default 5) gives each running request one token, finishing it at its
`max_tokens`. So the API servers in front of it stream at a rate the host alone bounds: what
`api_server_bench.py` measures.
"""

from __future__ import annotations

import collections
import os
import pickle
import sys
import time

import msgspec
import numpy as np
import zmq

from nori_jax.core.engine_core import EngineCoreRequest
from nori_jax.core.outputs import (
    EngineCoreOutputs,
    FinishedRequest,
    FirstToken,
    RequestMetrics,
    StepStats,
)
from nori_jax.dummy_tokenizer import byte_tokenizer
from nori_jax.engine_core_process import EngineInfo, Ready, _Clients, _serve
from nori_jax.model_config import load_preset


class _Running:
    __slots__ = ("request", "generated", "first")

    def __init__(self, request: EngineCoreRequest):
        self.request = request
        self.generated = 0
        self.first: float | None = None


class FakeCore:
    """What `_serve` needs of an EngineCore: one token per running request per tick."""

    def __init__(self, vocab: int, max_seqs: int, step_s: float):
        self.vocab, self.max_seqs, self.step_s = vocab, max_seqs, step_s
        self.waiting: collections.deque[EngineCoreRequest] = collections.deque()
        self.running: dict[str, _Running] = {}
        self.next_step = time.monotonic()
        self.has_in_flight = False

    def add_request(self, r: EngineCoreRequest) -> None:
        self.waiting.append(r)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def abort(self, rid: str, reason: str) -> FinishedRequest | None:
        run = self.running.pop(rid, None)
        if run is None:
            for r in self.waiting:
                if r.request_id == rid:
                    self.waiting.remove(r)
                    return _finished(_Running(r), reason)
            return None
        return _finished(run, reason)

    def drain(self) -> EngineCoreOutputs:
        return EngineCoreOutputs.empty()

    def step(self) -> EngineCoreOutputs:
        delay = self.next_step - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        now = time.monotonic()
        self.next_step = max(self.next_step + self.step_s, now)
        while self.waiting and len(self.running) < self.max_seqs:
            r = self.waiting.popleft()
            self.running[r.request_id] = _Running(r)
        ids, first, finished = list(self.running), [], []
        tokens = np.empty(len(ids), np.int32)
        for i, rid in enumerate(ids):
            run = self.running[rid]
            # Word tokens (`<tN>`, dummy_tokenizer.py): each one decodes to text of its own.
            tokens[i] = 256 + (hash(rid) + run.generated) % (self.vocab - 258)
            run.generated += 1
            if run.first is None:
                run.first = now
                first.append(FirstToken(rid, now - run.request.arrival_time))
            if run.generated >= (run.request.params.max_tokens or 16):
                finished.append(_finished(self.running.pop(rid), "length"))
        stats = StepStats(
            len(self.running), len(self.waiting), 0.0, len(ids), 0, 0, 0, 0, 0.0, self.step_s, 1
        )
        return EngineCoreOutputs(ids, tokens.tobytes(), {}, finished, first, stats)


def _finished(run: _Running, reason: str) -> FinishedRequest:
    r = run.request
    ttft = None if run.first is None else run.first - r.arrival_time
    e2e = time.monotonic() - r.arrival_time
    metrics = RequestMetrics(0.0, 0.0, 0.0, ttft, e2e, 0, 0)
    return FinishedRequest(r.request_id, reason, len(r.prompt_token_ids), run.generated, metrics)


def main() -> None:
    input_addrs, output_addrs = sys.argv[1].split(","), sys.argv[2].split(",")
    config = pickle.load(sys.stdin.buffer)
    step_s = float(os.environ.get("FAKE_CORE_STEP_MS", "5")) / 1e3
    vocab = int(load_preset(config.model or "tiny-llama")["vocab_size"])
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    for addr in input_addrs:
        inputs.connect(addr)
    clients = _Clients(ctx, output_addrs)
    encode = msgspec.msgpack.Encoder().encode
    max_len = config.scheduler.max_model_len
    tok = byte_tokenizer(vocab).to_state()
    info = EngineInfo("fake-core", max_len, vocab, [], tok, 0.0, 0.0, {}, os.getpid())
    ready = encode(Ready(info))
    clients.send_all(ready)
    _serve(FakeCore(vocab, config.scheduler.max_num_seqs, step_s), inputs, clients, encode, ready)


if __name__ == "__main__":
    main()
