"""`nori-jax serve` as a user runs it: a subprocess with flags and a preset; SIGTERM drains."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serve_harness import CHAT_TEMPLATE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-cli")
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    port = _free_port()
    exe = shutil.which("nori-jax") or str(Path(sys.executable).with_name("nori-jax"))
    cmd = [
        exe,
        "--log-level",
        "warning",
        "serve",
        "--config",
        "tiny-cpu",
        "--port",
        str(port),
        "--served-model-name",
        "tiny-cli",
        "--chat-template",
        str(tmp / "chat.jinja"),
        "--max-num-waiting",
        "64",
        "--no-access-log",
    ]
    log = (tmp / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (tmp / "server.log").read_text()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass  # not listening yet: the engine is compiling
        time.sleep(0.2)
    yield url, proc, tmp / "server.log"
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.close()


def test_serves_with_flags(served) -> None:
    url, _, _ = served
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny-cli" and models["data"][0]["max_model_len"] == 256
    chat = {"model": "tiny-cli", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_sigterm_drains_requests_in_flight(served) -> None:
    """While draining the server still answers: /health and new work get a 503 JSON body, and
    the stream in flight runs to its end; then the process exits with 0."""
    url, proc, log = served
    body = {"prompt": "drain", "max_tokens": 200, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        it = r.iter_lines()
        lines.append(json.loads(next(it)))
        proc.send_signal(signal.SIGTERM)  # mid-stream
        time.sleep(0.3)
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        refused = httpx.post(f"{url}/generate", json={"prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_unavailable"
        lines += [json.loads(line) for line in it if line]
    assert sum(len(x["token_ids"]) for x in lines) == 200
    assert lines[-1]["finish_reason"] == "length"
    assert proc.wait(30) == 0, log.read_text()
