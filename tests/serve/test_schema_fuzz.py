"""A bounded schemathesis run against the server's own /openapi.json: generated requests, valid
and invalid, to every route; no 5xx, and every answer's status, content type and body as the
schema says. (The long run is benchmarks/reliability/schema_fuzz.py.)"""

from __future__ import annotations

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from serve_harness import running_server

MAX_TOKENS = 4  # generated budgets are capped, so a case costs a few engine steps
MAX_EXAMPLES = 20  # per route and mode: about 20 s in all on 2 cores


@pytest.fixture(scope="module")
def api_schema():
    with running_server() as s:
        loaded = schemathesis.openapi.from_url(f"{s.url}/openapi.json")
        loaded.hook(map_body)
        yield loaded


def map_body(ctx, body):
    """Generated budgets stay small (the bounds themselves are tested in test_errors.py)."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int) and not isinstance(body[name], bool):
                body[name] = min(body[name], MAX_TOKENS)
        if "messages" in body and body.get("max_tokens") is None:
            body["max_tokens"] = MAX_TOKENS
    return body


SETTINGS = hypothesis.settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases on every run
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_no_5xx_and_answers_match_the_schema(api_schema) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    _fuzz(operations)


WEIGHT_ROUTES = {"/update_weights", "/sleep", "/wake_up", "/is_sleeping"}


@pytest.fixture(scope="module")
def weights_schema():
    with running_server({"enable_weight_control": True}) as s:
        loaded = schemathesis.openapi.from_url(f"{s.url}/openapi.json")
        yield loaded, s


def test_the_weight_routes_under_generated_requests(weights_schema) -> None:
    """Generated calls to /update_weights, /sleep, /wake_up and /is_sleeping (random paths,
    levels, bodies; the engine asleep or awake as they leave it): no 5xx, answers as the schema
    says; afterwards the engine wakes and serves."""
    loaded, server = weights_schema
    operations = [r.ok() for r in loaded.get_all_operations() if r.ok().path in WEIGHT_ROUTES]
    assert {op.path for op in operations} == WEIGHT_ROUTES
    _fuzz(operations)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        if c.get("/is_sleeping").json()["is_sleeping"]:
            assert c.post("/wake_up").status_code in (200, 400)  # 400: level 2, needs weights
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        if c.get("/is_sleeping").json()["is_sleeping"]:
            assert c.post("/generate", json=body).status_code == 503
        else:
            assert c.post("/generate", json=body).status_code == 200


def _fuzz(operations) -> None:
    modes_get = [schemathesis.GenerationMode.POSITIVE]
    for op in operations:
        # Valid bodies, then invalid ones (a GET without parameters has no invalid input).
        modes = list(schemathesis.GenerationMode) if op.method == "post" else modes_get
        for mode in modes:

            @SETTINGS
            @hypothesis.given(case=op.as_strategy(mode))
            def run(case) -> None:
                case.call_and_validate(checks=CHECKS)

            run()
