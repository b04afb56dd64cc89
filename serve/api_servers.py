"""Several API server processes in front of one engine core: `nori-jax serve --api-server-count N`.

One API server process spends 25-40 us of CPU per streamed token (HTTP, SSE encoding,
detokenization, one GIL; measured on the 2-core CPU machine by
benchmarks/engine/api_server_bench.py), so it streams a few tens of thousands of tokens a second at
most, under what the engine core makes on a GPU. N processes share the work:

    nori-jax serve (API server 0) --- starts ---> engine-core process (one, as with N = 1)
          |  starts and watches                     ^  ZeroMQ: one socket pair per API server
          v                                         |
    API servers 1 .. N-1  (python -m serve.api_servers, each its own EngineCoreClient)

Each of the N binds its own socket to the port (SO_REUSEPORT): the kernel spreads connections
over them by their addresses, so a process cannot take a burst of them and keep them (clients
keep connections open). API server 0 owns the engine core as
with one server: it starts it, restarts it when it dies and stops it last. The others attach to it
(`EngineCoreClient(shared_core=...)`): each binds its own socket pair, which the core connects to,
and each request's tokens come back to the API server that sent it. Every API server gets every
step's finishes and stats, so /health answers for the whole engine whichever process a probe
reaches (`api_server` in /health's body says which one did), and /metrics is API server 0's
whichever process answers (serve/metrics_relay.py: a restarted one's own counters start at 0).

API server 0 restarts another that exits (it ends what the dead one had in flight in the core),
or that stopped running its event loop (no heartbeat for `--api-server-hang-timeout` seconds:
serve/heartbeat.py; it is killed first), up to 5 times in 10 minutes each, and ends with it: on
SIGTERM it passes the signal on, waits while the others drain, then drains and stops the core.
The others exit when API server 0 does (Linux's parent-death signal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from nori_jax.child_process import die_with_parent
from nori_jax.engine_config import EngineConfig
from serve import heartbeat
from serve.metrics_relay import metrics_address
from serve.settings import ServerSettings

logger = logging.getLogger(__name__)
_RESTART_DELAY_S = 1.0
# As for the engine core (core_client.py): an API server that dies this often is not restarted.
MAX_RESTARTS, RESTART_WINDOW_S = 5, 600.0


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What API server `index` (1..N-1) is started with (pickled on its stdin)."""

    index: int
    config: EngineConfig
    settings: ServerSettings
    input_addr: str  # its sockets to the engine core (it binds them)
    output_addr: str
    host: str  # where API server 0 listens: this one binds the same (SO_REUSEPORT)
    port: int
    log_level: str
    access_log: bool


def addresses(directory: str, index: int) -> tuple[str, str]:
    """API server `index`'s (input, output) socket addresses towards the engine core."""
    return f"ipc://{directory}/api-{index}-in", f"ipc://{directory}/api-{index}-out"


class ApiServers:
    """API servers 1..count-1, started and watched by API server 0 (this process)."""

    def __init__(
        self,
        count: int,
        config: EngineConfig,
        settings: ServerSettings,
        address: tuple[str, int],
        directory: str,
        log_level: str,
        access_log: bool,
    ):
        if count < 2:
            raise ValueError(f"api_server_count={count}: ApiServers runs servers 1 and up")
        self.count, self.config = count, config
        self.settings = dataclasses.replace(settings, metrics_from=metrics_address(directory))
        self.hang_timeout_s = settings.api_server_hang_timeout_s
        self._address, self._dir = address, directory
        self._level, self._access_log = log_level, access_log
        self._procs: dict[int, subprocess.Popen] = {}
        self._stopping = False
        self._lock = threading.Lock()
        self.num_restarts = 0
        self._restarts: dict[int, list[float]] = {}  # restart times by API server index
        self._watcher: threading.Thread | None = None
        # Called with the index of an API server whose process exited: its requests still in
        # the engine core end there at once (serve/cli.py: EngineCoreClient.release_client),
        # not at its successor's hello, seconds later (nor never, for one given up on); until
        # then they held the engine's rows and queue with no one to read them.
        self.on_exit: Callable[[int], None] | None = None

    @property
    def metrics_address(self) -> str:
        """Where API server 0 publishes /metrics for the others (serve/metrics_relay.py)."""
        return metrics_address(self._dir)

    @property
    def client_addresses(self) -> list[tuple[str, str]]:
        """The engine core's sockets towards API servers 1.. (EngineCoreClient's extra_clients)."""
        return [addresses(self._dir, i) for i in range(1, self.count)]

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for _, p in sorted(self._procs.items())]

    def start(self) -> None:
        """Start every other API server and a thread that restarts one that exits."""
        for i in range(1, self.count):
            self._spawn(i)
        self._watcher = threading.Thread(target=self._watch, name="nori-api-servers", daemon=True)
        self._watcher.start()

    def _heartbeat_path(self, index: int) -> str:
        return os.path.join(self._dir, f"api-{index}.alive")

    def _spawn(self, index: int) -> None:
        beat = self._heartbeat_path(index)
        with contextlib.suppress(FileNotFoundError):
            os.remove(beat)  # its predecessor's: the new one is judged from its own first beat
        spec = WorkerSpec(
            index,
            self.config,
            dataclasses.replace(self.settings, heartbeat_path=beat),
            *addresses(self._dir, index),
            *self._address,
            self._level,
            self._access_log,
        )
        proc = subprocess.Popen([sys.executable, "-m", "serve.api_servers"], stdin=subprocess.PIPE)
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.close()
        with self._lock:
            self._procs[index] = proc
        logger.info("API server %d running in process %d", index, proc.pid)

    def _kill_the_silent(self) -> None:
        """Kill an API server whose heartbeat stopped (serve/heartbeat.py): stopped or stuck, it
        still gets new connections on the port, which would wait for it for ever. Its exit is
        then handled as any other (its requests released, a restart)."""
        if self.hang_timeout_s is None:
            return
        with self._lock:
            running = [(i, p) for i, p in self._procs.items() if p.poll() is None]
        for i, p in running:
            age = heartbeat.age_s(self._heartbeat_path(i))
            if age is not None and age > self.hang_timeout_s:
                logger.error(
                    "API server %d (process %d) has not run its event loop for %.0f s (stopped "
                    "or stuck): killing it",
                    i,
                    p.pid,
                    age,
                )
                p.kill()

    def _watch(self) -> None:
        while not self._stopping:
            time.sleep(0.2)
            self._kill_the_silent()
            with self._lock:
                exited = [(i, p) for i, p in self._procs.items() if p.poll() is not None]
            for i, p in exited:
                if self._stopping:
                    return
                if self.on_exit is not None:
                    self.on_exit(i)
                now = time.monotonic()
                recent = [t for t in self._restarts.get(i, []) if now - t < RESTART_WINDOW_S]
                if len(recent) >= MAX_RESTARTS:  # a crash loop: the others serve on without it
                    logger.error(
                        "API server %d (process %d) exited with %s; not restarted: %d restarts "
                        "within %g s",
                        i,
                        p.pid,
                        p.returncode,
                        len(recent),
                        RESTART_WINDOW_S,
                    )
                    with self._lock:
                        del self._procs[i]
                    continue
                logger.error(
                    "API server %d (process %d) exited with %s; restarting it",
                    i,
                    p.pid,
                    p.returncode,
                )
                self._restarts[i] = [*recent, now]
                time.sleep(_RESTART_DELAY_S)
                if not self._stopping:
                    self._spawn(i)
                    self.num_restarts += 1

    def _snapshot(self) -> list[subprocess.Popen]:
        """The processes now running or last spawned (the restart thread may replace one)."""
        with self._lock:
            return list(self._procs.values())

    def terminate(self) -> None:
        """Ask every other API server to drain and exit (SIGTERM)."""
        self._stopping = True
        for p in self._snapshot():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> bool:
        """Wait for every other API server to exit; False if some still ran at the timeout."""
        deadline = time.monotonic() + timeout_s
        for p in self._snapshot():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill(self) -> None:
        """Kill those still running, then remove the sockets' directory (the last step)."""
        self._stopping = True
        for p in self._snapshot():
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def main() -> int:
    """API server `index` (1..N-1): attach to the engine core and serve on the shared port."""
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    die_with_parent(signal.SIGTERM)  # a drain, as for API server 0's own SIGTERM
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s api-server-{spec.index} %(name)s: %(message)s",
        force=True,
    )
    from nori_jax.core_client import EngineCoreClient
    from serve.cli import bind, serve_http

    engine = EngineCoreClient(
        spec.config, shared_core=(spec.input_addr, spec.output_addr, spec.index)
    )
    sock = bind(spec.host, spec.port, reuse_port=True)
    settings = dataclasses.replace(spec.settings, api_server=spec.index)
    return serve_http(engine, settings, sock, spec.log_level, spec.access_log)


if __name__ == "__main__":
    sys.exit(main())
