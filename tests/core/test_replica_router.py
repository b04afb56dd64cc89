"""The data-parallel router alone: load balance, prefix affinity within the imbalance bound."""

from __future__ import annotations

import pytest

from nori_jax.core.replica_router import ReplicaRouter, RouterConfig, prefix_hashes

PAGE = 16


def router(n: int = 2, **kw) -> ReplicaRouter:
    return ReplicaRouter(n, RouterConfig(page_size=PAGE, **kw))


def test_distinct_prompts_spread_evenly_and_follow_the_load() -> None:
    r = router(4)
    chosen = [r.route(f"r{i}", list(range(i * 100, i * 100 + 40)), 50) for i in range(8)]
    assert sorted(chosen) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert r.load == [100] * 4 and r.num_requests == [2] * 4
    # Replica 2 drains: the next request goes there, not round the ring.
    for i, c in enumerate(chosen):
        if c == 2:
            assert r.release(f"r{i}") == 2
    assert r.load[2] == 0 and r.route("next", list(range(900, 940)), 50) == 2


def test_a_shared_prefix_stays_on_one_replica() -> None:
    system = list(range(1, 3 * PAGE + 1))  # three full pages shared by every request
    r = router(2, max_imbalance_tokens=10_000)
    chosen = {r.route(f"q{i}", system + [500 + i, 7, 8], 40) for i in range(10)}
    assert len(chosen) == 1 and r.prefix_routed == 9
    # Meanwhile prompts without that prefix fill the other replica.
    other = 1 - chosen.pop()
    assert r.route("distinct", list(range(600, 650)), 40) == other


def test_the_longest_remembered_prefix_decides() -> None:
    a = list(range(1, 2 * PAGE + 1))
    r = router(2)
    assert r.route("a", a + [1000], 10) == 0
    assert r.route("b", a[:PAGE] + list(range(2000, 2000 + PAGE)), 10) == 0  # one page shared
    # "c" shares two pages with "a"; both are on 0, so 0 it is even though 1 is idle.
    assert r.route("c", a + [3000], 10) == 0
    assert r.load == [30, 0]


def test_a_hot_prefix_spills_past_the_imbalance_bound() -> None:
    system = list(range(1, PAGE + 1))
    r = router(2, max_imbalance_tokens=100)
    placed = [r.route(f"q{i}", system + [i], 60) for i in range(4)]
    # 0 takes q0 and q1 (load 120 vs 0 exceeds the bound only after q1), then q2 spills to 1,
    # and q3 follows the prefix to its latest replica (1).
    assert placed == [0, 0, 1, 1] and r.spilled == 1


def test_prompts_shorter_than_a_page_only_balance() -> None:
    r = router(2)
    assert prefix_hashes([1, 2, 3], PAGE, 8) == []
    assert [r.route(f"s{i}", [1, 2, 3], 10) for i in range(4)] == [0, 1, 0, 1]


def test_only_available_replicas_are_chosen() -> None:
    r = router(3)
    system = list(range(1, PAGE + 1))
    assert r.route("a", system, 10) == 0
    # Replica 0 is down: its prefix goes elsewhere, to the idler of the two left.
    assert r.route("b", system, 10, available=[1, 2]) == 1
    with pytest.raises(ValueError, match="no replica"):
        r.route("c", system, 10, available=[])


def test_release_is_idempotent_and_ids_are_unique() -> None:
    r = router(2)
    r.route("x", [1] * 40, 10)
    with pytest.raises(ValueError, match="request_id='x'"):
        r.route("x", [2] * 40, 10)
    assert r.owner("x") == 0 and r.release("x") == 0
    assert r.release("x") is None and r.owner("x") is None and r.load == [0, 0]


def test_the_prefix_table_is_bounded() -> None:
    r = router(2, max_entries=5, max_prefix_pages=2)
    for i in range(20):
        r.route(f"p{i}", list(range(i * 1000, i * 1000 + 3 * PAGE)), 1)
    assert len(r._prefixes) == 5


def test_prefix_hashes_chain_whole_pages() -> None:
    ids = list(range(3 * PAGE + 5))
    h = prefix_hashes(ids, PAGE, 8)
    assert len(h) == 3 and len(set(h)) == 3
    assert prefix_hashes(ids[: 2 * PAGE] + [9] * PAGE, PAGE, 8)[:2] == h[:2]
    assert prefix_hashes(ids, PAGE, 2) == h[:2]
    changed = [ids[0] + 1] + ids[1:]
    assert not set(prefix_hashes(changed, PAGE, 8)) & set(h)  # a chain: page 0 changes all


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"page_size": 0}, "page_size"),
        ({"page_size": 16, "max_prefix_pages": 0}, "max_prefix_pages"),
        ({"page_size": 16, "max_imbalance_tokens": -1}, "max_imbalance_tokens"),
        ({"page_size": 16, "max_entries": 0}, "max_entries"),
    ],
)
def test_bad_settings_are_named(kw, field) -> None:
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kw)
    with pytest.raises(ValueError, match="num_replicas=0"):
        ReplicaRouter(0, RouterConfig(page_size=16))
