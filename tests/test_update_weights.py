"""`LLM.update_weights`: a running engine switched to another checkpoint's weights answers as an
engine loaded from that checkpoint (greedy and seeded tokens), without recompiling, with its
prefix cache emptied; from a directory, a mapping of numpy arrays or JAX arrays; quantized too.
A bad set of tensors, or requests in flight, is refused and leaves the weights as they were.
`sleep` / `wake_up`: the device's memory given back and taken again, with the kept weights or
new ones, answering as before, nothing recompiled."""

from __future__ import annotations

import gc
import shutil
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
from engine_fixtures import small_llm
from safetensors.numpy import save_file

from nori_jax import LLM, SamplingParams
from nori_jax.executor.compile_counter import CompileCounter
from nori_jax.weights import export
from nori_jax.weights.safetensors_dir import iter_safetensors
from nori_jax.weights.update import check_like

PARAMS = [
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True),
]
# 40 tokens: two full pages of 16, which the prefix cache keeps after the first request
PROMPTS = [list(range(10, 50)), [7, 8, 9], list(range(100, 123))]


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny llama and a copy with other weights (every tensor drawn anew, norms included)."""
    first = hf_checkpoints["llama"]
    second = tmp_path_factory.mktemp("hf-llama-other")
    for f in first.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, second / f.name)
    rng = np.random.default_rng(7)
    tensors = {
        name: (rng.standard_normal(a.shape) * a.std() + a.mean()).astype(a.dtype)
        for name, a in iter_safetensors(first)
    }
    save_file(tensors, str(second / "model.safetensors"))
    return first, second


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS * 2, PARAMS * 3)]


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[list[int]]]:
    """Each checkpoint's tokens from an engine loaded on it."""
    first, second = checkpoints
    return {"a": _tokens(small_llm(str(first))), "b": _tokens(small_llm(str(second)))}


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return small_llm(str(checkpoints[0]))


def _hits(llm: LLM) -> float:
    return llm.get_metrics()["nori:prefix_cache_hits_total"]


def test_new_weights_answer_as_their_checkpoint_does(llm, checkpoints, expected):
    assert expected["a"] != expected["b"]
    assert _tokens(llm) == expected["a"]  # the long prompt's pages are now cached
    llm.update_weights(str(checkpoints[1]))
    hits = _hits(llm)
    assert _tokens(llm) == expected["b"]
    # The cached pages held the old weights' KV: none were read back, though the long prompt
    # ran twice (the second of each pair found the first's pages, computed anew).
    first_pass = llm.generate([PROMPTS[0]], PARAMS[0])[0].token_ids
    assert first_pass == expected["b"][0]
    assert _hits(llm) - hits >= 2 * 16  # the cache works again, on the new weights' KV
    # Back to the first weights from host arrays, then from arrays on the device.
    llm.update_weights(dict(iter_safetensors(checkpoints[0])))
    assert _tokens(llm) == expected["a"]
    llm.update_weights([(n, jax.numpy.asarray(a)) for n, a in iter_safetensors(checkpoints[1])])
    assert _tokens(llm) == expected["b"]
    assert llm.engine.num_recompiles == 0


def test_the_old_weights_are_released(checkpoints):
    """Nothing keeps the replaced arrays alive, the loaded ones included (the compiled programs
    hold the packing, not the arrays): on a GPU a second copy of the weights would stay in
    device memory."""
    llm = small_llm(str(checkpoints[0]))
    gc.collect()
    old = [weakref.ref(x) for x in jax.tree.leaves(llm.engine.model.state)]
    llm.update_weights(str(checkpoints[1]))
    gc.collect()
    assert [r() for r in old] == [None] * len(old)


def test_one_tensor_at_a_time(llm, checkpoints, monkeypatch):
    """Each old array goes as its successor lands: while the new weights are placed, the device
    holds at most a tensor's arrays more than before (two full copies would add every one)."""
    from nori_jax.weights import update

    gc.collect()
    before, seen = len(jax.live_arrays()), []
    place = update.place_prepared

    def counted(*args):
        placed = place(*args)
        seen.append(len(jax.live_arrays()) - before)
        return placed

    monkeypatch.setattr(update, "place_prepared", counted)
    # Host arrays of their own: a directory's tensors are read through JAX's CPU backend, whose
    # arrays, live until placed, this count could not tell from the engine's on a CPU machine.
    llm.update_weights({n: np.array(a) for n, a in iter_safetensors(checkpoints[1])})
    assert len(seen) >= 10 and max(seen) <= 2, seen


def test_the_prefix_cache_is_emptied(llm, checkpoints):
    llm.generate([PROMPTS[0]], PARAMS[0])
    allocator = llm.engine.scheduler.allocator
    assert allocator._page_of_hash
    llm.update_weights(str(checkpoints[0]))
    assert not allocator._page_of_hash
    hits = _hits(llm)
    llm.generate([PROMPTS[0]], PARAMS[0])
    assert _hits(llm) == hits  # nothing cached survived the update


def test_weights_that_wrote_nan_leave_no_trace_once_replaced(llm, checkpoints, expected):
    """A trainer's diverged step (NaN weights) fills the KV pages it touches with NaN. Masked
    positions of a page (past a sequence's end, a page tail another request wrote) weigh 0 in
    the attention, but 0 x NaN is NaN: every new set of weights clears the pool of NaN and inf
    (in place: the pages keep their addresses), so the good weights answer as before."""
    llm.update_weights(str(checkpoints[0]))
    good = dict(iter_safetensors(checkpoints[0]))
    q = "model.layers.0.self_attn.q_proj.weight"
    llm.update_weights(good | {q: np.full_like(good[q], np.nan)})
    llm.generate(PROMPTS * 2, PARAMS[0])  # every page these touch now holds NaN
    addresses = [p.unsafe_buffer_pointer() for p in llm.engine.runner.kv_pages]
    counter = CompileCounter()
    with counter.counting():
        llm.update_weights(good)
    assert counter.count == 0  # the pass over the pool was compiled at start-up
    assert [p.unsafe_buffer_pointer() for p in llm.engine.runner.kv_pages] == addresses
    assert _tokens(llm) == expected["a"]
    assert llm.engine.num_recompiles == 0


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: t | {"model.layers.9.mlp.up_proj.weight": t["model.norm.weight"]}, "layers.9"),
        (lambda t: t | {"model.norm.weight": t["model.norm.weight"][:-1]}, "model.norm.weight"),
        (
            lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.k_proj" not in k},
            "k_proj",
        ),
        (lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"}, "lacks tensors"),
        (lambda t: [*t.items(), ("model.norm.weight", t["model.norm.weight"])], "given twice"),
        (lambda t: None, "must be a mapping of names to arrays"),
        (lambda t: list(t), "item 0 is not a \\(name, array\\) pair"),  # names alone
        (lambda t: t | {"model.norm.weight": "abc"}, "is a str, not an array"),
        (lambda t: t | {5: t["model.norm.weight"]}, "name must be a string"),
    ],
)
def test_a_bad_set_of_tensors_is_refused_and_changes_nothing(
    llm, checkpoints, expected, change, match
):
    llm.update_weights(str(checkpoints[0]))
    with pytest.raises(ValueError, match=match):
        llm.update_weights(change(dict(iter_safetensors(checkpoints[1]))))
    assert _tokens(llm) == expected["a"]


def test_only_between_requests(llm, checkpoints, tmp_path):
    llm.engine.add_request(None, [5, 6, 7], PARAMS[0])
    with pytest.raises(ValueError, match="requests are queued or running"):
        llm.update_weights(str(checkpoints[1]))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    with pytest.raises(ValueError, match="not a Hugging Face directory"):
        llm.update_weights(str(tmp_path))


def test_a_quantized_engine_quantizes_the_new_weights(checkpoints):
    old, new = (small_llm(str(path), quantization="int8") for path in checkpoints)
    old.update_weights(str(checkpoints[1]))
    assert _tokens(old) == _tokens(new)
    assert old.engine.num_recompiles == 0


def test_arrays_unlike_the_compiled_ones_are_refused(llm):
    """The programs take the parameters without jit's checks (executor/direct_call.py): a new
    array of another dtype or shape than the one it replaces is an error, not a reinterpretation."""
    old = llm.engine.model.state["embed_tokens"].get_value()
    check_like(("embed_tokens",), old, old)
    with pytest.raises(ValueError, match=r"embed_tokens would be float16\[320, 64\]"):
        check_like(("embed_tokens",), old.astype(jax.numpy.float16), old)
    with pytest.raises(ValueError, match=r"would be float32\[320, 32\]"):
        check_like(("embed_tokens",), old[:, :32], old)


def _engine_arrays(llm: LLM) -> list[jax.Array]:
    """What the engine holds on the device: weights (the state's arrays and the launch's
    parameter arguments, stacks included), KV pages, the step's own buffers."""
    runner = llm.engine.runner
    buffers = [runner._step_state, runner._samples_state, runner._logits_state]
    buffers += [runner._penalty_counts, runner._penalty_in_prompt]
    weights = [x for x in jax.tree.leaves(llm.engine.model.state) if isinstance(x, jax.Array)]
    return weights + list(runner._params) + list(runner.kv_pages) + buffers


def _all_released(refs: list[weakref.ref]) -> bool:
    gc.collect()
    return all(r() is None for r in refs)


@pytest.fixture
def awake_after(llm):
    """The engine awake again after the test, whatever it asserted (the module shares it)."""
    yield llm
    if llm.engine.is_sleeping:
        llm.wake_up(llm.engine.model.source)  # its checkpoint's weights, whatever the level


def test_sleep_gives_the_device_back_and_wake_up_answers_as_before(
    awake_after, checkpoints, expected
):
    llm = awake_after
    llm.update_weights(str(checkpoints[0]))
    llm.generate([PROMPTS[0]], PARAMS[0])  # its pages cached: the wake-up's pages are blank
    held = [weakref.ref(x) for x in _engine_arrays(llm)]
    assert not llm.is_sleeping
    llm.sleep()
    assert llm.is_sleeping and llm.engine.is_sleeping
    assert _all_released(held)  # weights, KV pages, logits and the rest gone from the device
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(llm.engine.model.state)}
    assert kinds == {"pinned_host"}
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, PARAMS[0])
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep()
    with pytest.raises(ValueError, match="asleep; wake_up"):
        llm.update_weights(str(checkpoints[1]))
    llm.wake_up()
    assert not llm.is_sleeping
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(llm.engine.model.state)}
    assert kinds == {"device"} and llm.engine.runner.kv_pages
    assert _tokens(llm) == expected["a"]
    assert llm.engine.num_recompiles == 0
    with pytest.raises(ValueError, match="not asleep"):
        llm.wake_up()
    llm.sleep()  # and woken with new weights: the kept ones are dropped, not moved back
    llm.wake_up(str(checkpoints[1]))
    assert _tokens(llm) == expected["b"]


def test_level_2_drops_the_weights_and_wakes_with_new_ones(awake_after, checkpoints, expected):
    llm = awake_after
    llm.update_weights(str(checkpoints[0]))
    llm.generate([PROMPTS[0]], PARAMS[0])  # pages of the old weights in the prefix cache
    held = [weakref.ref(x) for x in _engine_arrays(llm)]
    llm.sleep(level=2)
    assert _all_released(held)
    leaves = jax.tree.leaves(llm.engine.model.state)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # no copy anywhere
    with pytest.raises(ValueError, match="without its weights"):
        llm.wake_up()
    with pytest.raises(ValueError, match="lacks tensors"):  # checked before anything changes
        llm.wake_up({"model.norm.weight": np.ones(64, np.float32)})
    llm.wake_up(str(checkpoints[1]))
    assert _tokens(llm) == expected["b"]
    assert llm.engine.num_recompiles == 0


def test_sleep_only_between_requests(llm):
    llm.engine.add_request(None, [5, 6, 7], PARAMS[0])
    with pytest.raises(ValueError, match="sleep: requests are queued or running"):
        llm.sleep()
    with pytest.raises(ValueError, match="level=3"):
        llm.sleep(level=3)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert not llm.engine.is_sleeping


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_get_weights_is_the_checkpoint(hf_checkpoints, name):
    """The engine's weights exported under Hugging Face names are the checkpoint's tensors, to
    the bit (fused q/k/v and gate/up split back, kernels transposed back; qwen2: q/k/v biases,
    tied embeddings without an lm_head), and update_weights takes them back unchanged."""
    path = hf_checkpoints[name]
    llm = small_llm(str(path))
    got = llm.get_weights()
    want = dict(iter_safetensors(path))
    assert sorted(got) == sorted(want)
    for key, array in want.items():
        np.testing.assert_array_equal(got[key], array, err_msg=key)
    before = _tokens(llm)
    llm.update_weights(got)
    assert _tokens(llm) == before


def test_get_weights_needs_a_float_model(checkpoints):
    with pytest.raises(ValueError, match="stored quantized"):
        small_llm(str(checkpoints[0]), quantization="int8").get_weights()


def test_get_weights_transposes_in_blocks(hf_checkpoints, monkeypatch):
    """Kernels transposed on the device a few columns at a time (the last block overlapping the
    one before it) come back as the checkpoint holds them."""
    path = hf_checkpoints["llama"]
    want = dict(iter_safetensors(path))
    monkeypatch.setattr(export, "BLOCK_BYTES", 3 * 64 * 4)  # 3 columns of a 64-row f32 kernel
    got = small_llm(str(path)).get_weights()
    for key, array in want.items():
        np.testing.assert_array_equal(got[key], array, err_msg=key)
    x = jax.numpy.arange(4 * 7, dtype=jax.numpy.float32).reshape(4, 7)
    monkeypatch.setattr(export, "BLOCK_BYTES", 3 * 4 * 4)  # blocks of 3 columns: 0, 3, 4
    np.testing.assert_array_equal(export.host_transposed(x), np.asarray(x).T)


def test_the_callers_arrays_are_not_kept(checkpoints, expected):
    """Tensors of the model's dtype are prepared without a copy; once update_weights returns, the
    caller may overwrite its arrays without touching the engine's weights."""
    llm = small_llm(str(checkpoints[0]))
    mine = {n: np.array(a) for n, a in iter_safetensors(checkpoints[1])}
    llm.update_weights(mine)
    for array in mine.values():
        array[...] = 0
    assert _tokens(llm) == expected["b"]


def test_stacked_weights_answer_update_sleep_and_export_as_the_unstacked(checkpoints, expected):
    """`stack_weights`: the forward pass takes the matrices stacked by kind. The same tokens,
    new weights and sleep / wake-up as without, `get_weights` the checkpoint's tensors, nothing
    recompiled; the state holds no array of a stacked leaf (the stacks are the only copy)."""
    llm = small_llm(str(checkpoints[0]), stack_weights=True)
    runner = llm.engine.runner
    leaves = jax.tree.leaves(llm.engine.model.state)
    # Two layers: every leaf but the embedding and the LM head stacked; 8 arguments (those
    # two, 5 stacks, the rows' index) for 15 leaves.
    assert (len(leaves), runner._packed.num_stacked, runner._packed.num_args) == (15, 13, 8)
    shapes_only = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
    assert shapes_only == runner._packed.stacked_leaves
    assert _tokens(llm) == expected["a"]
    got, want = llm.get_weights(), dict(iter_safetensors(checkpoints[0]))
    assert sorted(got) == sorted(want)
    for key, array in want.items():
        np.testing.assert_array_equal(got[key], array, err_msg=key)
    llm.update_weights(str(checkpoints[1]))
    assert _tokens(llm) == expected["b"]
    held = [weakref.ref(x) for x in _engine_arrays(llm)]
    llm.sleep()
    assert _all_released(held)
    llm.wake_up()
    assert _tokens(llm) == expected["b"]
    llm.sleep(level=2)
    llm.wake_up(str(checkpoints[0]))
    assert _tokens(llm) == expected["a"]
    assert llm.engine.num_recompiles == 0
