"""Weight quantization (`quantization="fp8" | "int8" | "int4"`): schemes and conversion."""

from nori_jax.quantization.scheme import (
    QUANTIZATION_MODES,
    WeightQuantization,
    default_scheme,
)

__all__ = ["QUANTIZATION_MODES", "WeightQuantization", "default_scheme"]
