"""Benchmarks: `nori-jax bench serve`, a load generator for OpenAI-compatible servers, and
`nori-jax bench offline`, the engine in process (docs/bench.md)."""
