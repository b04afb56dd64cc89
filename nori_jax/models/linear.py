"""The model's linear layers: a float kernel `[in, out]`, or a quantized weight (quantization/).

Tensor parallelism is Megatron's: a COLUMN layer (q/k/v/gate/up) splits its output features over
the mesh axis `model`, a ROW layer (o/down) its input features. A REPLICATED layer is whole on
every device (k/v when there are fewer kv heads than devices: each device computes all kv heads
and keeps the one it needs). A quantized weight keeps the same split, with its scales sharded
alongside their channels or groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from nori_jax.quantization.scheme import WeightQuantization
from pallas_kernels.skinny_matmul import skinny_matmul, skinny_matmul_fits

MODEL = "model"  # mesh axis for tensor parallelism
COLUMN, ROW, REPLICATED = "column", "row", "replicated"
_CONTRACT_IN = (((1,), (1,)), ((), ()))  # x[T, in] . w[out, in] -> [T, out]
# Per-channel int8 calls of at most this many tokens apply the scale after the dot
# (QuantizedLinear._scale_after_dot): measured at 16 tokens, where reading the weight bounds the
# GEMM; 64 tokens is still far below the H200's ridge point for these shapes.
SCALE_AFTER_DOT_MAX_TOKENS = 64
# Quantized calls of at most this many tokens ("calls of few tokens") take the model's
# `small_matmul` (quantized_matmul): "pallas" runs the skinny-matmul kernel
# (pallas_kernels/skinny_matmul): on the H200, cuBLASLt's fp8 GEMM read the weight at 0.5-0.8
# TB/s at 16-128 tokens, slower than bf16; the kernel at 1.2-1.8 TB/s (docs/benchmarks.md, "The
# skinny matmul"); its int4 form is 1.1-3.2x XLA's int4 form per matmul and made the 8B engine
# 1.47x faster. "upcast" has fp8 layers in calls of up to UPCAST_MAX_TOKENS multiply the
# activations as they are by the fp8 weight converted inside XLA's GEMM fusion, as int8 weights
# do (no per-token activation quantization, no fp8 GEMM): reading the weight bounds these calls.
SKINNY_MAX_TOKENS = 128
# In the 8B engine on an H100 (docs/benchmarks.md, "fp8 weight-only in calls of few tokens"),
# upcast steps of buckets 16, 32 and 64 took 8-11%, 4-7% and 2-4% less time than the fp8 GEMM's;
# bucket 128's took 10-11% more.
UPCAST_MAX_TOKENS = 64
SMALL_MATMULS = ("xla", "pallas", "upcast")


def param(
    rngs: nnx.Rngs, shape: tuple[int, ...], dtype, sharding: tuple[str | None, ...], init="normal"
):
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    # Sharding is metadata here; the loader places each array on the mesh (weights/loader.py).
    return nnx.Param(value, eager_sharding=False, out_sharding=sharding)


class QuantizedLinear(nnx.Module):
    """`qvalue[out, in]`, `scale[out, groups]` and, for offset layouts, `offset[out, groups]`
    (quantization/scheme.py). Built under `nnx.eval_shape` only: the loader fills the values."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype,
        parallel: str,
        scheme: WeightQuantization,
        name: str,
    ):
        scheme.check_in_features(name, in_features)
        groups = scheme.num_groups(in_features)
        w_spec = {COLUMN: (MODEL, None), ROW: (None, MODEL), REPLICATED: (None, None)}[parallel]
        # A per-channel scale has one column: it cannot be split over the input features.
        s_spec = (w_spec[0], w_spec[1] if groups > 1 else None)
        s_dtype = scheme.scale_dtype(dtype)

        def zeros(shape, dt, spec):
            return nnx.Param(jnp.zeros(shape, dt), eager_sharding=False, out_sharding=spec)

        self.qvalue = zeros((out_features, in_features), scheme.qtype, w_spec)
        self.scale = zeros((out_features, groups), s_dtype, s_spec)
        self.offset = zeros((out_features, groups), s_dtype, s_spec) if scheme.offset else None
        self.scheme = scheme
        self.parallel = parallel
        self.layer_name = name
        # How calls of few tokens multiply (SMALL_MATMULS), set by the model (use_small_matmul)
        self.small_matmul = "xla"

    def weight(self) -> jax.Array:
        """The dequantized weight [out, in] in the compute dtype (what the weight-only matmul
        reads; XLA fuses it into the dot's operand)."""
        w = qwix.dequantize(self._qarray())
        if self.offset is not None:
            out, groups = self.offset.shape
            grouped = w.reshape(out, groups, -1) + self.offset[...][:, :, None]
            w = grouped.reshape(w.shape)
        return w

    def _qarray(self) -> qwix.QArray:
        return qwix.QArray(self.qvalue[...], self.scale[...], None, self.scheme.qtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, in] -> [T, out]
        if self._upcast(x.shape[0]):  # fp8 weight-only: converted in XLA's fusion, scale after
            q = self.qvalue[...].astype(x.dtype)
            y = jax.lax.dot_general(x, q, _CONTRACT_IN, preferred_element_type=jnp.float32)
            return (y * self.scale[...][:, 0]).astype(x.dtype)
        if self.scheme.quantizes_activations:
            # Dynamic per-token scales: each row of x gets its own absmax scale.
            xq = qwix.quantize(x.astype(jnp.float32), self.scheme.qtype, channelwise_axes=(0,))
            if self._skinny(x.shape[0], x.dtype):
                y = skinny_matmul(xq.qvalue, self.qvalue[...], w_layout="out_in")
                return (y * xq.scale * self.scale[...][:, 0]).astype(x.dtype)
            y = qwix.dot_general(
                xq, self._qarray(), _CONTRACT_IN, preferred_element_type=jnp.float32
            )
            return y.astype(x.dtype)
        if self._skinny(x.shape[0], x.dtype):  # weight-only int8 / int4: converted in the kernel
            if self.scheme.group_size is None:  # per channel: the scale after
                y = skinny_matmul(x, self.qvalue[...], w_layout="out_in")
                return (y * self.scale[...][:, 0]).astype(x.dtype)
            # group scales apply inside, one group per pipeline step
            y = skinny_matmul(x, self.qvalue[...], self.scale[...], w_layout="out_in")
            return y.astype(x.dtype)
        if self._scale_after_dot(x.shape[0]):
            q = self.qvalue[...].astype(x.dtype)
            return jax.lax.dot_general(x, q, _CONTRACT_IN) * self.scale[...][:, 0].astype(x.dtype)
        return jax.lax.dot_general(x, self.weight().astype(x.dtype), _CONTRACT_IN)

    def _skinny(self, num_tokens: int, x_dtype) -> bool:
        """A call of few tokens on a model that runs Pallas matmuls, of a mode the skinny matmul
        takes (`skinny_matmul_takes`), whose shape fits its tiles."""
        out_features, in_features = self.qvalue.shape
        scheme = self.scheme
        itemsize = 0.5 if scheme.mode == "int4" else 1
        return (
            self.small_matmul == "pallas"
            and skinny_matmul_takes(scheme, x_dtype)
            and num_tokens <= SKINNY_MAX_TOKENS
            and skinny_matmul_fits(
                num_tokens, in_features, out_features, itemsize, scheme.group_size
            )
        )

    def _upcast(self, num_tokens: int) -> bool:
        """An fp8 call of at most UPCAST_MAX_TOKENS on a model whose small matmul is "upcast"."""
        return (
            self.small_matmul == "upcast"
            and self.scheme.mode == "fp8"
            and num_tokens <= UPCAST_MAX_TOKENS
        )

    def _scale_after_dot(self, num_tokens: int) -> bool:
        """Per-channel int8 in a call of few tokens: `(x @ convert(q)) * scale`, the scale on the
        output instead of on every weight element inside XLA's GEMM fusion. On the H200 at 16
        tokens that ran at 0.80-0.96x bf16's speed against 0.40-0.48x (docs/benchmarks.md,
        "Which matmuls lose"); at 1,024 tokens it was slower (0.63-0.69x against 0.70-0.74x),
        so larger calls keep the fused form. Group-wise scales cannot move past the sum."""
        return (
            self.scheme.mode == "int8"
            and self.scheme.group_size is None
            and num_tokens <= SCALE_AFTER_DOT_MAX_TOKENS
        )


def skinny_matmul_takes(scheme: WeightQuantization, x_dtype) -> bool:
    """Whether the skinny matmul (the weight streamed once) replaces XLA's dot for layers of
    `scheme` with `x_dtype` tokens: fp8 (fp8 x fp8 wgmma, against cuBLASLt) and weight-only
    int8 / int4 with 16-bit tokens (the weight converted in registers; a per-channel scale
    after, group scales inside). Not offset layouts (GGUF Q4_1)."""
    if scheme.mode == "fp8":
        return True
    return (
        scheme.mode in ("int8", "int4")
        and not scheme.offset
        and jnp.dtype(x_dtype) in (jnp.bfloat16, jnp.float16)
    )


def linear_weight(
    rngs: nnx.Rngs,
    in_features: int,
    out_features: int,
    dtype,
    parallel: str,
    quantization: WeightQuantization | None,
    name: str,
):
    """A float kernel [in, out] sharded for `parallel`, or a QuantizedLinear (`quantization`)."""
    if quantization is not None:
        return QuantizedLinear(in_features, out_features, dtype, parallel, quantization, name)
    spec = {COLUMN: (None, MODEL), ROW: (MODEL, None), REPLICATED: (None, None)}[parallel]
    return param(rngs, (in_features, out_features), dtype, spec)


def use_small_matmul(model: nnx.Module, small_matmul: str) -> None:
    """Set how the model's quantized layers multiply in calls of few tokens (SMALL_MATMULS):
    "pallas", the skinny matmul where it takes the layer's mode (`skinny_matmul_takes`; one
    device only: under tensor parallelism XLA partitions the dots, which it cannot do to a kernel
    call); "upcast", fp8 layers weight-only through XLA (int8 / int4 are weight-only anyway);
    "xla", XLA's dot of the mode."""
    if small_matmul not in SMALL_MATMULS:
        raise ValueError(f"small_matmul={small_matmul!r} must be one of {SMALL_MATMULS}")
    for _, node in nnx.iter_graph(model):
        if isinstance(node, QuantizedLinear):
            node.small_matmul = small_matmul


def linear(x: jax.Array, w) -> jax.Array:
    """x[T, in] times the weight built by `linear_weight`."""
    if isinstance(w, QuantizedLinear):
        return w(x)
    return x @ w[...]
