"""One calibrated engine, one workload: simulated runs at any offered rate.

The glue between the CLI and the simulator: the calibration's engine with the what-ifs applied
(`whatif.py`), the workload drawn once (`workload.py`), and `run_at(rate)`, which serves it on a
fresh simulated engine (or a prefill/decode pair of engine pools, `disaggregation.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from nori_jax.bench.config import GOODPUT_NAMES
from nori_jax.bench.offline import OfflineConfig
from nori_jax.bench.run import RunResult
from nori_jax.plan.calibration import Calibration, KVTransfer
from nori_jax.plan.core_io import CoreIO
from nori_jax.plan.disaggregation import Side, simulate_disaggregated
from nori_jax.plan.simulator import Frontend, simulate
from nori_jax.plan.whatif import WhatIf, sim_engine
from nori_jax.plan.workload import at_rate, draw


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    shaping: OfflineConfig  # the workload and its shapers (shared prefix, long prompts)
    whatif: WhatIf = WhatIf()
    percentiles: tuple[float, ...] = (99.0,)
    goodput_slos_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)
    frontend: Frontend = Frontend()
    # The core's send path per step: None takes the calibration's for frontend.servers API
    # servers (zero where the file has none).
    core_io: CoreIO | None = None
    # (step_s, row_s) given over core_io (or the calibration's): None keeps that part.
    core_io_parts: tuple[float | None, float | None] = (None, None)
    disaggregate: tuple[int, int] | None = None  # (prefill replicas, decode replicas)
    kv_transfer: KVTransfer | None = None  # None: the calibration's measured one
    # (bytes_per_s, latency_s) given over kv_transfer (or the calibration's): None keeps that
    # part (a latency with no transfer to take the bandwidth from is an error; none: 0).
    kv_transfer_parts: tuple[float | None, float | None] = (None, None)

    def __post_init__(self) -> None:
        if self.disaggregate is not None and min(self.disaggregate) < 1:
            raise ValueError(f"disaggregate wants P:D with P, D >= 1, got {self.disaggregate}")
        for p in self.percentiles:
            if not 0 < p < 100:
                raise ValueError(f"percentiles must be in (0, 100), got {p}")
        for name, ms in self.goodput_slos_ms.items():
            if name not in GOODPUT_NAMES or not ms >= 0:
                raise ValueError(f"goodput wants NAME:MS with NAME in {GOODPUT_NAMES}, got {name}")


@dataclasses.dataclass
class Outcome:
    run: RunResult
    summary: dict[str, Any]  # what the simulated engine did (SimStats.summary and more)


class Planner:
    def __init__(self, cal: Calibration, settings: PlanSettings):
        self.cal, self.settings = cal, settings
        self.engine, self.warnings = sim_engine(cal, settings.whatif)
        if cal.derived:
            self.warnings.insert(0, f"{cal.path or 'the calibration'} is derived: {cal.source}")
        scfg = self.engine.scheduler
        self.drawn = draw(settings.shaping, self.engine.vocab_size, scfg.max_model_len)
        self.core_io = settings.core_io
        step_s, row_s = settings.core_io_parts
        if self.core_io is None:
            servers = settings.frontend.servers
            self.core_io = cal.core_io.get(servers, CoreIO())
            if cal.core_io and servers not in cal.core_io and (step_s is None or row_s is None):
                self.warnings.append(
                    f"{cal.path or 'the calibration'} has the core's send path for "
                    f"{sorted(cal.core_io)} API servers, not {servers}: it is left out "
                    "(--core-io-us-per-step/-row give it)"
                )
        self.core_io = CoreIO(
            self.core_io.step_s if step_s is None else step_s,
            self.core_io.row_s if row_s is None else row_s,
        )
        self.transfer = None
        if settings.disaggregate is not None:
            base = settings.kv_transfer or cal.kv_transfer
            bytes_per_s, latency_s = settings.kv_transfer_parts
            if base is None and bytes_per_s is None:
                raise ValueError(
                    f"disaggregation needs a KV transfer cost: {cal.path or 'the calibration'} "
                    "has none; pass --kv-transfer-gbps (and --kv-transfer-latency-ms)"
                )
            if base is None:
                base = KVTransfer(bytes_per_s, 0.0, "given")
            if bytes_per_s is not None or latency_s is not None:
                base = KVTransfer(
                    base.bytes_per_s if bytes_per_s is None else bytes_per_s,
                    base.latency_s if latency_s is None else latency_s,
                    "given",
                )
            self.transfer = base

    @property
    def gpus(self) -> int:
        """GPUs of one replica (of a prefill + decode set when disaggregated)."""
        per = self.cal.key.tp
        return per * sum(self.settings.disaggregate) if self.settings.disaggregate else per

    @property
    def tokens_per_request(self) -> tuple[float, float]:
        """Mean (input + output, output) tokens of the workload's requests."""
        n = len(self.drawn.prompts)
        return self.drawn.num_tokens / n, sum(self.drawn.output_lens) / n

    def run_at(self, rate: float) -> Outcome:
        s = self.settings
        requests = at_rate(self.drawn, s.shaping.workload, rate)
        t0 = time.perf_counter()
        if s.disaggregate is None:
            res = simulate(
                self.engine,
                self.cal.costs,
                requests,
                request_rate=rate,
                percentiles=s.percentiles,
                goodput_slos_ms=s.goodput_slos_ms,
                frontend=s.frontend,
                core_io=self.core_io,
                feature_max=self.cal.feature_max,
            )
            summary = res.stats.summary()
            run = res.run
        else:
            p, d = s.disaggregate
            res = simulate_disaggregated(
                Side(self.engine, self.cal.costs, p),
                Side(self.engine, self.cal.costs, d),
                requests,
                self.transfer,
                self.cal.engine.kv_bytes_per_token,
                request_rate=rate,
                percentiles=s.percentiles,
                goodput_slos_ms=s.goodput_slos_ms,
                frontend=s.frontend,
            )
            run = res.run
            summary = {
                "prefill_steps": sum(st.steps for st in res.prefill),
                "decode_steps": sum(st.steps for st in res.decode),
                "num_preemptions": sum(st.num_preemptions for st in res.prefill + res.decode),
                "kv_recomputed": res.kv_recomputed,
                "mean_kv_transfer_ms": 1e3 * res.mean_transfer_s,
            }
        summary["compute_s"] = time.perf_counter() - t0
        return Outcome(run, summary)
