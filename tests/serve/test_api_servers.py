"""`nori-jax serve --api-server-count 2`: two API server processes on one port and one engine
core (serve/api_servers.py), run as a user runs it.

Connections spread over both and every request gets its own tokens back; each API server's
/metrics is the whole engine's (API server 0's, also after the other restarted); a killed API
server is restarted while the other serves on; the
engine core's death fails the requests in flight on both and both serve again once it restarted;
SIGTERM stops every process and leaves no temporary directory behind. A weight operation sent to
either API server is answered to that one, and sleeps or wakes the one engine for both; a core
restarted after a sleep through API server 1 comes back asleep.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

PROMPT = [5, 6, 7, 8]
HANG_TIMEOUT_S = 5  # an API server without a heartbeat this long is killed and restarted
GREEDY = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> dict[int, str]:
    """Child process ids of `pid` and their command lines."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            for child in f.read().split():
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as c:
                        out[int(child)] = c.read().replace(b"\0", b" ").decode()
                except OSError:
                    pass
    return out


def _child(pid: int, marker: str) -> int:
    return next(c for c, cmd in _children(pid).items() if marker in cmd)


def _health_by_server(url: str, tries: int = 40) -> dict[str, int]:
    """Status code of /health by the API server that answered, over fresh connections."""
    seen: dict[str, int] = {}
    for _ in range(tries):
        try:
            r = httpx.get(f"{url}/health", timeout=5)
        except httpx.TransportError:
            continue
        seen[r.headers.get("x-nori-api-server", "?")] = r.status_code
        if len(seen) == 2:
            break
    return seen


def _wait_both_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _health_by_server(url) != {"0": 200, "1": 200}:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)


def _start(tmp: Path) -> tuple[str, subprocess.Popen, Path]:
    port = _free_port()
    exe = shutil.which("nori-jax") or str(Path(sys.executable).with_name("nori-jax"))
    cmd = [exe, "serve", "--config", "tiny-cpu", "--port", str(port), "--api-server-count", "2"]
    cmd += ["--max-num-waiting", "64", "--no-access-log", "--enable-weight-control"]
    cmd += ["--api-server-hang-timeout", str(HANG_TIMEOUT_S)]
    log = tmp / "server.log"
    (tmp / "tmp").mkdir()  # its temporary files (the sockets' directories) go here
    env = os.environ | {"TMPDIR": str(tmp / "tmp")}
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    _wait_both_healthy(url, proc, log, 180)
    return url, proc, log


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    url, proc, log = _start(tmp_path_factory.mktemp("api-servers"))
    yield url, proc, log
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _generate(url: str, stream: bool = False) -> tuple[str, list[int]]:
    """(the API server that answered, the tokens), on a connection of its own."""
    with httpx.Client(base_url=url, timeout=60) as c:
        if not stream:
            r = c.post("/generate", json=GREEDY)
            assert r.status_code == 200, r.text
            return r.headers["x-nori-api-server"], r.json()["token_ids"]
        with c.stream("POST", "/generate", json=GREEDY | {"stream": True}) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
            return r.headers["x-nori-api-server"], [t for x in lines for t in x["token_ids"]]


def test_connections_spread_over_both_and_each_gets_its_own_tokens(served) -> None:
    url, _, _ = served
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: _generate(url, stream=i % 2 == 1), range(32)))
    assert {server for server, _ in results} == {"0", "1"}
    tokens = {tuple(t) for _, t in results}
    assert len(tokens) == 1 and len(next(iter(tokens))) == 12


def _metrics_by_server(url: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for _ in range(40):
        with httpx.Client(base_url=url, timeout=10) as c:
            r = c.get("/metrics")
        values = {}
        for line in r.text.splitlines():
            if line.startswith(("nori:generation_tokens_total", "nori:request_success_total")):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        out[r.headers["x-nori-api-server"]] = values
        if len(out) == 2:
            break
    return out


def test_each_api_servers_metrics_are_the_whole_engines(served) -> None:
    url, _, _ = served
    before = _metrics_by_server(url)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        served_by = set(pool.map(lambda _: _generate(url)[0], range(16)))
    assert served_by == {"0", "1"}
    time.sleep(0.5)  # the last step's stats reach both servers
    after = _metrics_by_server(url)
    assert after["0"] == after["1"]
    done = 'nori:request_success_total{finished_reason="length"}'
    assert after["0"][done] - before["0"][done] == 16
    assert after["0"]["nori:generation_tokens_total"] - before["0"][
        "nori:generation_tokens_total"
    ] == pytest.approx(16 * 12)


def test_a_killed_api_server_is_restarted_while_the_other_serves(served) -> None:
    url, proc, log = served
    old = _child(proc.pid, "serve.api_servers")
    os.kill(old, signal.SIGKILL)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # meanwhile: served by API server 0
        results = list(pool.map(lambda _: _generate(url), range(8)))
    assert {t for _, t in ((s, tuple(t)) for s, t in results)} == {tuple(results[0][1])}
    _wait_both_healthy(url, proc, log, 120)
    assert _child(proc.pid, "serve.api_servers") != old
    assert "API server 1 (process" in log.read_text()
    # The restarted one's own counters start at 0; it answers /metrics with API server 0's, so a
    # scraper on the port sees one series, not two that jump back and forth.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert set(pool.map(lambda _: _generate(url)[0], range(16))) == {"0", "1"}
    time.sleep(0.5)  # the last step's stats reach both servers
    after = _metrics_by_server(url)
    assert after["0"] == after["1"] and after["0"]
    sources = set()
    for _ in range(40):
        r = httpx.get(f"{url}/metrics", timeout=10)
        sources.add((r.headers["x-nori-api-server"], r.headers.get("x-nori-metrics-source")))
        if len(sources) == 2:
            break
    assert sources == {("0", None), ("1", "api-server-0")}


def test_a_stopped_api_server_is_killed_and_restarted(served) -> None:
    """SIGSTOP: the process lives but runs nothing, and the kernel still hands it connections on
    the shared port, which would wait for it for ever. Its heartbeat stops, so API server 0 kills
    it after the hang timeout and starts another; API server 0 serves throughout."""
    url, proc, log = served
    stopped = _child(proc.pid, "serve.api_servers")
    os.kill(stopped, signal.SIGSTOP)
    started = time.monotonic()
    served_meanwhile = set()
    try:
        while _state(stopped) not in ("gone", "Z"):
            assert time.monotonic() - started < HANG_TIMEOUT_S + 30, log.read_text()[-3000:]
            try:  # a connection the kernel hands the stopped server waits, then is reset
                r = httpx.get(f"{url}/health", timeout=1.0)
                served_meanwhile.add((r.headers["x-nori-api-server"], r.status_code))
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone: killed, as it should be
            os.kill(stopped, signal.SIGCONT)
    assert time.monotonic() - started >= HANG_TIMEOUT_S - 1.5  # not before its timeout
    assert ("0", 200) in served_meanwhile
    _wait_both_healthy(url, proc, log, 120)
    assert _child(proc.pid, "serve.api_servers") != stopped
    assert "has not run its event loop" in log.read_text()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _generate(url), range(8)))
    assert {tuple(t) for _, t in results} == {tuple(results[0][1])}


def test_engine_core_death_fails_requests_on_both_and_both_recover(served) -> None:
    url, proc, log = served
    expected = _generate(url)[1]
    body = {"prompt": "doomed", "max_tokens": 240, "ignore_eos": True, "stream": True}
    results: list[tuple[str, list[str]]] = []
    serving: set[str] = set()  # the API servers streaming so far
    first = threading.Semaphore(0)

    def streamed() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                for line in r.iter_lines():
                    if line:
                        if not lines:
                            serving.add(r.headers["x-nori-api-server"])
                            first.release()
                        lines.append(line)
                results.append((r.headers["x-nori-api-server"], lines))

    jobs = [threading.Thread(target=streamed) for _ in range(8)]
    for t in jobs:
        t.start()
    for _ in jobs:
        assert first.acquire(timeout=60)
    # The kernel spreads connections over the servers, all 8 on one now and then: more until
    # both stream.
    while len(serving) < 2 and len(jobs) < 64:
        jobs.append(threading.Thread(target=streamed))
        jobs[-1].start()
        assert first.acquire(timeout=60)
    core = _child(proc.pid, "engine_core_process")
    os.kill(core, signal.SIGKILL)
    for t in jobs:
        t.join(60)
        assert not t.is_alive()
    assert {server for server, _ in results} == {"0", "1"}
    for _, lines in results:
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "engine_dead"
    _wait_both_healthy(url, proc, log, 120)
    assert _child(proc.pid, "engine_core_process") != core
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        after = list(pool.map(lambda _: _generate(url), range(16)))
    assert {s for s, _ in after} == {"0", "1"} and all(t == expected for _, t in after)


def _by_server(url: str, method: str, path: str) -> dict[str, httpx.Response]:
    """The answer of each API server to the same call, over fresh connections (both must have
    answered)."""
    seen: dict[str, httpx.Response] = {}
    for _ in range(60):
        r = httpx.request(method, f"{url}{path}", timeout=30)
        seen.setdefault(r.headers["x-nori-api-server"], r)
        if len(seen) == 2:
            return seen
    raise AssertionError(f"one API server never answered {path}: {sorted(seen)}")


def test_weight_control_through_either_api_server(served) -> None:
    url, _, _ = served
    _, before = _generate(url)
    awake = _by_server(url, "GET", "/is_sleeping")
    assert {k: r.json() for k, r in awake.items()} == {
        "0": {"is_sleeping": False},
        "1": {"is_sleeping": False},
    }
    r = httpx.post(f"{url}/sleep", timeout=60)
    assert r.status_code == 200 and r.json() == {"is_sleeping": True}, r.text
    asleep = _by_server(url, "GET", "/is_sleeping")
    assert {k: r.json()["is_sleeping"] for k, r in asleep.items()} == {"0": True, "1": True}
    woken = _by_server(url, "POST", "/wake_up")  # the first call wakes it; the other's: 400
    assert sorted(r.status_code for r in woken.values()) == [200, 400], woken
    assert sorted(r.status_code for r in _by_server(url, "POST", "/wake_up").values()) == [400, 400]
    assert _generate(url)[1] == before


def _client_of(url: str, server: str) -> httpx.Client:
    """A keep-alive connection the kernel gave to API server `server`."""
    for _ in range(60):
        c = httpx.Client(base_url=url, timeout=60)
        if c.get("/health").headers["x-nori-api-server"] == server:
            return c
        c.close()
    raise AssertionError(f"no connection reached API server {server}")


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_a_sleep_through_api_server_1_survives_a_core_restart(served) -> None:
    """API server 0 restarts the core and brings the new one to the state the weight operations
    left (core_client._replay_weight_state), and exports the metrics: it hears of the operations
    sent through API server 1 too. Before, a core restarted after a sleep through API server 1
    came back awake, and /metrics said the engine was awake throughout."""
    url, proc, log = served
    expected = _generate(url)[1]
    with contextlib.closing(_client_of(url, "1")) as c:
        r = c.post("/sleep", params={"level": 1})
        assert r.status_code == 200 and r.json() == {"is_sleeping": True}, r.text
    time.sleep(0.3)  # API server 0's reader takes the relayed answer
    assert _metric(url, "nori:engine_sleeping") == 1
    core = _child(proc.pid, "engine_core_process")
    os.kill(core, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while next(
        (c for c, cmd in _children(proc.pid).items() if "engine_core_process" in cmd), core
    ) == core or _health_by_server(url) != {"0": 200, "1": 200}:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)
    assert "the new engine core replayed sleep" in log.read_text()
    asleep = _by_server(url, "GET", "/is_sleeping")
    assert {k: r.json()["is_sleeping"] for k, r in asleep.items()} == {"0": True, "1": True}
    assert _metric(url, "nori:engine_sleeping") == 1
    with contextlib.closing(_client_of(url, "1")) as c:
        assert c.post("/wake_up").status_code == 200
    time.sleep(0.3)
    assert _metric(url, "nori:engine_sleeping") == 0
    assert _generate(url)[1] == expected


def test_sigterm_stops_every_process(served) -> None:
    _, proc, log = served
    children = list(_children(proc.pid))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{c}") and _state(c) != "Z" for c in children):
        assert time.monotonic() < deadline, [(c, _state(c)) for c in children]
        time.sleep(0.1)
    assert not list((log.parent / "tmp").iterdir())  # no sockets' directory left behind


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_nothing_outlives_a_killed_server(tmp_path) -> None:
    """API server 0 killed outright (no drain): the engine core and the other API server notice
    their parent is gone and exit, so no process keeps the device or the port."""
    url, proc, log = _start(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # in flight when the kill comes
        pending = [pool.submit(_generate, url) for _ in range(4)]
        children = list(_children(proc.pid))
        proc.kill()
        proc.wait()
        for f in pending:
            try:
                f.result(timeout=60)
            except Exception:  # noqa: BLE001 - their server was killed: any end is fine
                pass
    deadline = time.monotonic() + 20
    while any(_state(c) not in ("gone", "Z") for c in children):
        assert time.monotonic() < deadline, [(c, _state(c)) for c in children]
        time.sleep(0.1)


def test_an_api_server_in_a_crash_loop_is_given_up(monkeypatch) -> None:
    """One that dies again and again is restarted MAX_RESTARTS times, then left down (the others
    serve on), as the engine core is. Each exit releases its requests in the core at once, before
    any restart (they held the engine until the successor's hello, seconds later)."""
    from types import SimpleNamespace

    from nori_jax.engine_config import EngineConfig
    from serve import api_servers
    from serve.settings import ServerSettings

    monkeypatch.setattr(api_servers, "_RESTART_DELAY_S", 0.0)
    servers = api_servers.ApiServers(
        2, EngineConfig(), ServerSettings(model_name="m"), ("127.0.0.1", 1), "/tmp", "info", False
    )
    spawned = []
    events: list[str] = []

    def spawn(index: int) -> None:  # a process that has already exited
        spawned.append(index)
        events.append(f"spawn {index}")
        servers._procs[index] = SimpleNamespace(
            pid=1000 + len(spawned), returncode=1, poll=lambda: 1
        )

    monkeypatch.setattr(servers, "_spawn", spawn)
    released: list[int] = []

    def release(index: int) -> None:  # EngineCoreClient.release_client: a ClientReset
        released.append(index)
        events.append(f"release {index}")

    servers.on_exit = release
    servers.start()
    deadline = time.monotonic() + 10
    while servers._procs and time.monotonic() < deadline:
        time.sleep(0.05)
    servers.terminate()
    assert spawned == [1] * (1 + api_servers.MAX_RESTARTS)
    assert servers.num_restarts == api_servers.MAX_RESTARTS and not servers._procs
    assert events == ["spawn 1", "release 1"] * (1 + api_servers.MAX_RESTARTS)
