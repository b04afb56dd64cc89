"""A fake engine-core process: the real protocol (engine_core_process.py), no model, no JAX.

    python benchmarks/engine/fake_core.py INPUT_ADDR OUTPUT_ADDR LOG_LEVEL [REPLICA] < config.pickle

It announces a byte-level tokenizer of the config's model preset, admits up to `max_num_seqs`
requests (the rest wait in order), and every `FAKE_CORE_STEP_MS` milliseconds (default 5) gives
each running request one token, finishing it at its `max_tokens`. So the API server in front of it
streams at a rate the host alone bounds: what `api_server_bench.py` measures.
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
from nori_jax.engine_core_process import (
    AbortRequests,
    AddRequests,
    ClientMessage,
    EngineInfo,
    Ready,
    Shutdown,
    StepMessage,
)
from nori_jax.model_config import load_preset


class _Running:
    __slots__ = ("request", "generated", "first")

    def __init__(self, request: EngineCoreRequest):
        self.request = request
        self.generated = 0
        self.first: float | None = None


def main() -> None:
    input_addr, output_addr = sys.argv[1:3]
    config = pickle.load(sys.stdin.buffer)
    step_s = float(os.environ.get("FAKE_CORE_STEP_MS", "5")) / 1e3
    vocab = int(load_preset(config.model or "tiny-llama")["vocab_size"])
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.connect(input_addr)
    outputs.connect(output_addr)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(ClientMessage).decode
    decode_request = msgspec.msgpack.Decoder(EngineCoreRequest).decode
    max_len = config.scheduler.max_model_len
    info = EngineInfo(
        "fake-core", max_len, vocab, [], byte_tokenizer(vocab).to_state(), 0.0, 0.0, {}
    )
    outputs.send(encode(Ready(info)))
    max_seqs = config.scheduler.max_num_seqs
    waiting: collections.deque[EngineCoreRequest] = collections.deque()
    running: dict[str, _Running] = {}
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    next_step = time.monotonic()
    while True:
        accepted, finished = [], []
        timeout = None if not (running or waiting) else max(0.0, next_step - time.monotonic())
        if poller.poll(None if timeout is None else int(timeout * 1e3)):
            while True:
                try:
                    msg = decode(inputs.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, AddRequests):
                    for raw in msg.requests:
                        r = decode_request(raw)
                        waiting.append(r)
                        accepted.append(r.request_id)
                elif isinstance(msg, AbortRequests):
                    for rid in msg.request_ids:
                        run = running.pop(rid, None)
                        if run is not None:
                            finished.append(_finished(run, msg.reason))
        now = time.monotonic()
        if now < next_step and not accepted and not finished:
            continue
        while waiting and len(running) < max_seqs:
            r = waiting.popleft()
            running[r.request_id] = _Running(r)
        ids, first = list(running), []
        tokens = np.empty(len(ids), np.int32)
        for i, rid in enumerate(ids):
            run = running[rid]
            # Word tokens (`<tN>`, dummy_tokenizer.py): each one decodes to text of its own.
            tokens[i] = 256 + (hash(rid) + run.generated) % (vocab - 258)
            run.generated += 1
            if run.first is None:
                run.first = now
                first.append(FirstToken(rid, now - run.request.arrival_time))
            if run.generated >= (run.request.params.max_tokens or 16):
                finished.append(_finished(running.pop(rid), "length"))
        stats = StepStats(len(running), len(waiting), 0.0, len(ids), 0, 0, 0, 0, 0.0, step_s, 1)
        out = EngineCoreOutputs(ids, tokens.tobytes(), {}, finished, first, stats)
        outputs.send(encode(StepMessage(out, accepted, [])), copy=False)
        next_step = max(next_step + step_s, now)


def _finished(run: _Running, reason: str) -> FinishedRequest:
    now = time.monotonic()
    r = run.request
    ttft = None if run.first is None else run.first - r.arrival_time
    metrics = RequestMetrics(0.0, 0.0, 0.0, ttft, now - r.arrival_time, 0, 0)
    return FinishedRequest(r.request_id, reason, len(r.prompt_token_ids), run.generated, metrics)


if __name__ == "__main__":
    main()
