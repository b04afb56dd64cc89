"""`nori-jax serve` over a disaggregated engine (`--prefill-replicas 1 --decode-replicas 1`): the
engine-core process runs the prefill and decode replicas on two CPU devices of its own, and the
server gives the single-device engine's tokens and the transfer metrics."""

from __future__ import annotations

import re

import httpx
import pytest
from cpu_devices import cpu_devices_flags
from serve_harness import client, engine_config, running_server

from nori_jax import LLM, SamplingParams
from nori_jax.core_client import EngineCoreClient

PROMPTS = [[5, 6, 7], list(range(40, 80)), list(range(100, 160))]
GREEDY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
SMALL = {"max_num_batched_tokens": 32, "max_num_seqs": 4}  # two buckets per replica: quick start


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as mp:
        # The engine-core process is a fresh interpreter: it starts JAX with two CPU devices.
        # Only while it is spawned: this process's JAX keeps its one device.
        mp.setenv("XLA_FLAGS", cpu_devices_flags(2))
        mp.setenv("JAX_PLATFORMS", "cpu")
        engine = EngineCoreClient(engine_config(mesh={"prefill": 1, "decode": 1}, **SMALL))
    with running_server(engine=engine) as s:
        yield s


def test_served_tokens_match_the_single_device_engine(server):
    params = SamplingParams(**GREEDY)
    expected = [
        o.token_ids for o in LLM.from_config(engine_config(**SMALL)).generate(PROMPTS, params)
    ]
    with client(server) as c:
        got = [
            c.post("/generate", json={"prompt": p, **GREEDY}).json()["token_ids"] for p in PROMPTS
        ]
    assert got == expected
    metrics = httpx.get(f"{server.url}/metrics").text
    ok = re.search(r'^nori:kv_transfers_total\{result="ok"\} (\S+)$', metrics, re.M)
    assert ok and float(ok.group(1)) == len(PROMPTS)
    assert re.search(r"^nori:request_transfer_time_seconds_count 3\.0$", metrics, re.M)
    assert "nori:recompiles_total 0.0" in metrics
