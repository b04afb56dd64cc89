"""TopLogprobRows: a step's top logprobs as two arrays through the engine-core process and its
clients (split per API server, merged across disaggregated engines), pairs made only at the end."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from nori_jax.core.outputs import EngineCoreOutputs
from nori_jax.core.top_logprob_rows import TopLogprobRows
from nori_jax.engine_core_process import split_outputs


def block(rids, width, base=0):
    ids = base + np.arange(len(rids) * width).reshape(len(rids), width)
    return TopLogprobRows.of(rids, ids, -ids.astype(np.float32) / 8)


def test_arrays_and_pairs_round_trip_through_msgpack():
    b = block(["a", "b"], 3)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(b), type=TopLogprobRows)
    assert back.ids.dtype == np.int32 and back.logprobs.dtype == np.float32
    assert back.ids.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert back.pairs() == {
        "a": ((0, -0.0), (1, -0.125), (2, -0.25)),
        "b": ((3, -0.375), (4, -0.5), (5, -0.625)),
    }


def test_select_and_concat_pad_to_the_widest():
    b = block(["a", "b", "c"], 2)
    assert b.select([2, 0]).request_ids == ["c", "a"]
    assert b.select([2, 0]).ids.tolist() == [[4, 5], [0, 1]]
    merged = TopLogprobRows.concat([None, b.select([1]), block(["x"], 4, base=100)])
    assert merged.request_ids == ["b", "x"] and merged.width == 4
    assert merged.ids.tolist() == [[2, 3, -1, -1], [100, 101, 102, 103]]
    assert merged.logprobs[0, 2:].tolist() == [-np.inf, -np.inf]
    assert TopLogprobRows.concat([None, block([], 2)]) is None
    assert TopLogprobRows.concat([b]) is b


def test_mismatched_arrays_are_refused_naming_the_shapes():
    with pytest.raises(ValueError, match=r"ids \(2, 3\) and logprobs \(2, 4\)"):
        TopLogprobRows.of(["a", "b"], np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="for 1 request ids"):
        TopLogprobRows.of(["a"], np.zeros((2, 3)), np.zeros((2, 3)))


def test_each_api_server_gets_the_rows_of_its_own_requests():
    out = EngineCoreOutputs(["a", "b", "c"], np.array([1, 2, 3], np.int32).tobytes(), b"", [], [])
    out.top_logprobs = block(["a", "c"], 2)
    zero, one, two = split_outputs(out, {"a": 1, "b": 0, "c": 1}, 3)
    assert zero.top_logprobs is None and two.top_logprobs is None
    assert one.top_logprobs.request_ids == ["a", "c"]
    assert one.top_logprobs.ids.tolist() == [[0, 1], [2, 3]]
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(one), type=EngineCoreOutputs)
    assert wire.top_logprobs.pairs() == one.top_logprobs.pairs()


def test_a_positions_pairs_stay_tuples_across_the_process_boundary():
    """Top pairs are a tuple per token (and per prompt position) in one process and after
    msgpack alike, so a served engine's outputs read as an in-process engine's."""
    out = EngineCoreOutputs([], b"", b"", [], [])
    out.prompt_logprobs = {"a": ([-1.0], [((4, -0.5), (6, -1.5))], [2])}
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=EngineCoreOutputs)
    assert wire.prompt_logprobs == {"a": ([-1.0], [((4, -0.5), (6, -1.5))], [2])}


def test_the_processor_reads_the_logprob_column_for_the_streams_that_asked():
    """Sampled-token logprobs travel as a column, one a row (several rows of a request in a
    multi-step launch), and a stream without them pays for none."""
    from nori_jax.core.output_processor import OutputProcessor
    from nori_jax.sampling_params import SamplingParams

    processor = OutputProcessor(None)
    processor.add("lp", None, [1, 2], SamplingParams(logprobs=0), stream=True)
    processor.add("plain", None, [1, 2], SamplingParams(), stream=True)
    lps = np.array([-0.5, -1.5, -2.5, -3.5], np.float32)
    out = EngineCoreOutputs(
        ["lp", "plain", "lp", "plain"], np.int32([5, 6, 7, 8]).tobytes(), lps.tobytes(), [], []
    )
    outputs, _ = processor.process(out)
    got = {o.request_id: o for o in outputs}
    assert got["lp"].new_token_ids == [5, 7] and got["lp"].new_logprobs == [-0.5, -2.5]
    assert got["plain"].new_token_ids == [6, 8] and got["plain"].new_logprobs is None
    processor.drop("lp")
    assert processor._with_logprobs == 0  # only streams that asked make it read the column
    processor.add("lp2", None, [1], SamplingParams(logprobs=1), stream=True)
    processor.add("lp2", None, [1], SamplingParams(logprobs=1), stream=True)  # added again
    assert processor._with_logprobs == 1
