"""Constants of the KV page layout that host code shares with the kernels (no JAX import).

Page 0 is the null page: padded tokens write into it and padded page-table entries point at it.
It is never handed to a request (see kv_layout.py).
"""

NULL_PAGE = 0
# The KV cache's page dtypes, as vLLM names them (kv_layout.kv_page_dtype maps them to dtypes).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
