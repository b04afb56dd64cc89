"""`nori-jax run-batch`: OpenAI Batch API files through the engine in this process, no HTTP.

`requests.py` turns an input line into what the server would hand its engine (the same pydantic
bodies and route checks) or into the error the server would answer; `output.py` is the output
file with its checkpoint (durable, resumable); `runner.py` drives the engine over a grain
pipeline; `cli.py` is the command. See docs/batch.md.
"""
