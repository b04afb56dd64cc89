"""A fake OpenAI-compatible streaming server whose delays and failures a test controls.

Runs in its own process (`python bench_fake_server.py` prints its port), so the client under
test never shares a GIL with it and measured delays are the injected ones. Behaviour is set per
test with POST /_control; GET /_stats says what the server saw. GET /metrics, as the behaviour
`metrics` says: absent (404), this engine's step series (`"engine"`: every token sent is a step of
4 ms with 0.5 ms of scheduling, a request's first token a prefill launch of bucket 64 and the others
decode launches of bucket 16, in two `replica` label sets of the same numbers), or any text.

Injected timing of a request that asks for n tokens with a p-token prompt: the i-th token
(i = 0..n-1) is sent at  t_receive + ttft_s + ttft_per_prompt_token_s * p + i * itl_s, scheduled
on absolute times so sleeps never drift.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

DEFAULTS: dict[str, Any] = {
    "ttft_s": 0.02,
    "ttft_per_prompt_token_s": 0.0,
    "itl_s": 0.005,
    "fail_every": 0,  # every k-th request (by arrival) gets an HTTP error
    "fail_status": 503,
    "break_every": 0,  # every k-th request: the connection drops after two tokens
    "hang_every": 0,  # every k-th request: headers, then nothing, ever
    "include_usage": True,
    "role_chunk": True,  # chat: an empty assistant-role delta right away, as vLLM sends
    "max_output": None,  # stop after this many tokens whatever max_tokens says
    "tokens_per_chunk": 1,  # each text chunk carries this many tokens (usage counts them all)
    "tokenizer_dir": None,  # count text prompts with this HF tokenizer (exact usage)
    "model_root": None,  # the `root` of the /v1/models card (vLLM's: the model's path)
    "metrics": None,  # GET /metrics: None: 404; "engine": step series (see above); else this text
    "bad_text_every": 0,  # every k-th request: an extra event whose "text" is a number
    "completion_tokens": None,  # usage.completion_tokens sent as this (any JSON) instead
    "open_after_done": False,  # keep the connection open after [DONE]
    "plain_json": False,  # answer 200 with one JSON body, no event stream
}
STEP_S, SCHEDULE_S = 0.004, 0.0005
CORE_IO_S = 0.00025  # the engine-core process's I/O around each step
ENGINE_TTFT_S = 0.015  # each request's first token as the engine sees it

state: dict[str, Any] = {
    "behaviour": dict(DEFAULTS),
    "count": 0,
    "prompt_tokens": [],
    "sent": [],  # per completed stream: {"prompt_tokens", "ttft_s", "itl_s"} as actually yielded
    "tok": None,
    "tokens": 0,  # tokens sent, each one engine step of the /metrics
    "finished_prompt_tokens": 0,  # prompt tokens of finished streams (nori:prompt_tokens)
}
app = FastAPI()


@app.post("/_control")
async def control(request: Request) -> dict[str, Any]:
    behaviour = dict(DEFAULTS) | await request.json()
    state.update(behaviour=behaviour, count=0, prompt_tokens=[], sent=[], tok=None)
    state.update(tokens=0, finished_prompt_tokens=0)
    if behaviour["tokenizer_dir"]:
        from nori_jax.tokenizer import Tokenizer

        state["tok"] = Tokenizer.from_hf_dir(behaviour["tokenizer_dir"])
    return {"ok": True}


@app.get("/_stats")
async def stats() -> dict[str, Any]:
    return {"count": state["count"], "prompt_tokens": state["prompt_tokens"], "sent": state["sent"]}


@app.get("/metrics")
async def metrics() -> Any:
    text = state["behaviour"]["metrics"]
    if text is None:
        return PlainTextResponse("Not Found", status_code=404)
    if text == "engine":
        n, k, lines = state["tokens"], len(state["sent"]), []
        for name, kind, value in (
            ("nori:step_duration_seconds", "histogram", (n, n * STEP_S)),
            ("nori:scheduler_duration_seconds", "histogram", (n, n * SCHEDULE_S)),
            ("nori:generation_tokens", "counter", n),
            ("nori:prompt_tokens", "counter", state["finished_prompt_tokens"]),
            ("nori:engine_core_io_seconds", "counter", n * CORE_IO_S),
            ("nori:time_to_first_token_seconds", "histogram", (k, k * ENGINE_TTFT_S)),
        ):
            lines.append(f"# TYPE {name} {kind}")
            for replica in ("0", "1"):
                label = f'replica="{replica}"'
                if kind == "counter":
                    lines.append(f"{name}_total{{{label}}} {float(value)}")
                    continue
                count, total = value
                lines.append(f'{name}_bucket{{le="+Inf",{label}}} {float(count)}')
                lines.append(f"{name}_count{{{label}}} {float(count)}")
                lines.append(f"{name}_sum{{{label}}} {total}")
        # launches by shape: each request's first token a prefill launch of bucket 64, the
        # others decode launches of bucket 16, STEP_S each
        for name, per in (("nori:step_launches", 1.0), ("nori:step_launch_seconds", STEP_S)):
            lines.append(f"# TYPE {name} counter")
            for replica in ("0", "1"):
                for bucket, kind, count in (("16", "decode", n - k), ("64", "prefill", k)):
                    labels = f'bucket="{bucket}",kind="{kind}",replica="{replica}"'
                    lines.append(f"{name}_total{{{labels}}} {count * per}")
        text = "\n".join(lines) + "\n"
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


@app.get("/v1/models")
async def models() -> dict[str, Any]:
    card = {"id": "fake-model", "object": "model", "owned_by": "fake"}
    if state["behaviour"]["model_root"]:
        card["root"] = state["behaviour"]["model_root"]
    return {"object": "list", "data": [card]}


def _count_prompt(body: dict[str, Any], chat: bool) -> int:
    tok = state["tok"]
    if chat:
        content = body["messages"][0]["content"]
        if tok is None:
            return len(content.split()) + 1
        rendered = tok.apply_chat_template(body["messages"])
        return len(tok.encode(rendered, add_special_tokens=False))
    prompt = body["prompt"]
    if isinstance(prompt, list):
        return len(prompt)
    return len(tok.encode(prompt)) if tok is not None else len(prompt.split()) + 1


async def _generate(request: Request, chat: bool) -> Any:
    received = time.perf_counter()
    b = state["behaviour"]
    state["count"] += 1
    k = state["count"]
    body = await request.json()
    if b["fail_every"] and k % b["fail_every"] == 0:
        return JSONResponse(
            {"error": {"message": "fake overload", "type": "server_error"}},
            status_code=b["fail_status"],
        )
    n_prompt = _count_prompt(body, chat)
    state["prompt_tokens"].append(n_prompt)
    n_out = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    if b["max_output"] is not None:
        n_out = min(n_out, b["max_output"])
    first = received + b["ttft_s"] + b["ttft_per_prompt_token_s"] * n_prompt
    hang = b["hang_every"] and k % b["hang_every"] == 0
    broken = b["break_every"] and k % b["break_every"] == 0
    bad_text = b["bad_text_every"] and k % b["bad_text_every"] == 0
    if b["plain_json"]:  # a server that ignores stream: true
        text = "".join(f" t{i}" for i in range(n_out))
        return JSONResponse({"choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def choice(i: int) -> dict[str, Any]:
        finish = "length" if i == n_out - 1 else None
        if chat:
            return {"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": finish}
        return {"index": 0, "text": f" t{i}", "finish_reason": finish}

    async def stream():
        if chat and b["role_chunk"]:
            yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        if hang:
            await asyncio.sleep(3600)
        times = []
        for i in range(n_out):
            await asyncio.sleep(max(0.0, first + i * b["itl_s"] - time.perf_counter()))
            if broken and i == 2:
                raise ConnectionResetError("fake server drops the connection")
            times.append(time.perf_counter())
            state["tokens"] += 1  # counted before the client can see the token, as a server does
            if i == n_out - 1:
                state["finished_prompt_tokens"] += n_prompt
            yield event({"object": "chat.completion.chunk" if chat else "text_completion",
                         "choices": [choice(i)]})  # fmt: skip
            if bad_text and i == 0:
                yield event({"choices": [{"index": 0, "text": 7, "finish_reason": None}]})
        itl = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
        state["sent"].append(
            {"prompt_tokens": n_prompt, "ttft_s": times[0] - received, "itl_s": itl}
        )
        if b["include_usage"]:
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out * b["tokens_per_chunk"]}
            if b["completion_tokens"] is not None:
                usage["completion_tokens"] = b["completion_tokens"]
            yield event({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
        if b["open_after_done"]:
            await asyncio.sleep(3600)

    return StreamingResponse(stream(), media_type="text/event-stream")


@app.post("/v1/completions")
async def completions(request: Request) -> Any:
    return await _generate(request, chat=False)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    return await _generate(request, chat=True)


def main() -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(
        app, log_level="critical", timeout_graceful_shutdown=1, backlog=4096, access_log=False
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
