"""Load generator for OpenAI-compatible servers: `nori-jax bench serve` (docs/bench.md).

Kept free of imports on purpose: client worker processes are spawned fresh and import
`nori_jax.bench.driver`, which must not drag matplotlib, numpy or the engine along with it.
"""
