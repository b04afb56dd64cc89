"""A multi-host engine on one machine: two processes joined by jax.distributed on 127.0.0.1, one
CPU device each, tensor parallel 2 across them (process 0 through `LLM(distributed=...)`, process
1 through the `nori-jax generate --process-id 1` command) gives the tokens of one process at
tp=1; process 0 stops its follower at exit; a follower killed mid-run fails process 0 with a
clear error within seconds.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from cpu_devices import cpu_devices_env

ENGINE = dict(
    dtype="float32",
    page_size=16,
    num_pages=32,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_model_len=128,
)
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
PROMPTS = [[5, 17, 33, 101, 7], list(range(40, 70))]

SINGLE = textwrap.dedent(
    f"""
    import json, sys
    from nori_jax import LLM, SamplingParams
    llm = LLM(sys.argv[1], **{ENGINE!r})
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    print(json.dumps([o.token_ids for o in llm.generate({PROMPTS!r}, p)]))
    """
)

LEADER = textwrap.dedent(
    f"""
    import json, os, sys, time
    from nori_jax import LLM, MeshConfig, SamplingParams
    from nori_jax.executor.step_broadcast import FollowerLost
    path, address, then = sys.argv[1:]
    llm = LLM(path, mesh=MeshConfig(model=2), **{ENGINE!r},
              distributed=dict(coordinator_address=address, num_processes=2, process_id=0))
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate({PROMPTS!r}, p)]
    print(json.dumps({{"tokens": tokens, "recompiles": llm.engine.num_recompiles}}), flush=True)
    if then == "keep-going":  # until the test kills the follower
        try:
            while True:
                llm.generate([[3, 4, 5]], SamplingParams(max_tokens=100, ignore_eos=True))
        except FollowerLost as e:
            print(json.dumps({{"lost": str(e), "at": time.time()}}), flush=True)
            os._exit(3)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
    return cpu_devices_env(devices)


def _pair(model: str, then: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    address = f"127.0.0.1:{_free_port()}"
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, model, address, then],
        env=_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    follower = subprocess.Popen(
        [sys.executable, "-m", "nori_jax.cli", "generate", "--model", model, "--tp", "2"]
        + FLAGS
        + ["--coordinator-address", address, "--num-processes", "2", "--process-id", "1"],
        env=_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return leader, follower


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"process did not exit within {timeout}s:\n{err[-3000:]}")


@pytest.fixture(scope="module")
def two_processes(hf_checkpoints):
    model = str(hf_checkpoints["llama"])
    single = subprocess.Popen(
        [sys.executable, "-c", SINGLE, model], env=_env(1), stdout=subprocess.PIPE, text=True
    )
    leader, follower = _pair(model, then="exit")
    leader_out, leader_err = _finish(leader, 400)
    follower_out, follower_err = _finish(follower, 60)
    single_out, _ = _finish(single, 400)
    return dict(
        model=model,
        single=json.loads(single_out.strip().splitlines()[-1]),
        leader=(leader.returncode, leader_out, leader_err),
        follower=(follower.returncode, follower_out, follower_err),
    )


def test_two_processes_at_tp2_give_the_tokens_of_one_at_tp1(two_processes):
    rc, out, err = two_processes["leader"]
    assert rc == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tokens"] == two_processes["single"]
    assert result["recompiles"] == 0


def test_the_follower_runs_the_steps_and_stops_when_process_0_exits(two_processes):
    rc, out, err = two_processes["follower"]
    assert rc == 0, err[-3000:]
    # A follower generates nothing itself (gloo announces its connection on stdout).
    assert [line for line in out.splitlines() if not line.startswith("[Gloo]")] == []
    assert "process 1: stopped after" in err
    assert "programs after warm-up" not in err


def test_a_killed_follower_fails_process_0_clearly_within_seconds(two_processes):
    leader, follower = _pair(two_processes["model"], then="keep-going")
    first = leader.stdout.readline()
    while first.startswith("[Gloo]"):  # gloo announces its connection on stdout
        first = leader.stdout.readline()
    # The first generation is done: steps are running.
    assert "tokens" in first, leader.stderr.read()[-3000:] if leader.poll() is not None else first
    time.sleep(0.5)
    follower.kill()
    killed = time.time()
    out, err = _finish(leader, 60)
    follower.communicate()
    assert leader.returncode == 3, err[-3000:]
    lost = json.loads(out.strip().splitlines()[-1])
    assert "follower process disconnected" in lost["lost"]
    assert lost["at"] - killed < 10
