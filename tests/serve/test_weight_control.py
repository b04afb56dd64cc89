"""The weight routes (serve/weights.py, `--enable-weight-control`) over a real server, with the
engine core in its own process and stepped by a thread here: new weights from a directory answer
as the offline engine does with them, sleep and wake-up keep the tokens, a sleeping engine refuses
generation with a JSON 503, busy and bad calls get their JSON errors with nothing changed, and the
routes are absent without the flag."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import save_file
from serve_harness import assert_error, client, engine_config, running_server

from nori_jax import LLM, SamplingParams
from nori_jax.async_engine import AsyncEngine
from nori_jax.core_client import EngineCoreClient
from nori_jax.engine import LLMEngine

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], list(range(100, 140))]
GREEDY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}


def _save(weights: dict[str, np.ndarray], path) -> str:
    path.mkdir()
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Directory "a": the tiny-cpu engine's own weights; "b": every tensor perturbed. With the
    offline engine's greedy tokens for each."""
    llm = LLM.from_config(engine_config())
    params = SamplingParams(**GREEDY)
    a = llm.get_weights()
    rng = np.random.default_rng(0)
    b = {
        k: (v.astype(np.float32) + rng.normal(0, 2 * float(np.std(v)) + 1e-3, v.shape)).astype(
            v.dtype
        )
        for k, v in a.items()
    }
    root = tmp_path_factory.mktemp("weights")
    dirs = {"a": _save(a, root / "a"), "b": _save(b, root / "b")}
    tokens = {"a": [o.token_ids for o in llm.generate(PROMPTS, params)]}
    llm.update_weights(dirs["b"])
    tokens["b"] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert tokens["a"] != tokens["b"]
    return dirs, tokens


@pytest.fixture(scope="module", params=["process", "thread"])
def server(request):
    if request.param == "process":
        engine = EngineCoreClient(engine_config())
    else:
        engine = AsyncEngine(LLMEngine(engine_config()))
    with running_server({"enable_weight_control": True}, engine=engine) as s:
        yield s


def _tokens(c) -> list[list[int]]:
    return [c.post("/generate", json={"prompt": p, **GREEDY}).json()["token_ids"] for p in PROMPTS]


def _state(c) -> bool:
    r = c.get("/is_sleeping")
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


def _metric(c, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_update_weights_from_a_directory(server, checkpoints):
    dirs, tokens = checkpoints
    with client(server) as c:
        start = _tokens(c)
        updates = _metric(c, "nori:weight_updates_total")
        r = c.post("/update_weights", json={"model_path": dirs["b"]})
        assert r.status_code == 200 and r.json() == {"is_sleeping": False}, r.text
        assert _tokens(c) == tokens["b"]
        assert c.post("/update_weights", json={"model_path": dirs["a"]}).status_code == 200
        assert _tokens(c) == tokens["a"]
        assert _metric(c, "nori:weight_updates_total") == updates + 2
    assert start == tokens["a"]  # the server's engine had "a"'s weights (both random, seed 0)


def test_sleep_and_wake_up(server, checkpoints):
    dirs, tokens = checkpoints
    with client(server) as c:
        r = c.post("/sleep", params={"level": 1})
        assert r.status_code == 200 and r.json() == {"is_sleeping": True}, r.text
        assert _state(c)
        assert _metric(c, "nori:engine_sleeping") == 1
        assert_error(c.post("/generate", json={"prompt": PROMPTS[0], **GREEDY}), 503)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert_error(c.post("/v1/completions", json=body), 503, code="engine_asleep")
        assert_error(c.post("/update_weights", json={"model_path": dirs["b"]}), 503)
        assert_error(c.post("/sleep"), 400)  # already asleep
        r = c.post("/wake_up")
        assert r.status_code == 200 and r.json() == {"is_sleeping": False}, r.text
        assert _metric(c, "nori:engine_sleeping") == 0
        assert _tokens(c) == tokens["a"]
        # Level 2 drops the weights: waking needs new ones, and takes them.
        assert c.post("/sleep", params={"level": 2}).status_code == 200
        assert_error(c.post("/wake_up"), 400)
        assert _state(c)
        assert c.post("/wake_up", json={"model_path": dirs["b"]}).status_code == 200
        assert _tokens(c) == tokens["b"]
        assert c.post("/update_weights", json={"model_path": dirs["a"]}).status_code == 200
        assert not _state(c)


def test_bad_calls_change_nothing(server, checkpoints, tmp_path):
    dirs, tokens = checkpoints
    partial = {"model.norm.weight": np.ones(64, np.float32)}
    with client(server) as c:
        assert_error(c.post("/sleep", params={"level": 3}), 400, param="level")
        assert_error(c.post("/sleep", params={"level": "deep"}), 400)
        assert_error(c.post("/update_weights", json={}), 400, param="model_path")
        assert_error(c.post("/update_weights", json={"model_path": str(tmp_path)}), 400)
        assert_error(
            c.post("/update_weights", json={"model_path": _save(partial, tmp_path / "p")}), 400
        )
        assert_error(c.post("/update_weights", json={"model_path": dirs["a"], "x": 1}), 400)
        # JSON escapes for a NUL and a lone surrogate, a path too long for the OS, a home-relative
        # climb: each a 400 (the directory is not one), never a 500 or a dead engine.
        long = "x" * 100_000
        for path in (r"a\u0000b", r"\ud800", long, "~root/../../"):
            body = '{"model_path": "' + path + '"}'
            headers = {"content-type": "application/json"}
            r = c.post("/update_weights", content=body, headers=headers)
            assert_error(r, 400)
            assert len(r.text) < 1000  # the path is cut in the message
        corrupt = tmp_path / "corrupt"
        corrupt.mkdir()
        (corrupt / "config.json").write_text("{}")
        (corrupt / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"not a header")
        r = c.post("/update_weights", json={"model_path": str(corrupt)})
        assert_error(r, 400)
        assert "cannot read its tensors" in r.json()["error"]["message"]
        assert_error(c.post("/sleep", params={"level": 2**70}), 400, param="level")
        assert_error(c.post("/wake_up"), 400)  # not asleep
        assert not _state(c)
        assert _tokens(c) == tokens["a"]


def test_busy_engine_refuses_with_409(server, checkpoints):
    """A sleep asked while a request runs is refused (409); the request finishes untouched."""
    dirs, tokens = checkpoints
    long = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
    result = {}

    def run():
        with client(server) as c:
            result["r"] = c.post("/generate", json=long)

    t = threading.Thread(target=run)
    t.start()
    with client(server) as c:
        deadline = time.monotonic() + 30
        while not server.engine.num_in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert_error(c.post("/sleep"), 409, code="engine_busy")
        t.join(60)
        assert result["r"].status_code == 200
        assert result["r"].json()["token_ids"][:10] == tokens["a"][0]
        assert not _state(c)


def test_routes_are_off_by_default():
    with running_server() as s, client(s) as c:
        assert_error(c.post("/sleep"), 404)
        assert_error(c.get("/is_sleeping"), 404)
        assert_error(c.post("/update_weights", json={"model_path": "/"}), 404)


def test_the_schema_lists_the_routes_and_their_errors(server):
    with client(server) as c:
        paths = c.get("/openapi.json").json()["paths"]
    for path, method in [
        ("/update_weights", "post"),
        ("/sleep", "post"),
        ("/wake_up", "post"),
        ("/is_sleeping", "get"),
    ]:
        answers = paths[path][method]["responses"]
        assert {"200", "400", "409", "503"} <= set(answers), path
        assert answers["200"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/WeightState"
        }


@pytest.fixture(scope="module")
def process_server():
    """Its own server over an engine-core process: the test below kills that process."""
    engine = EngineCoreClient(engine_config())
    with running_server({"enable_weight_control": True}, engine=engine) as s:
        yield s


def _kill_core_and_wait(server) -> None:
    import os
    import signal

    engine: EngineCoreClient = server.engine
    killed = engine.pid
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while engine.pid == killed or not engine.is_healthy:
        assert time.monotonic() < deadline, engine.dead_reason
        time.sleep(0.05)


def test_a_restarted_core_keeps_the_new_weights_and_the_sleep(process_server, checkpoints):
    """A new engine-core process loads the configured checkpoint: after update_weights a
    restarted core served the original weights again, and one restarted asleep came back
    awake. The client replays both on the new core before it serves."""
    dirs, tokens = checkpoints
    with client(process_server) as c:
        assert c.post("/update_weights", json={"model_path": dirs["b"]}).status_code == 200
        assert _tokens(c) == tokens["b"]
        _kill_core_and_wait(process_server)
        assert _tokens(c) == tokens["b"]
        assert c.post("/sleep", params={"level": 1}).status_code == 200
        _kill_core_and_wait(process_server)
        assert _state(c)
        assert_error(c.post("/generate", json={"prompt": PROMPTS[0], **GREEDY}), 503)
        assert c.post("/wake_up").status_code == 200
        assert _tokens(c) == tokens["b"]
        _kill_core_and_wait(process_server)  # awake now: it stays awake
        assert not _state(c)
        assert _tokens(c) == tokens["b"]
