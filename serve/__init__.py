"""The HTTP server: OpenAI-compatible routes, /generate, /health and /metrics over an EngineClient.

Thin by design: each route validates its request (pydantic), converts it to a prompt and
SamplingParams (serve/generation.py is the skeleton the generation routes share), and awaits the
request's stream from the engine client (the engine-core process, or the in-process thread).
"""
