"""Load generator for OpenAI-compatible servers: `nori-jax bench serve` (docs/bench.md).

Kept free of imports on purpose: client worker processes import `nori_jax.bench.driver` under a
bare package stub (see driver.py), and nothing here may pull numpy, matplotlib or the engine in.
"""
