"""Per-layer scales of fp8 KV pages, measured on the model itself (`calculate_kv_scales`).

With the default scale of 1.0 a stored fp8 value is the value itself: e4m3 then holds |x| <= 448
and resolves down to 2^-9. A model whose keys or values are larger saturates; one whose values are
small spends its 3 mantissa bits well but loses the subnormal range. Calibration runs one prefill
of a fixed English text through the model with pages in the model's dtype, takes each layer's
largest |K| and |V| and maps twice that onto the format's largest finite value. The factor of two
is headroom for prompts whose activations exceed the sample's: in a floating-point format it costs
one exponent step at the bottom of the range, nothing in the precision of the values that matter.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from nori_jax.executor import program_options
from nori_jax.executor.kv_cache import allocate_kv_pages
from nori_jax.models.llama import AttentionInputs
from nori_jax.weights.loader import LoadedModel
from pallas_kernels.kv_layout import K_INDEX, V_INDEX, calibrate_kv_scales

HEADROOM = 2.0
CALIBRATION_TOKENS = 512
# The opening of Jane Austen's "Pride and Prejudice" (1813, public domain): ordinary prose, not
# the text the accuracy benchmark scores (benchmarks/quality/perplexity.py).
CALIBRATION_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters. \u201cMy dear Mr. Bennet,\u201d said his lady to him one day, \u201chave "
    "you heard that Netherfield Park is let at last?\u201d Mr. Bennet replied that he had not. "
    "\u201cBut it is,\u201d returned she; \u201cfor Mrs. Long has just been here, and she told me "
    "all about it.\u201d Mr. Bennet made no answer. \u201cDo you not want to know who has taken "
    "it?\u201d cried his wife impatiently. \u201cYou want to tell me, and I have no objection to "
    "hearing it.\u201d This was invitation enough."
)


def calibration_token_ids(loaded: LoadedModel, n: int = CALIBRATION_TOKENS) -> list[int]:
    """The calibration text's tokens (repeated up to `n`), or seeded random ids for a model
    without a tokenizer (dummy weights)."""
    vocab = loaded.config.vocab_size
    n = min(n, loaded.config.position_limit)
    if loaded.tokenizer is not None:
        ids = loaded.tokenizer.encode(CALIBRATION_TEXT)
        ids = (ids * math.ceil(n / len(ids)))[:n]
    else:
        ids = np.random.default_rng(0).integers(1, vocab, n).tolist()
    return [i for i in ids if 0 <= i < vocab]


def measure_kv_scales(
    loaded: LoadedModel, mesh: Mesh, kv_dtype, token_ids: list[int], page_size: int = 16
) -> np.ndarray:
    """float32[num_layers, 2]: (k_scale, v_scale) per layer for pages of `kv_dtype` (fp8)."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("KV scale calibration needs at least one token")
    num_pages = math.ceil(n / page_size) + 1  # + the null page
    kv = allocate_kv_pages(loaded.config, num_pages, page_size, loaded.dtype, mesh)
    pages = np.arange(1, num_pages, dtype=np.int32)
    pos = np.arange(n, dtype=np.int32)

    @jax.jit
    def prefill(state, kv, ids):
        model = nnx.merge(loaded.graphdef, state)
        meta = AttentionInputs(
            slot_mapping=jnp.asarray(pages[pos // page_size] * page_size + pos % page_size),
            kv_lens=jnp.asarray([n], jnp.int32),
            page_table=jnp.asarray(pages[None, :]),
            cu_q_lens=jnp.asarray([0, n], jnp.int32),
            distribution=jnp.asarray([0, 1], jnp.int32),
        )
        _, kv = model(ids, jnp.asarray(pos), kv, meta)
        return jnp.stack(
            [
                calibrate_kv_scales(p[1:, :, K_INDEX], p[1:, :, V_INDEX], kv_dtype) * HEADROOM
                for p in kv
            ]
        )

    args = (loaded.state, kv, jnp.asarray(token_ids, jnp.int32))
    # the engine's XLA options for these weights (fp8: Triton's GEMMs off, program_options.py)
    options = program_options.for_weights(loaded.quantization)
    return np.asarray(prefill.lower(*args).compile(compiler_options=options)(*args), np.float32)
