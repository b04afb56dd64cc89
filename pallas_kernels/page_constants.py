"""Constants of the KV page layout that host code shares with the kernels (no JAX import).

Page 0 is the null page: padded tokens write into it and padded page-table entries point at it.
It is never handed to a request (see kv_layout.py).
"""

NULL_PAGE = 0
