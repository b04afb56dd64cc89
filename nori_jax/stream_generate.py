"""Generation over a stream of requests: pull a request only when there is room, hand back each
result as it finishes.

A batch job of millions of prompts never sits in memory whole: at most `max_in_flight` requests
are queued in or running on the engine, and the next one is pulled from the iterable (a list, a
generator, a grain dataset) only when one finishes. `LLM.generate_stream` and `nori-jax
run-batch` are both this loop over `LLMEngine`'s add_request / step / drain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from nori_jax.core.outputs import RequestOutput
from nori_jax.core.scheduler import QueueFullError
from nori_jax.heap_freeze import heap_frozen
from nori_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nori_jax.engine import LLMEngine


@dataclasses.dataclass(frozen=True)
class StreamRequest[K]:
    key: K  # the caller's handle, handed back with the result
    prompt: str | list[int]
    params: SamplingParams
    request_id: str | None = None  # the engine's id; None: the engine draws one
    priority: int = 0  # under the scheduling policy "priority": lower runs first
    # `engine.tokenize(prompt)` where the caller already ran it (validating a batch up front)
    tokenized: tuple[list[int], str | None] | None = None


def stream_requests[K](
    engine: LLMEngine, requests: Iterable[StreamRequest[K]], max_in_flight: int
) -> Iterator[tuple[K, RequestOutput | ValueError]]:
    """(key, finished output) for every request, in the order they finish; (key, ValueError)
    for a request the engine refused (bad prompt or settings), and the others go on.

    A full waiting queue (QueueFullError) holds the request back until a step has run. If the
    consumer stops early (or raises), the requests still in flight are aborted, so their KV pages
    go back to the pool.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight={max_in_flight} must be >= 1")
    source = iter(requests)
    in_flight: dict[str, K] = {}
    held: StreamRequest[K] | None = None  # refused by a full queue: offered again after a step
    exhausted = False
    try:
        # No full garbage collection walks the engine's heap mid-loop (heap_freeze.py).
        with heap_frozen():
            while True:
                while not exhausted and len(in_flight) < max_in_flight:
                    if held is None:
                        held = next(source, None)
                        if held is None:
                            exhausted = True
                            break
                    try:
                        request_id = engine.add_request(
                            held.request_id,
                            held.prompt,
                            held.params,
                            tokenized=held.tokenized,
                            stream=False,
                            priority=held.priority,
                        )
                    except QueueFullError:
                        break
                    except ValueError as e:
                        key, held = held.key, None
                        yield key, e
                        continue
                    in_flight[request_id] = held.key
                    held = None
                if not in_flight and exhausted:
                    break
                for out in engine.step():
                    if out.finished and out.request_id in in_flight:
                        yield in_flight.pop(out.request_id), out
            engine.drain()  # the step still in flight (overlapped scheduling): none of ours
    finally:
        for request_id in in_flight:
            engine.abort(request_id)
