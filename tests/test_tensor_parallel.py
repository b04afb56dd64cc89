"""Tensor parallelism is configuration: on 2, 4 and 8 CPU devices the engine gives the one-device
tokens, with the reference attention and with the Pallas kernel (interpret mode) under shard_map,
kv heads split or replicated, two all-reduces per layer and no recompiles.

One subprocess (tests/tp_layouts.py) builds every engine on an 8-device CPU mesh, because the
device count is fixed when JAX starts; the tests below read its report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cpu_devices import cpu_devices_env

SCRIPT = Path(__file__).with_name("tp_layouts.py")
NUM_LAYERS = 2  # of the tp model and of qwen2 (tests/conftest.py)


@pytest.fixture(scope="module")
def report(tp_checkpoint, kernel_tp_checkpoint, hf_checkpoints) -> dict:
    env = cpu_devices_env(8)
    args = [str(tp_checkpoint), str(kernel_tp_checkpoint), str(hf_checkpoints["qwen2"])]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    return result


def test_greedy_tokens_match_one_device_for_tp_2_4_8(report):
    engines = report["engines"]
    single = engines["reference tp1"]["tokens"]
    assert len(single) == 2 and all(len(t) == 6 for t in single)
    for tp in (2, 4, 8):  # asked for as tensor_parallel_size=2, mesh="tp4", MeshConfig(model=8)
        assert engines[f"reference tp{tp}"]["mesh"] == tp
        assert engines[f"reference tp{tp}"]["tokens"] == single, f"tp{tp}"
    # MQA with qkv bias: the single kv head and its bias replicated on 4 devices.
    assert engines["qwen2 tp4"]["tokens"] == engines["qwen2 tp1"]["tokens"]
    # stack_weights: the stacked matrices keep their rows' sharding (checked after new weights
    # too), and the tokens are the same
    stacked = engines["reference tp4 stacked"]
    assert stacked["tokens"] == single and stacked["recompiles"] == 0
    assert stacked["proj_specs"] == engines["reference tp4"]["proj_specs"]
    assert stacked["updated_tokens"] == engines["reference tp1"]["updated_tokens"]
    assert "P(None, None, 'model')" in stacked["param_specs"]  # e.g. the q/k/v stack


def test_new_weights_on_a_mesh_match_one_device(report):
    """update_weights places each new array on the sharding of the one it replaces (kv heads
    split or replicated): the one-device tokens on the same new weights, the projections'
    shardings unchanged (checked in the subprocess), no recompiles."""
    engines = report["engines"]
    single = engines["reference tp1"]["updated_tokens"]
    assert single != engines["reference tp1"]["tokens"]
    for tp in (2, 4, 8):
        assert engines[f"reference tp{tp}"]["updated_tokens"] == single, f"tp{tp}"
    qwen2 = engines["qwen2 tp1"]["updated_tokens"]
    assert engines["qwen2 tp4"]["updated_tokens"] == qwen2 != engines["qwen2 tp1"]["tokens"]


def test_penalties_and_prompt_logprobs_match_one_device(report):
    """The per-slot penalty tables and the prompt-logprob rows on a mesh (replicated, like the
    logits): the same tokens and prompt logprobs as on one device."""
    engines = report["engines"]
    single = engines["reference tp1"]["scored"]
    assert single["tokens"] != engines["reference tp1"]["tokens"][0]  # the penalties acted
    for tp in (2, 4, 8):
        got = engines[f"reference tp{tp}"]["scored"]
        assert got["tokens"] == single["tokens"], f"tp{tp}"
        np.testing.assert_allclose(got["prompt_logprobs"], single["prompt_logprobs"], atol=1e-4)


def test_pallas_kernel_engine_under_shard_map_matches_one_device(report):
    """With an attention_tuning override, which reaches each device's interpreted kernel."""
    engines = report["engines"]
    pallas = engines["kernel-model pallas tp2"]
    assert pallas["tokens"] == engines["kernel-model reference tp1"]["tokens"]
    assert len(pallas["tokens"][0]) == 3
    assert pallas["kv_shard_shape"][1] == 1  # one of the two kv heads per device


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_pallas_attention_step_split_over_kv_heads(report, tp):
    """Each device runs the kernel on its heads and page slices: the same output and the same
    K/V in every stored copy of a kv head as the one-device step."""
    step = report["kernel_steps"][f"tp{tp}"]
    assert step["replicas"] == {2: 1, 4: 2, 8: 8}[tp]
    assert step["out_max_err"] < 1e-5
    assert step["pages_equal"]
    assert step["out_spec"] == "P(None, 'model', None)"


def test_kv_heads_split_or_replicated_on_the_pages(report):
    engines = report["engines"]
    for tp, heads in ((2, 4), (4, 4)):
        e = engines[f"reference tp{tp}"]
        assert e["kv_shape"][1] == heads and e["kv_shard_shape"][1] == heads // tp
        assert e["proj_specs"] == {"qkv_proj": "P(None, 'model')"}  # one fused, column-split
    # 4 kv heads on 8 devices: each stored twice, one per device; k/v projections replicated,
    # so q/k/v are not fused.
    e = engines["reference tp8"]
    assert e["kv_shape"][1] == 8 and e["kv_shard_shape"][1] == 1
    assert e["proj_specs"] == {"q_proj": "P(None, 'model')", "k_proj": "P(None, None)"}
    assert "model" in e["kv_spec"]


def test_two_all_reduces_per_layer(report):
    """The compiled forward pass of every tp > 1 layout: one all-reduce after o_proj and one
    after down_proj per layer, one for the vocab-split embedding lookup, one all-gather of the
    logits (where the runner asks for them replicated, before the greedy sampler reads them), and
    no other collective. tp 1 has none."""
    for name, e in report["engines"].items():
        layers = 1 if name.startswith("kernel-model") else NUM_LAYERS
        assert e["collectives"], f"{name}: no forward pass was inspected"
        for program, found in e["collectives"].items():
            if name.endswith("tp1"):
                assert found == {}, (name, program)
                continue
            assert found == {
                "all-reduce:o_proj": layers,
                "all-reduce:down_proj": layers,
                "all-reduce:gather": 1,
                "all-gather:sharding_constraint": 1,
            }, (name, program)


def test_no_recompiles_and_no_leaked_pages(report):
    for name, e in report["engines"].items():
        assert e["recompiles"] == 0, name
        assert e["kernel_programs_built"] == 0, name  # interpret-mode host programs too
        assert e["free_pages"] == e["num_pages"] - 1, name  # all but the null page
