"""Tensor parallelism is configuration: a 2-way `model` mesh gives the single-device tokens.

Runs in a subprocess because the CPU device count is fixed when JAX starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    from nori_jax import LLM, MeshConfig, SamplingParams
    path = sys.argv[1]
    kw = dict(dtype="float32", page_size=16, num_pages=32, max_num_seqs=4,
              max_num_batched_tokens=32,
              max_model_len=128)
    prompts = [[5, 17, 33, 101, 7], list(range(40, 70))]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    single = [o.token_ids for o in LLM(path, **kw).generate(prompts, p)]
    tp = LLM(path, mesh=MeshConfig(model=2), **kw)
    sharded = [o.token_ids for o in tp.generate(prompts, p)]
    q = tp.engine.model.state["layers"][0]["self_attn"]["q_proj"].get_value()
    kv = tp.engine.runner.kv_pages[0]
    print(json.dumps({"single": single, "tp": sharded, "devices": len(jax.devices()),
                      "q_shards": len(q.sharding.device_set), "q_spec": str(q.sharding.spec),
                      "kv_spec": str(kv.sharding.spec)}))
    """
)


def test_two_way_tensor_parallel_matches_single_device(hf_checkpoints, tmp_path):
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(hf_checkpoints["llama"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    assert result["q_shards"] == 2 and "model" in result["q_spec"]
    assert "model" in result["kv_spec"]  # KV pages split by kv head
    assert result["tp"] == result["single"]
