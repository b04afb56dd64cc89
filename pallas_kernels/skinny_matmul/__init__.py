"""A matmul of few tokens against a large weight, the weight streamed once at the copy rate.

`skinny_matmul` is the Mosaic GPU kernel behind a validated API; `skinny_matmul_reference` is its
pure-jnp definition.
"""

from pallas_kernels.skinny_matmul.api import skinny_matmul, skinny_matmul_fits
from pallas_kernels.skinny_matmul.reference import skinny_matmul_reference
from pallas_kernels.skinny_matmul.tuning import SkinnyTuning, default_tuning

__all__ = [
    "SkinnyTuning",
    "default_tuning",
    "skinny_matmul",
    "skinny_matmul_fits",
    "skinny_matmul_reference",
]
