"""Random ragged steps for the attention kernel tests: permuted page tables, padded S and T."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def abstract_args(
    *,
    tokens,
    pages,
    seqs,
    pages_per_seq,
    head_dim,
    q_heads=32,
    kv_heads=8,
    kv_dtype=jnp.bfloat16,
    page_size=16,
):
    """The kernel's positional arguments as ShapeDtypeStructs (bf16 q), for tracing and
    lowering without data."""
    sds = jax.ShapeDtypeStruct
    return (
        sds((tokens, q_heads, head_dim), jnp.bfloat16),
        sds((pages, kv_heads, 2, page_size, head_dim), kv_dtype),
        sds((seqs,), jnp.int32),
        sds((seqs, pages_per_seq), jnp.int32),
        sds((seqs + 1,), jnp.int32),
        sds((2,), jnp.int32),
    )


@dataclasses.dataclass(frozen=True)
class Step:
    q: jnp.ndarray  # [T, Hq, D]
    kv_pages: jnp.ndarray  # [P, Hkv, 2, PS, D]
    kv_lens: jnp.ndarray  # int32[S]
    page_table: jnp.ndarray  # int32[S, MP]
    cu_q_lens: jnp.ndarray  # int32[S + 1]
    distribution: jnp.ndarray  # int32[2]

    @property
    def args(self):
        return (
            self.q,
            self.kv_pages,
            self.kv_lens,
            self.page_table,
            self.cu_q_lens,
            self.distribution,
        )

    @property
    def num_valid_tokens(self) -> int:
        return int(self.cu_q_lens[int(self.distribution[1])])


def make_step(
    seed: int,
    *,
    decode_kv_lens: list[int],
    prefill: list[tuple[int, int]],  # (q_len, kv_len) per prefill chunk, kv_len >= q_len
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    extra_seqs: int = 1,  # padding sequences past num_seqs
    extra_tokens: int = 3,  # padding tokens past the last sequence
    extra_pages: int = 1,  # page-table columns past the longest sequence
) -> Step:
    """Decode sequences first, then prefill chunks; pages are a random permutation of 1..P-1."""
    rng = np.random.default_rng(seed)
    seqs = [(1, k) for k in decode_kv_lens] + list(prefill)
    n = len(seqs)
    num_seqs = n + extra_seqs
    q_lens = np.array([a for a, _ in seqs], np.int32)
    kv_lens = np.array([b for _, b in seqs], np.int32)
    assert np.all(kv_lens >= q_lens)
    need = -(-kv_lens // page_size)
    max_pages = int(need.max(initial=0)) + extra_pages
    num_pages = int(need.sum()) + 4
    perm = rng.permutation(np.arange(1, num_pages))
    # Unused entries point anywhere in range (the reference and the kernel must ignore them).
    table = rng.integers(0, num_pages, size=(num_seqs, max_pages)).astype(np.int32)
    off = 0
    for i, k in enumerate(need):
        table[i, :k] = perm[off : off + k]
        off += k
    lens = np.zeros(num_seqs, np.int32)
    lens[:n] = kv_lens
    cu = np.zeros(num_seqs + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    num_tokens = int(cu[n]) + extra_tokens
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim), np.float32)
    kv = rng.standard_normal((num_pages, num_kv_heads, 2, page_size, head_dim), np.float32)
    return Step(
        q=jnp.asarray(q, dtype),
        kv_pages=jnp.asarray(kv, dtype),
        kv_lens=jnp.asarray(lens),
        page_table=jnp.asarray(table),
        cu_q_lens=jnp.asarray(cu),
        distribution=jnp.asarray([len(decode_kv_lens), n], jnp.int32),
    )
