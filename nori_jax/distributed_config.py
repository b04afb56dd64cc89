"""One engine over several processes (hosts): which process this is and where they meet.

JAX-free, so configs and the CLI load without JAX (`executor/distributed.py` joins JAX's
distributed runtime with these values). Every process runs the same command with its own
`--process-id`: process 0 runs the coordinator, schedules and serves; the others execute the
steps process 0 sends them (docs/mesh.md, "Multi-host").
"""

from __future__ import annotations

import dataclasses

from nori_jax.config_field import check_types, option


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = option(
        None,
        help="multi-host: HOST:PORT of process 0, where JAX's coordinator listens (every "
        "process gives the same one)",
        flags=("--coordinator-address",),
    )
    num_processes: int = option(
        1, help="multi-host: processes of the one engine (1: a single process)"
    )
    process_id: int = option(
        0, help="multi-host: this process's id; 0 schedules and serves, the others follow"
    )
    step_timeout_s: float = option(
        120.0,
        help="multi-host: seconds process 0 waits for every follower to finish a step before "
        "it fails the engine (a dead follower is noticed within seconds anyway)",
    )
    init_timeout_s: int = option(
        300, help="multi-host: seconds a process waits for all the others to join at start-up"
    )

    def __post_init__(self) -> None:
        check_types(self, prefix="distributed ")
        n, i = self.num_processes, self.process_id
        for name, value, low in (("num_processes", n, 1), ("process_id", i, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"distributed {name}={value!r} must be an integer >= {low}")
        if i >= n:
            raise ValueError(f"distributed process_id={i} must be < num_processes={n}")
        if n > 1:
            host, sep, port = (self.coordinator_address or "").rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"distributed coordinator_address={self.coordinator_address!r} must be "
                    f"HOST:PORT when num_processes={n}"
                )
        if not self.step_timeout_s > 0:
            raise ValueError(f"distributed step_timeout_s={self.step_timeout_s} must be > 0")
        if not isinstance(self.init_timeout_s, int) or self.init_timeout_s < 1:
            raise ValueError(f"distributed init_timeout_s={self.init_timeout_s!r} must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def coordinator_host(self) -> str:
        assert self.coordinator_address is not None
        return self.coordinator_address.rpartition(":")[0].strip("[]")
