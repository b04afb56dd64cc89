"""Host-side page allocator: reference counts, prefix-cache hashes, and an LRU of free pages.

Page 0 is the null page (see pallas_kernels.kv_layout) and is never handed out. A page is either
free (ref count 0, in `_free`, possibly still holding a cached prefix) or used (ref count >= 1,
possibly shared by several requests through the prefix cache).

Eviction order: `_free` pops from its head. Pages without cached content are put at the head, so a
cached prefix survives until no blank page is left; cached pages go to the tail as they are freed,
which makes the head the least recently used cached page.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from pallas_kernels.page_constants import NULL_PAGE

ROOT_HASH = b""


def page_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Content key of a full page: a cryptographic digest of (parent key, its tokens).

    Not Python's hash(): that one is unkeyed and easy to collide on purpose, and a collision would
    hand one request another request's KV.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    return h.digest()


def chain_page_hashes(parent: bytes, tokens: np.ndarray, page_size: int) -> list[bytes]:
    """`page_hash` of each full page of int32 `tokens` in turn, the chain continuing from
    `parent`: the same digests, hashed straight from slices of one array (no list to convert
    per page)."""
    hashes = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(tokens[start : start + page_size])  # the buffer: the bytes tobytes() gives
        parent = h.digest()
        hashes.append(parent)
    return hashes


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self._hash_of_page: dict[int, bytes] = {}
        self._page_of_hash: dict[bytes, int] = {}

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.num_usable_pages

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages with ref count 1, evicting cached content if needed; None if short."""
        if n > len(self._free):
            return None
        pages = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            self._evict(page)
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages reaching zero become free (tail first)."""
        for page in reversed(pages):
            assert self.ref_counts[page] > 0, f"double free of page {page}"
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self._free[page] = None
                if page not in self._hash_of_page:
                    self._free.move_to_end(page, last=False)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Longest run of cached pages for a hash chain; each returned page gains a reference."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in hashes:
            page = self._page_of_hash.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self.ref_counts[page] == 0:
                del self._free[page]
            self.ref_counts[page] += 1
        return pages

    def register(self, page: int, h: bytes) -> None:
        """Publish a full, computed page under its content hash (first writer wins)."""
        if not self.enable_prefix_caching or h in self._page_of_hash:
            return
        assert page not in self._hash_of_page, f"page {page} registered twice"
        self._page_of_hash[h] = page
        self._hash_of_page[page] = h

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (their KV was computed with weights that changed); the
        pages stay where they are, free or held. Returns how many pages were published."""
        n = len(self._page_of_hash)
        self._page_of_hash.clear()
        self._hash_of_page.clear()
        return n

    def _evict(self, page: int) -> None:
        h = self._hash_of_page.pop(page, None)
        if h is not None:
            del self._page_of_hash[h]

    def check_invariants(self, live_pages: list[list[int]]) -> None:
        """Free + used == total; ref counts equal the references live requests hold."""
        expected = [0] * self.num_pages
        for pages in live_pages:
            for page in pages:
                assert page != NULL_PAGE, "null page handed to a request"
                expected[page] += 1
        assert expected == self.ref_counts, "ref counts differ from live references"
        free = set(self._free)
        assert len(free) == len(self._free)
        assert NULL_PAGE not in free
        assert free == {p for p in range(1, self.num_pages) if self.ref_counts[p] == 0}
        assert self.num_free_pages + self.num_used_pages == self.num_usable_pages
        assert all(self._page_of_hash[h] == p for p, h in self._hash_of_page.items())
