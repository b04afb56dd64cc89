"""ReplicatedEngine: data-parallel replicas of the engine in one process, with LLMEngine's API.

`--data-parallel-size N` (`MeshConfig.data`) builds N engine cores, each on its own `model`
devices (`build_engine(config, replica=i)`: weights loaded onto those devices, its own KV pool and
compiled programs), behind one frontend: one tokenizer (shared), one output processor, one
metrics view with a `replica` label (replica_metrics.py). A `ReplicaRouter` (core/replica_router.py)
sends each request to the least loaded replica, or to the one that served its prefix.

A step launches every replica's next step before it fetches any, so their devices compute at the
same time (JAX dispatch is asynchronous); then it fetches them in turn and merges the outputs.
`LLM(..., mesh=MeshConfig(data=2))`, `AsyncEngine` and `nori-jax serve --engine-in-process` take it
through `make_engine`; the served default runs one engine-core process per replica instead
(dp_client.py).
"""

from __future__ import annotations

import dataclasses

from nori_jax.core.engine_core import EngineCore, EngineCoreRequest, StepTimes
from nori_jax.core.outputs import EngineCoreOutputs, RequestOutput
from nori_jax.core.replica_router import ReplicaRouter, RouterConfig
from nori_jax.core.step_shapes import StepShapes
from nori_jax.engine import EngineParts, LLMEngine, build_engine
from nori_jax.engine_config import EngineConfig
from nori_jax.metrics import EngineMetrics
from nori_jax.replica_metrics import ReplicaMetrics


class ReplicatedEngine(LLMEngine):
    """LLMEngine over `config.mesh.data` replicas. `core`, `runner`, `model` and `scheduler` are
    replica 0's (for code written against one engine); `replicas` holds every replica's parts."""

    def __init__(self, config: EngineConfig):
        n = config.mesh.data
        if config.mesh.disaggregated or n < 2:
            raise ValueError(
                f"mesh {config.mesh.describe()}: ReplicatedEngine runs 2 or more colocated replicas"
            )
        first = build_engine(config, 0)
        rest = [build_engine(config, i, tokenizer=first.tokenizer) for i in range(1, n)]
        self.replicas: list[EngineParts] = [first, *rest]
        self.cores: list[EngineCore] = [p.core for p in self.replicas]
        self._attach(config, first)
        self.load_seconds = sum(p.load_seconds for p in self.replicas)
        self.metrics = ReplicaMetrics([EngineMetrics() for _ in range(n)])
        for m, p in zip(self.metrics.replicas, self.replicas, strict=True):
            m.set_model_config(p.config_info)
        self.router = ReplicaRouter(
            n,
            RouterConfig(
                page_size=first.scheduler_config.page_size,
                max_imbalance_tokens=config.mesh.prefix_affinity_max_imbalance_tokens,
            ),
        )

    @property
    def step_times(self) -> StepTimes:
        """Every replica's host time by stage, summed (one thread runs them all in turn)."""
        total = StepTimes()
        for c in self.cores:
            for f in dataclasses.fields(StepTimes):
                setattr(total, f.name, getattr(total, f.name) + getattr(c.step_times, f.name))
        return total

    @property
    def step_shapes(self) -> StepShapes:
        """Every replica's step shapes, merged (each replica's own wall per step)."""
        return StepShapes.merged([c.step_shapes for c in self.cores])

    @property
    def num_recompiles(self) -> int:
        return sum(c.executor.num_recompiles for c in self.cores)

    def _parts_to_update(self) -> list[EngineParts]:
        return self.replicas

    def replica_of(self, request_id: str) -> int | None:
        """The replica serving a request (None once it finished, or if unknown)."""
        return self.router.owner(request_id)

    # ---- requests ---------------------------------------------------------------------------

    def _submit(self, request: EngineCoreRequest) -> None:
        ids = request.prompt_token_ids
        cost = min(len(ids) + request.params.max_tokens, self.max_model_len)
        replica = self.router.route(request.request_id, ids, cost)
        try:
            self.cores[replica].add_request(request)
        except BaseException:
            self.router.release(request.request_id)
            raise

    def abort(self, request_id: str) -> RequestOutput | None:
        replica = self.router.owner(request_id)
        if replica is None:
            return None
        finished = self.cores[replica].abort(request_id)
        self.router.release(request_id)
        if finished is None:
            return None
        self.metrics.replicas[replica].observe_finished(finished)
        return self.processor.finish(finished)

    def has_unfinished_requests(self) -> bool:
        return any(c.has_unfinished() for c in self.cores)

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration of every replica: all launch, then each is fetched and processed."""
        pending = [c.launch_step() for c in self.cores]
        outputs: list[RequestOutput] = []
        for i, (core, p) in enumerate(zip(self.cores, pending, strict=True)):
            outputs += self._process_replica(i, core.complete_step(p))
        return outputs

    def drain(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for i, core in enumerate(self.cores):
            outputs += self._process_replica(i, core.drain())
        return outputs

    def _process_replica(self, replica: int, outs: EngineCoreOutputs) -> list[RequestOutput]:
        core = self.cores[replica]
        outputs, ended = self.processor.process(outs)
        for request_id, reason in ended.items():  # stop strings, errors: the core finishes them
            finished = core.abort(request_id, reason)
            if finished is not None:
                outs.finished.append(finished)
                outputs.append(self.processor.finish(finished))
        for f in outs.finished:
            self.router.release(f.request_id)
        self.metrics.replicas[replica].observe(outs)
        return outputs
