"""Which data-parallel replica serves a request: least loaded, unless a replica holds its prefix.

JAX-free and process-agnostic: the in-process replicated engine and the served data-parallel
client both ask it.

Load is the tokens a replica still owes: each request counts its cost (the caller's estimate:
prompt tokens + max_tokens, capped at max_model_len) from its routing until its release
(finished, aborted, failed). A new request goes to the replica with the
least load (ties: fewer requests, then the lower index), except that requests sharing a prefix
should meet on one replica, whose prefix cache then holds it: the router remembers, for the
chained hash of each of a prompt's first `max_prefix_pages` full pages, the replica it last sent
that prefix to, and sends the request whose longest remembered prefix it is to that replica, as
long as that replica's load exceeds the least loaded one's by at most `max_imbalance_tokens`
(`MeshConfig.prefix_affinity_max_imbalance_tokens`, `--prefix-affinity-max-imbalance-tokens`).
Past that bound a hot prefix spills to the least loaded replica, which caches it too. At 0 the
prefix only breaks ties: its replica gets the request only while its load is the least.

The table is an LRU of `max_entries` prefix hashes, so its memory is bounded whatever the traffic.
Thread-safe: the served client routes on the event loop and releases from its reader threads.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    page_size: int  # the engines' KV page size: prefix blocks align with their cached pages
    max_prefix_pages: int = 32  # a prompt's first pages that key the prefix table
    max_imbalance_tokens: int = 4096  # how much busier than the idlest a prefix's replica may be
    max_entries: int = 65536  # prefix hashes remembered (LRU)

    def __post_init__(self) -> None:
        for name in ("page_size", "max_prefix_pages", "max_entries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"router {name}={value!r} must be an integer >= 1")
        if not isinstance(self.max_imbalance_tokens, int) or self.max_imbalance_tokens < 0:
            raise ValueError(
                f"router max_imbalance_tokens={self.max_imbalance_tokens!r} must be an integer >= 0"
            )


def prefix_hashes(token_ids: Sequence[int], page_size: int, max_pages: int) -> list[bytes]:
    """The chained hash of each full page among the first `max_pages` of `token_ids`: entry k
    covers tokens [0, (k + 1) * page_size)."""
    n = min(len(token_ids) // page_size, max_pages)
    if n == 0:
        return []
    ids = np.asarray(token_ids[: n * page_size], dtype=np.int64)
    out, parent = [], b""
    for k in range(n):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(ids[k * page_size : (k + 1) * page_size].tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class ReplicaRouter:
    def __init__(self, num_replicas: int, config: RouterConfig):
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas!r} must be an integer >= 1")
        self.num_replicas = num_replicas
        self.config = config
        self.load = [0] * num_replicas  # tokens owed, per replica
        self.num_requests = [0] * num_replicas
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (replica, its cost)
        self._prefixes: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.prefix_routed = 0  # requests sent to their prefix's replica
        self.spilled = 0  # requests whose prefix's replica was too busy
        self._lock = threading.Lock()

    def route(
        self,
        request_id: str,
        token_ids: Sequence[int],
        cost: int,
        available: Sequence[int] | None = None,
    ) -> int:
        """Pick a replica among `available` (default: all) and count `cost` tokens on it until
        `release(request_id)`. ValueError for a request id already routed or no replica."""
        candidates = list(range(self.num_replicas)) if available is None else list(available)
        if not candidates:
            raise ValueError("no replica is available")
        hashes = prefix_hashes(token_ids, self.config.page_size, self.config.max_prefix_pages)
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"request_id={request_id!r} is already routed")
            chosen = self._pick(candidates, hashes)
            for h in hashes:
                self._prefixes[h] = chosen
                self._prefixes.move_to_end(h)
            while len(self._prefixes) > self.config.max_entries:
                self._prefixes.popitem(last=False)
            self._owner[request_id] = (chosen, cost)
            self.load[chosen] += cost
            self.num_requests[chosen] += 1
        return chosen

    def _pick(self, candidates: list[int], hashes: list[bytes]) -> int:
        idlest = min(candidates, key=lambda r: (self.load[r], self.num_requests[r], r))
        for h in reversed(hashes):  # the longest remembered prefix decides
            owner = self._prefixes.get(h)
            if owner is None or owner not in candidates:
                continue
            if self.load[owner] - self.load[idlest] <= self.config.max_imbalance_tokens:
                self.prefix_routed += 1
                return owner
            self.spilled += 1
            break
        return idlest

    def owner(self, request_id: str) -> int | None:
        entry = self._owner.get(request_id)
        return None if entry is None else entry[0]

    def release(self, request_id: str) -> int | None:
        """The request is done (any reason): its tokens leave its replica's load. Returns that
        replica, or None for an id not routed (released twice, or never routed)."""
        with self._lock:
            entry = self._owner.pop(request_id, None)
            if entry is None:
                return None
            replica, cost = entry
            self.load[replica] -= cost
            self.num_requests[replica] -= 1
            return replica
