"""A real server on 127.0.0.1: uvicorn in a thread over the tiny-llama preset (random weights).

Every server here uses the same engine shapes (configs/engine/tiny-cpu.yaml), so only the first
one compiles and the others load their programs from the persistent compilation cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from nori_jax.async_engine import AsyncEngine
from nori_jax.engine import LLMEngine
from nori_jax.engine_client import EngineClient
from nori_jax.engine_config import EngineConfig
from serve.api import create_app
from serve.server import Server as DrainingServer
from serve.server import guarded_protocol
from serve.settings import ServerSettings

MODEL_NAME = "tiny"
# A template like SmolLM2's (ChatML), so chat requests have something to render.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclasses.dataclass
class Server:
    url: str
    engine: EngineClient
    uvicorn: DrainingServer
    thread: threading.Thread

    @property
    def llm_engine(self) -> LLMEngine:
        return self.engine.engine

    def free_pages(self) -> int:
        return self.llm_engine.scheduler.allocator.num_free_pages

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until no request is in flight and the engine has nothing left to run."""
        deadline = time.monotonic() + timeout_s
        while self.engine.num_in_flight or self.llm_engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.01)
        time.sleep(0.05)  # let the engine thread finish the gauge update it does going idle

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not shut down"


def engine_config(**overrides: Any) -> EngineConfig:
    return EngineConfig.from_yaml("tiny-cpu", **overrides)


@contextlib.contextmanager
def running_server(
    settings: dict[str, Any] | None = None,
    engine: EngineClient | None = None,
    **engine_overrides: Any,
) -> Iterator[Server]:
    """A server over `engine`, by default the tiny-cpu engine stepped by a thread here."""
    if engine is None:
        engine = AsyncEngine(LLMEngine(engine_config(**engine_overrides)))
    server_settings = ServerSettings(
        **({"model_name": MODEL_NAME, "chat_template": CHAT_TEMPLATE} | (settings or {}))
    )
    app = create_app(engine, server_settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no race with other tests
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=30,
        http=guarded_protocol(server_settings.header_timeout_s, server_settings.write_timeout_s),
    )
    server = DrainingServer(config, engine, server_settings.drain_timeout_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    handle = Server(f"http://127.0.0.1:{port}", engine, server, thread)
    try:
        yield handle
    finally:
        if thread.is_alive():
            handle.stop()
        sock.close()


def client(server: Server, **kwargs: Any) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60, **kwargs)


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def post_raw(c: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return c.post(path, content=body, headers={"Content-Type": "application/json"})
