"""The tiny random-weight engine with multi-step decode that the executor's compile tests build:
two token buckets, every sampler mode, multi-step programs of two steps."""

TINY_MULTI_STEP = dict(
    load_format="dummy",
    dtype="float32",
    page_size=16,
    num_pages=32,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    max_model_len=128,
    num_scheduler_steps=2,
    multi_step_max_seqs=8,
)
