"""The FastAPI app: routes, guards, error handlers, and the engine's life inside the server's.

    app = create_app(EngineCoreClient(config), ServerSettings(model_name="m"))
    # or AsyncEngine(LLMEngine(config)): the same engine stepped by a thread of this process

Start-up starts the engine (it is compiled before the app exists, so the server never listens
before it can serve). Shutdown is serve/server.py's drain; the lifespan's end stops the engine if
the drain did not.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from nori_jax.engine_client import EngineClient
from nori_jax.heap_freeze import heap_frozen
from serve import chat, completions, generate, heartbeat, metrics_relay, tokenize, weights
from serve.context import ServeContext, get_context
from serve.errors import install_error_handlers
from serve.guards import RequestGuard
from serve.openapi import install_openapi
from serve.settings import ServerSettings

open_routes = APIRouter()


@open_routes.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine serves; 503 while it restarts, after it died, or while shutting down."""
    ctx = get_context(request)
    engine = ctx.engine
    which = {} if ctx.settings.api_server is None else {"api_server": ctx.settings.api_server}
    if engine.is_healthy:
        # Serving, but not whole: a data-parallel server with a replica down (restarting, or
        # given up on) says which and why, where its status alone hid it.
        degraded = {"degraded": reason} if (reason := engine.dead_reason) else {}
        return JSONResponse({"status": "ok"} | degraded | which)
    reason = engine.dead_reason or "shutting down"
    return JSONResponse({"status": "unhealthy", "reason": reason} | which, status_code=503)


@open_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    """The engine's own registry: the numbers `LLM.get_metrics()` returns. API servers 1.. answer
    with API server 0's (serve/metrics_relay.py), their own only if it does not answer."""
    ctx = get_context(request)
    if ctx.settings.metrics_from is not None:
        body = await asyncio.to_thread(metrics_relay.fetch, ctx.settings.metrics_from)
        if body is not None:
            headers = {"x-nori-metrics-source": "api-server-0"}
            return Response(body, media_type=CONTENT_TYPE_LATEST, headers=headers)
        headers = {"x-nori-metrics-source": "local"}
    else:
        headers = {}
    body = generate_latest(ctx.engine.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST, headers=headers)


models_router = APIRouter()


@models_router.get("/v1/models")
async def list_models(request: Request) -> Response:
    ctx = get_context(request)
    card = {
        "id": ctx.settings.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "nori-jax",
        "max_model_len": ctx.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


def create_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    ctx = ServeContext.build(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.is_started:
            engine.start()
        # The start-up heap (FastAPI's routes, the tokenizer; the model with an in-process
        # engine) stays out of full collections while the server runs: heap_freeze.py.
        beating = None
        if settings.heartbeat_path is not None:  # API servers 1..: API server 0 watches it
            beating = asyncio.create_task(heartbeat.beat(settings.heartbeat_path))
        try:
            with heap_frozen(collect=True):
                yield
                await engine.shutdown(settings.drain_timeout_s)
        finally:
            if beating is not None:
                beating.cancel()

    app = FastAPI(title="Nori-JAX", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    # The API key and the body's bounds are checked before anything is parsed (serve/guards.py).
    app.add_middleware(RequestGuard, settings=settings)
    routers = (open_routes, models_router, completions.router, chat.router, generate.router)
    for router in (*routers, tokenize.router):
        app.include_router(router)
    if settings.enable_weight_control:
        app.include_router(weights.router)
    install_openapi(app)
    return app
