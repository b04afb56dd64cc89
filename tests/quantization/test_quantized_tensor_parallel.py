"""Quantized weights under 2-way tensor parallelism: shards of values and scales split like the
float layout, and the same greedy tokens as float32 on one device.

Runs in a subprocess because the CPU device count is fixed when JAX starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from cpu_devices import cpu_devices_env

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import jax
    sys.path.insert(0, sys.argv[2])
    from lookup_model import write_lookup_model
    from nori_jax import LLM, MeshConfig, SamplingParams
    path = Path(sys.argv[1])
    write_lookup_model(path)
    kw = dict(dtype="float32", page_size=16, num_pages=32, max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=96, param_cache=False)
    prompts = [[5, 17, 33, 101, 7], list(range(40, 70))]
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out = {"single": [o.token_ids for o in LLM(str(path), **kw).generate(prompts, p)],
           "devices": len(jax.devices())}
    for mode in ("int4", "fp8"):
        llm = LLM(str(path), quantization=mode, mesh=MeshConfig(model=2), **kw)
        layer = llm.engine.model.state["layers"][0]
        specs = {}
        for part, name in (("self_attn", "qkv_proj"), ("mlp", "down_proj")):
            for leaf in ("qvalue", "scale"):
                x = layer[part][name][leaf].get_value()
                specs[f"{name}.{leaf}"] = [list(x.sharding.spec), len(x.sharding.device_set),
                                           list(x.addressable_shards[0].data.shape)]
        out[mode] = {"tokens": [o.token_ids for o in llm.generate(prompts, p)], "specs": specs,
                     "recompiles": llm.engine.num_recompiles}
    print(json.dumps(out))
    """
)


def test_two_way_tensor_parallel_quantized_matches_float32(tmp_path):
    env = cpu_devices_env(2)
    here = os.path.dirname(__file__)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "lookup"), here],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    for mode in ("int4", "fp8"):
        r = result[mode]
        assert r["tokens"] == result["single"] and r["recompiles"] == 0
        s = r["specs"]
        # qkv_proj [128 + 2 x 64 out, 128 in] splits its outputs (one kv head's group per
        # device); down_proj [128 out, 256 in] its inputs
        assert s["qkv_proj.qvalue"] == [["model", None], 2, [128, 128]]
        assert s["qkv_proj.scale"][0] == ["model", None]
        assert s["down_proj.qvalue"] == [[None, "model"], 2, [128, 128]]
    # int4's two groups of down_proj go one to each shard; fp8's one scale per channel is whole
    assert result["int4"]["specs"]["down_proj.scale"] == [
        [None, "model"],
        2,
        [128, 1],
    ]
    assert result["fp8"]["specs"]["down_proj.scale"][2] == [128, 1]
    assert "model" not in result["fp8"]["specs"]["down_proj.scale"][0]  # replicated
