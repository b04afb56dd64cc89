"""heap_frozen: the loop's heap is out of full collections, and handed back after."""

import gc
import threading

import pytest

from nori_jax import heap_freeze
from nori_jax.heap_freeze import heap_frozen


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()  # the interpreter may start with objects frozen
    yield
    gc.unfreeze()


def test_freezes_for_the_block_and_unfreezes_after():
    made_before = []

    def seen_by_collector(obj) -> bool:
        return any(o is obj for o in gc.get_objects())

    with heap_frozen():
        assert gc.get_freeze_count() > 0
        made_inside = []
        assert not seen_by_collector(made_before)  # frozen: no collection walks it
        assert seen_by_collector(made_inside)  # the loop's own objects stay collectable
    assert gc.get_freeze_count() == 0
    assert seen_by_collector(made_before)


def test_nested_blocks_share_one_freeze_lifted_by_the_outermost():
    # Frozen objects still leave the permanent generation when reference counting frees them
    # (another thread's, at any time), so the count may only fall between two reads: a second
    # freeze would raise it by at least the containers made in between, an unfreeze zero it.
    with heap_frozen():
        frozen = gc.get_freeze_count()
        made_since = [[] for _ in range(100)]  # tracked containers a second freeze would take
        with heap_frozen(collect=True):
            assert 0 < gc.get_freeze_count() <= frozen  # no second freeze of the loop's objects
        assert 0 < gc.get_freeze_count() <= frozen  # the inner block did not unfreeze
        del made_since
    assert gc.get_freeze_count() == 0


def test_blocks_on_two_threads_share_it():
    inner_entered, outer_left = threading.Event(), threading.Event()
    seen = {}

    def loop():
        with heap_frozen():
            inner_entered.set()
            outer_left.wait(5)
            seen["while_other_left"] = gc.get_freeze_count()
        seen["after"] = gc.get_freeze_count()

    with heap_frozen():
        t = threading.Thread(target=loop)
        t.start()
        assert inner_entered.wait(5)
    outer_left.set()
    t.join(5)
    assert seen["while_other_left"] > 0  # still frozen: the thread's block is open
    assert seen["after"] == 0


def test_unfreezes_when_the_loop_raises():
    with pytest.raises(RuntimeError), heap_frozen():
        raise RuntimeError("step failed")
    assert gc.get_freeze_count() == 0


def test_cycles_made_in_the_block_are_collected_in_it():
    with heap_frozen():
        cycle = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1


def test_env_turns_it_off(monkeypatch):
    monkeypatch.setenv("NORI_JAX_FREEZE_GC", "0")
    with heap_frozen():
        assert gc.get_freeze_count() == 0
    heap_freeze.freeze_process_heap()
    assert gc.get_freeze_count() == 0


def test_freeze_process_heap_freezes_for_good():
    heap_freeze.freeze_process_heap()
    assert gc.get_freeze_count() > 0
