"""Constants of the KV page layout that host code shares with the kernels (no JAX import).

Page 0 is the null page: padded tokens write into it and padded page-table entries point at it.
It is never handed to a request (see kv_layout.py).
"""

NULL_PAGE = 0
# The KV cache's page dtypes, as vLLM names them (kv_layout.kv_page_dtype maps them to dtypes).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def stored_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads a layer's page array holds across `tp` tensor-parallel devices (its kv-head axis,
    split over the devices): num_kv_heads, or tp when there are fewer kv heads than devices and
    each is stored tp / num_kv_heads times, so that every device holds the kv head its q heads
    use. ValueError when neither divides the other."""
    if num_kv_heads % tp == 0:
        return num_kv_heads
    if tp % num_kv_heads == 0:
        return tp
    raise ValueError(
        f"tensor parallel size {tp} and num_kv_heads={num_kv_heads}: one must divide the other"
    )
