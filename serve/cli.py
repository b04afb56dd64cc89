"""`nori-jax serve`: the engine flags (or a --config preset) plus the server's own.

The port is bound (not yet listening) before the engine loads and compiles, so a port in use
fails in a second rather than after the compile, and clients are refused, not left hanging,
until the engine is ready.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
from pathlib import Path

from nori_jax.engine_args import add_engine_args, engine_config_from_args
from serve.settings import ServerSettings

logger = logging.getLogger(__name__)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Serve the model over HTTP: /v1/completions, /v1/chat/completions, /v1/models, "
        "/generate, /health, /metrics. Without --config the engine settings are sized for the "
        "backend (the `cpu` preset on a CPU, the throughput shapes on a GPU); flags override "
        "them. See docs/serving.md."
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and /v1/models lists (default: --model)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("NORI_JAX_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every path except /health, /metrics, "
        "/openapi.json, /docs and /redoc (default: $NORI_JAX_API_KEY; none: open)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template: a file, or the template itself (overrides the model's)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="abort a request after this long, queueing included (504; default: none)",
    )
    g.add_argument(
        "--retry-after",
        type=int,
        default=1,
        metavar="SECONDS",
        help="Retry-After of a 429 when the waiting queue is full (--max-num-waiting)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, let requests in flight finish for up to this long",
    )
    g.add_argument(
        "--max-body-size",
        type=int,
        default=ServerSettings.max_body_bytes,
        metavar="BYTES",
        help="larger request bodies are refused with 413 before they are read",
    )
    g.add_argument(
        "--max-logprob-entries",
        type=int,
        default=ServerSettings.max_logprob_entries,
        metavar="N",
        help="a request's choices x max_tokens (with echo, + the prompt) x (top logprobs + 1) "
        "logprobs at most this (400 past it): its answer holds them all",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=ServerSettings.body_timeout_s,
        metavar="SECONDS",
        help="a request body must arrive within this (408)",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=ServerSettings.header_timeout_s,
        metavar="SECONDS",
        help="a request's headers must arrive within this (the connection is closed)",
    )
    g.add_argument(
        "--write-timeout",
        type=float,
        default=ServerSettings.write_timeout_s,
        metavar="SECONDS",
        help="a connection whose client reads nothing of its response for this long is dropped "
        "and its request aborted (what the engine made for it is freed); 0: never",
    )
    g.add_argument(
        "--api-server-hang-timeout",
        type=float,
        default=ServerSettings.api_server_hang_timeout_s,
        metavar="SECONDS",
        help="with --api-server-count: another API server whose event loop has not run for this "
        "long (stopped, stuck) is killed and restarted; 0: never",
    )
    g.add_argument(
        "--engine-hang-timeout",
        type=float,
        default=ServerSettings.engine_hang_timeout_s,
        metavar="SECONDS",
        help="an engine core that sends nothing for this long while requests are in flight is "
        "taken for hung: killed (its requests fail with a JSON error) and restarted; 0: never",
    )
    g.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="API server processes sharing the port and the engine core: HTTP, SSE and "
        "detokenization on N processes (one bounds the served throughput; docs/serving.md)",
    )
    g.add_argument(
        "--enable-weight-control",
        action="store_true",
        help="serve POST /update_weights, /sleep, /wake_up and GET /is_sleeping (RL loops: "
        "new weights from a directory on this machine, the GPU lent to a trainer; "
        "serve/weights.py)",
    )
    g.add_argument("--no-access-log", action="store_true", help="no log line per HTTP request")
    g.add_argument(
        "--engine-in-process",
        action="store_true",
        help="step the engine in a thread of the server's process instead of its own process "
        "(one GIL for HTTP and the step loop; for debugging)",
    )
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def chat_template_source(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound (not listening yet) to host:port. `reuse_port`: several API server
    processes each bind their own socket to the port and the kernel spreads the connections
    over them by their addresses (SO_REUSEPORT), so one process cannot take a burst of them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def run_serve(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    if not config.distributed.is_leader:  # a multi-host follower runs process 0's steps only
        from nori_jax.follower import follow

        return follow(config)
    count = args.api_server_count
    if count < 1:
        raise ValueError(f"--api-server-count {count} must be >= 1")
    if count > 1 and (args.engine_in_process or config.distributed.enabled or config.mesh.data > 1):
        raise ValueError(
            f"--api-server-count {count} runs several API servers over one engine-core process; "
            "it does not combine with --engine-in-process, a multi-host engine or "
            "data-parallel replicas"
        )
    settings = ServerSettings(
        model_name=args.served_model_name or config.model or DEFAULT_MODEL_NAME,
        api_key=args.api_key or None,
        chat_template=chat_template_source(args.chat_template),
        request_timeout_s=args.request_timeout,
        retry_after_s=args.retry_after,
        drain_timeout_s=args.drain_timeout,
        max_body_bytes=args.max_body_size,
        max_logprob_entries=args.max_logprob_entries,
        body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout,
        write_timeout_s=args.write_timeout or None,  # 0: never
        engine_hang_timeout_s=args.engine_hang_timeout or None,  # 0: never
        api_server_hang_timeout_s=args.api_server_hang_timeout or None,  # 0: never
        enable_weight_control=args.enable_weight_control,
        api_server=0 if count > 1 else None,
    )
    sock = bind(args.host, args.port, reuse_port=count > 1)
    hang_timeout_s = settings.engine_hang_timeout_s
    companions = None
    # A multi-host engine runs in this process: JAX's distributed runtime is joined once per
    # process, and this one joined it to choose the backend's config.
    if args.engine_in_process or config.distributed.enabled:
        from nori_jax.async_engine import AsyncEngine
        from nori_jax.engine import make_engine

        engine = AsyncEngine(make_engine(config))  # loads the weights, compiles every bucket
    elif config.mesh.data > 1:
        from nori_jax.dp_client import DataParallelClient

        engine = DataParallelClient(config, hang_timeout_s=hang_timeout_s)  # a core per replica
        logger.info("engine cores running in processes %s", engine.pids)
    else:
        from nori_jax.core_client import EngineCoreClient

        if count > 1:
            from nori_jax.socket_dirs import socket_dir
            from serve.api_servers import ApiServers

            companions = ApiServers(
                count,
                config,
                dataclasses.replace(settings, api_server=None),  # each one sets its own index
                sock.getsockname()[:2],  # the port, if it was 0, as the kernel chose it
                socket_dir("api"),
                args.log_level,
                not args.no_access_log,
            )
        extra = companions.client_addresses if companions is not None else []
        # Starts the engine-core process; returns when it is ready.
        engine = EngineCoreClient(config, extra_clients=extra, hang_timeout_s=hang_timeout_s)
        logger.info("engine core running in process %d", engine.pid)
    publisher = None
    if companions is not None:
        from serve.metrics_relay import MetricsPublisher

        publisher = MetricsPublisher(engine.metrics.registry, companions.metrics_address)
        companions.on_exit = engine.release_client
        companions.start()
        logger.info("API servers 1-%d running in processes %s", count - 1, companions.pids)
    try:
        return serve_http(
            engine, settings, sock, args.log_level, not args.no_access_log, companions
        )
    finally:
        if publisher is not None:
            publisher.close()
        if companions is not None:
            companions.kill()


def serve_http(
    engine,
    settings: ServerSettings,
    sock: socket.socket,
    log_level: str,
    access_log: bool,
    companions=None,
) -> int:
    """Serve the app over `engine` on the bound socket `sock` until a signal ends it (a drain
    first); the exit code. Every API server process runs this (serve/api_servers.py)."""
    import uvicorn

    from serve.api import create_app
    from serve.server import Server, guarded_protocol

    app = create_app(engine, settings)
    config = uvicorn.Config(
        app,
        log_level=log_level.lower(),
        access_log=access_log,
        http=guarded_protocol(settings.header_timeout_s, settings.write_timeout_s),
        # After the drain (server.py) every response has its last bytes: a few seconds to write.
        timeout_graceful_shutdown=5,
    )
    server = Server(config, engine, settings.drain_timeout_s, companions)
    host, port = sock.getsockname()[:2]
    logger.info("serving %r on http://%s:%d", settings.model_name, host, port)
    # uvicorn handles SIGINT/SIGTERM (drain, then stop) and afterwards re-raises the signal to
    # the handler that was there before it; a no-op one makes a drained shutdown exit with 0
    # rather than as killed by the signal (or with a KeyboardInterrupt traceback).
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
