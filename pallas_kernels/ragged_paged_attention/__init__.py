"""Ragged paged attention: decode rows and prefill chunks of one step in one call.

`ragged_paged_attention` dispatches to a backend; `ragged_paged_attention_reference` is the pure-jnp
definition every kernel is tested against; `attention_step_sharded` runs the step split over kv
heads on a mesh axis (tensor parallelism).
"""

from pallas_kernels.ragged_paged_attention.api import attention_step, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.sharded import attention_step_sharded

__all__ = [
    "attention_step",
    "attention_step_sharded",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
