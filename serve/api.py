"""The FastAPI app: routes, auth, error handlers, and the engine thread's life inside the server's.

    app = create_app(EngineCoreClient(config), ServerSettings(model_name="m"))
    # or AsyncEngine(LLMEngine(config)): the same engine stepped by a thread of this process

Start-up starts the engine thread (the engine is compiled before the app exists, so the server
never listens before it can serve). Shutdown refuses new requests, lets those in flight finish
(uvicorn already waits for open responses), then stops the thread.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from nori_jax.engine_client import EngineClient
from serve import chat, completions, generate
from serve.context import ServeContext, get_context
from serve.errors import ApiError, install_error_handlers
from serve.settings import ServerSettings


def require_api_key(request: Request) -> None:
    key = get_context(request).settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        token.strip().encode(), key.encode()
    ):
        raise ApiError(
            401,
            "invalid or missing API key (send 'Authorization: Bearer <key>')",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


open_routes = APIRouter()


@open_routes.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine loop runs and takes requests; 503 once it died or is shutting down."""
    engine = get_context(request).engine
    if engine.is_healthy:
        return JSONResponse({"status": "ok"})
    return JSONResponse(
        {"status": "unhealthy", "reason": engine.dead_reason or "shutting down"}, status_code=503
    )


@open_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    """The engine's own registry: the numbers `LLM.get_metrics()` returns."""
    registry = get_context(request).engine.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


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
        yield
        await engine.shutdown(settings.drain_timeout_s)

    app = FastAPI(title="Nori-JAX", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(open_routes)
    guarded = [Depends(require_api_key)]
    for router in (models_router, completions.router, chat.router, generate.router):
        app.include_router(router, dependencies=guarded)
    return app
