"""Run a loaded model directly over a paged KV cache, one sequence at a time (test helper)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nori_jax.executor.kv_cache import allocate_kv_pages
from nori_jax.executor.mesh import make_mesh
from nori_jax.mesh_config import MeshConfig
from nori_jax.models.llama import AttentionInputs
from nori_jax.weights.loader import LoadedModel, load_model


def load(path, backend: str = "reference", dtype: str = "float32") -> LoadedModel:
    return load_model(
        str(path), dtype=dtype, mesh=make_mesh(MeshConfig()), attention_backend=backend
    )


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(
    graphdef,
    state,
    kv_pages,
    input_ids,
    positions,
    slot_mapping,
    kv_lens,
    page_table,
    cu_q_lens,
    distribution,
):
    model = nnx.merge(graphdef, state)
    meta = AttentionInputs(slot_mapping, kv_lens, page_table, cu_q_lens, distribution)
    hidden, kv_pages = model(input_ids, positions, kv_pages, meta)
    return model.compute_logits(hidden), kv_pages


class PagedSequence:
    """One sequence in its own KV pool, fed chunk by chunk; returns logits of every fed token."""

    def __init__(self, loaded: LoadedModel, page_size: int = 16, max_len: int = 256, seed: int = 0):
        self.loaded = loaded
        self.page_size = page_size
        num_pages = max_len // page_size + 2
        self.kv = allocate_kv_pages(
            loaded.config, num_pages, page_size, loaded.dtype, make_mesh(MeshConfig())
        )
        # A shuffled page table, so the test exercises real paging, not contiguous memory.
        self.pages = (
            np.random.default_rng(seed).permutation(np.arange(1, num_pages)).astype(np.int32)
        )
        self.length = 0

    def feed(self, token_ids: list[int]) -> np.ndarray:
        n, ps, start = len(token_ids), self.page_size, self.length
        pos = np.arange(start, start + n, dtype=np.int32)
        logits, self.kv = _forward(
            self.loaded.graphdef,
            self.loaded.state,
            self.kv,
            jnp.asarray(token_ids, jnp.int32),
            jnp.asarray(pos),
            jnp.asarray(self.pages[pos // ps] * ps + pos % ps),
            jnp.asarray([start + n], jnp.int32),
            jnp.asarray(self.pages[None, :]),
            jnp.asarray([0, n], jnp.int32),
            jnp.asarray([1 if n == 1 else 0, 1], jnp.int32),
        )
        self.length += n
        return np.asarray(logits)


def hf_logits(path, token_ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            gen = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                min_new_tokens=max_new_tokens,
                pad_token_id=0,
                eos_token_id=None,
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs
