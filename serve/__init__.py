"""The HTTP server: OpenAI-compatible routes, /generate, /health and /metrics over an AsyncEngine.

Thin by design: each route validates its request (pydantic), converts it to a prompt and
SamplingParams, and awaits the request's stream from `nori_jax.async_engine`.
"""
