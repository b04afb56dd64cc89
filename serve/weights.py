"""The weight routes for RL loops, off unless `nori-jax serve --enable-weight-control`:

    POST /update_weights  {"model_path": DIR}   new weights from a Hugging Face directory
    POST /sleep?level=1|2                        KV pages, step buffers, prefix cache freed;
                                                 weights to pinned host memory (1) or dropped (2)
    POST /wake_up         [{"model_path": DIR}]  back on the device (new weights: required after
                                                 level 2)
    GET  /is_sleeping                            {"is_sleeping": bool}

(the names of vLLM's sleep-mode routes and of SGLang's `update_weights_from_disk`). Each answers
{"is_sleeping": bool} once done; the engine runs them between steps (weight_control.py), on every
replica. A directory is read on the server's machine, so the routes take the API key like the
generation routes and are off by default. Errors are JSON: 409 while requests are queued or
running (retry when the rollouts have finished), 400 for a bad level or directory or weights that
do not fit the model (nothing changed), 503 for generation requests while the engine sleeps.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from serve.context import get_context
from serve.errors import api_error_from, bad_request

router = APIRouter()


class WeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str | None = None


async def _run(request: Request, op: str, level: int = 1, model_path: str | None = None):
    ctx = get_context(request)
    try:
        asleep = await ctx.engine.control(op, level, model_path)
    except Exception as e:  # noqa: BLE001 - every engine error has its JSON answer
        raise api_error_from(e, ctx.settings.retry_after_s) from None
    return JSONResponse({"is_sleeping": asleep})


@router.post("/update_weights")
async def update_weights(body: WeightsBody, request: Request) -> JSONResponse:
    if not body.model_path:
        raise bad_request("model_path (a Hugging Face directory) is required", "model_path")
    return await _run(request, "update_weights", model_path=body.model_path)


@router.post("/sleep")
async def sleep(request: Request, level: int = 1) -> JSONResponse:
    if level not in (1, 2):
        raise bad_request(f"level={level} must be 1 (weights kept) or 2 (dropped)", "level")
    return await _run(request, "sleep", level=level)


@router.post("/wake_up")
async def wake_up(request: Request, body: WeightsBody | None = None) -> JSONResponse:
    return await _run(request, "wake_up", model_path=body.model_path if body else None)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> JSONResponse:
    return await _run(request, "is_sleeping")
