"""Server settings: everything `nori-jax serve` configures beyond the engine."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the id clients send as `model` and /v1/models lists
    api_key: str | None = None  # a Bearer token every path but the open ones needs (guards.py)
    chat_template: str | None = None  # Jinja source overriding the tokenizer's own
    request_timeout_s: float | None = None  # per request, queueing included; None: no limit
    retry_after_s: int = 1  # the Retry-After header of a 429 (waiting queue full)
    drain_timeout_s: float = 30.0  # shutdown waits this long for requests in flight
    max_body_bytes: int = 8 * 2**20  # larger request bodies get a 413, unread
    # A request's choices x max_tokens (+ the prompt with echo) x (top logprobs + 1) logprobs at
    # most this when it asks for top logprobs or the prompt's (a 400 past it): its answer holds
    # them all, about 0.5 KB each as Python objects and JSON (262,144: ~140 MB)
    max_logprob_entries: int = 2**18
    body_timeout_s: float = 30.0  # a request body must arrive within this (408)
    header_timeout_s: float = 30.0  # a request's headers must arrive within this (closed)
    # A connection whose writes stay paused this long (its client reads nothing) is dropped and
    # its request aborted (serve/server.py); None: never
    write_timeout_s: float | None = 60.0
    # An engine core silent this long with requests in flight is hung: killed and restarted
    # (EngineCoreClient.hang_timeout_s); None: never
    engine_hang_timeout_s: float | None = 60.0
    api_server: int | None = None  # which of several API server processes this is (None: one)
    # API servers 1..: where API server 0 publishes /metrics (serve/metrics_relay.py); None: here
    metrics_from: str | None = None
    # API servers 1..: a file whose time this process's event loop sets every HEARTBEAT_S, so
    # that API server 0 can tell a stopped or stuck one (serve/api_servers.py); None: none
    heartbeat_path: str | None = None
    # API server 0: another one whose heartbeat is this old is killed and restarted; None: never
    api_server_hang_timeout_s: float | None = 30.0
    # /update_weights, /sleep, /wake_up, /is_sleeping (serve/weights.py): off unless asked
    enable_weight_control: bool = False

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must be non-empty")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s} must be > 0")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s={self.retry_after_s} must be >= 0")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} must be >= 1")
        if self.max_logprob_entries < 1:
            raise ValueError(f"max_logprob_entries={self.max_logprob_entries} must be >= 1")
        if self.engine_hang_timeout_s is not None and not self.engine_hang_timeout_s > 0:
            raise ValueError(f"engine_hang_timeout_s={self.engine_hang_timeout_s} must be > 0")
        if self.api_server_hang_timeout_s is not None and not self.api_server_hang_timeout_s > 0:
            raise ValueError(
                f"api_server_hang_timeout_s={self.api_server_hang_timeout_s} must be > 0"
            )
        if self.write_timeout_s is not None and not self.write_timeout_s > 0:
            raise ValueError(f"write_timeout_s={self.write_timeout_s} must be > 0")
        for name in ("body_timeout_s", "header_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
