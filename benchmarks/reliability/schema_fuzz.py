"""A long schemathesis run against a running server's /openapi.json: valid and invalid bodies for
every route, checked for no 5xx and for status codes, content types and bodies as the schema says.
(tests/serve/test_schema_fuzz.py is the short version CI runs.)

    nori-jax serve --config tiny-cpu &
    python benchmarks/reliability/schema_fuzz.py --url http://127.0.0.1:8000 --examples 500

Generated budgets are capped at --max-tokens so a case costs a few engine steps. Prints the
statuses seen per route and mode, and each failure; exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import collections
import sys

import hypothesis
import schemathesis
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def capped_budgets(max_tokens: int):
    def map_body(ctx, body):
        if isinstance(body, dict):
            for name in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(name), int) and not isinstance(body[name], bool):
                    body[name] = min(body[name], max_tokens)
            if "messages" in body and body.get("max_tokens") is None:
                body["max_tokens"] = max_tokens
        return body

    return map_body


def fuzz(url: str, examples: int, max_tokens: int, seed: int | None) -> tuple[dict, list[str]]:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    map_body = capped_budgets(max_tokens)
    map_body.__name__ = "map_body"
    schema.hook(map_body)
    statuses: dict[tuple[str, str], collections.Counter] = {}
    failures: list[str] = []
    settings = hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=seed is None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    for op in (r.ok() for r in schema.get_all_operations()):
        modes = list(schemathesis.GenerationMode) if op.method == "post" else modes_of_get()
        for mode in modes:
            seen = statuses.setdefault(
                (f"{op.method.upper()} {op.path}", mode.value), collections.Counter()
            )

            run = settings(hypothesis.given(case=op.as_strategy(mode))(checker(seen, failures)))
            if seed is not None:
                run = hypothesis.seed(seed)(run)
            run()
    return statuses, failures


def checker(seen: collections.Counter, failures: list[str]):
    def run(case) -> None:
        response = case.call()
        seen[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except Exception as e:  # noqa: BLE001 - report every failure, go on
            failures.append(f"{case.method} {case.path} {response.status_code}: {e}")

    return run


def modes_of_get() -> list:
    return [schemathesis.GenerationMode.POSITIVE]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--examples", type=int, default=500, help="per route and mode")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=None, help="random cases (default: derandomized)")
    args = p.parse_args(argv)
    statuses, failures = fuzz(args.url, args.examples, args.max_tokens, args.seed)
    print("| route | mode | statuses |\n|---|---|---|")
    for (route, mode), seen in statuses.items():
        print(f"| {route} | {mode} | {dict(sorted(seen.items()))} |")
    for f in failures[:50]:
        print("FAIL", f)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
