"""The programs a step runs on the device, as pure functions over arrays: what the runner
(runner.py) compiles ahead of time, one per bucket, sampler program or multi-step key.

    stage(step_state, fresh) -> step_state          the step's packed buffer, in place
    stage_and_peek(step_state, fresh, samples) -> (step_state, a copy of the last step's samples)
    forward[T](params, kv_pages, samples, logits, step_state) -> (samples, logits, kv_pages)
        (params: the model's parameters as param_packing.PackedParams passes them)
    penalize[B](logits, counts, in_prompt, step_state) -> (logits, counts, in_prompt)
    sample_from_logits[program, R](samples, logits, step_state) -> samples
    count_sampled(counts, samples, step_state) -> counts
    top_logprobs_from_logits[L](logits, step_state) -> int32[2, L x TOP_LOGPROBS] (fresh)
    prompt_logprobs_from_logits[top, L](logits, step_state) -> int32[2, L x (1 + top)] (fresh)
    peek(samples) -> a copy for the host
    multi_step[bucket, program](params, kv_pages, samples, all_samples, step_state)
        -> (all_samples int32[K, 2, S], samples, kv_pages)

`samples` int32[2, S] packs each row's token (row 0) and its logprob's float32 bits (row 1). The
top logprobs of the step's `top_rows` (core/step_layout.py) and its prompt logprobs come from
programs of their own after the forward pass and sampler, only in a step whose plan lists such
rows, each in a fresh output that the host copies back only then.
A step with rows whose request has a penalty (executor/penalties.py) penalizes their logits in
place after the forward pass, samples again (greedy rows too), and counts the sampled tokens;
`logits` is float32[S, V], of which a step of T tokens fills the first R = min(S, T) rows
(`logit_rows`: a bucket of T holds at most T rows). The forward pass samples greedily itself, so a
greedy step runs no sampler program; another step runs the one `sampling_modes.choose_program`
picked. Decode rows whose input is the previous step's sample read it from `samples` on the device
(`prev_index`), which lets the host plan step N+1 while step N runs. Multi-step decode runs the
forward pass and the sampler K times in a scan; its last step's samples are the next launch's
`samples`.

Every buffer argument that a program also returns is donated by the runner and comes back in
place (runner.py, "Buffers that never move"); an argument a program only overwrites is deleted
here (`del`), its buffer becoming the output's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nori_jax.core.sampling_modes import GREEDY
from nori_jax.core.step_layout import TOP_LOGPROBS
from nori_jax.executor.penalties import apply_penalties, count_samples, record_step_tokens
from nori_jax.executor.sampler import add_logit_bias, sample
from nori_jax.executor.step_inputs import unpack_rows, unpack_tokens
from nori_jax.executor.top_k import top_k
from nori_jax.models.llama import AttentionInputs


def model_from(graphdef, packed, params, kv_scales):
    """The model from its parameter arguments (`packed`: the runner's PackedParams)."""
    # Calibrated fp8 scales are constants of the program (known before it compiles): no buffer.
    kv_scales = None if kv_scales is None else jnp.asarray(kv_scales, jnp.float32)
    return nnx.merge(graphdef, packed.unflatten(params)), kv_scales


def stage(state, fresh):
    """The step's fresh buffer into the runner's own (donated, so its address never changes)."""
    return jax.lax.dynamic_update_slice(state, fresh, (0,))


def peek(samples):
    """A copy of the samples for the host: the runner's own buffer goes to the next launch."""
    return samples + 0


def stage_and_peek(state, fresh, samples):
    """`stage` of this launch and `peek` of the last one's samples, in one program: their
    buffer is still the last step's output here, before this step's forward pass takes it."""
    return stage(state, fresh), peek(samples)


def _input_ids(tok, prev_samples):
    """The step's token ids, with the previous launch's samples where `prev_index` points."""
    prev = tok["prev_index"]
    return jnp.where(prev >= 0, prev_samples[0, jnp.maximum(prev, 0)], tok["input_ids"])


def _pack(tokens, logprobs):
    """int32[..., 2, S]: the tokens, then the logprobs' float32 bits (one array to copy back)."""
    return jnp.stack([tokens, jax.lax.bitcast_convert_type(logprobs, jnp.int32)], axis=-2)


def logit_rows(max_num_seqs: int, bucket: int) -> int:
    """R: the rows whose logits a step of `bucket` tokens computes. A row has at least one token,
    so a bucket of T holds at most T rows: the LM head and the sampler skip the other padding
    rows (at 64 sequences, 1,024 rows of LM head, float32 logits and their reductions cost about
    0.2 ms a step on an H200)."""
    return min(max_num_seqs, bucket)


def _pad_rows(samples, width):
    """int32[..., 2, R] -> int32[..., 2, width]: R rows' samples padded to S."""
    pad = width - samples.shape[-1]
    return jnp.pad(samples, [(0, 0)] * (samples.ndim - 1) + [(0, pad)]) if pad else samples


def top_logprobs_from_logits(layout, count, logits_state, step):
    """int32[2, count x TOP_LOGPROBS]: for each of the step's first `count` `top_rows`, the most
    likely tokens of its row, best first, and their logprobs' bits, under the same distribution
    as the sampled token's logprob (the logits carry logit_bias from the forward pass and, when
    that program runs, the penalties, both applied in place). An entry past the step's own
    (max_num_seqs) reads the last row: the host drops it. One log-softmax and top-k over `count`
    rows, not over the batch; one program per bucket of `count`, run only in a step with such
    rows, its output a fresh array the host copies back only then."""
    row = unpack_rows(layout, step)
    r, vocab = logits_state.shape
    picked = logits_state[jnp.minimum(row["top_rows"][:count], r - 1)]  # [count, V]
    k = min(TOP_LOGPROBS, vocab)
    values, ids = top_k(jax.nn.log_softmax(picked, axis=-1), k)  # no full sort at k > 16
    if k < TOP_LOGPROBS:  # a vocabulary smaller than TOP_LOGPROBS: never asked for more
        pad = [(0, 0), (0, TOP_LOGPROBS - k)]
        values, ids = jnp.pad(values, pad, constant_values=-1e30), jnp.pad(ids, pad)
    return _pack(ids.reshape(-1), values.reshape(-1))


def _logits(
    model,
    kv_scales,
    logits_shardings,
    num_rows,
    row,
    input_ids,
    positions,
    slot_mapping,
    kv_lens,
    kv_pages,
):
    """float32[R, V] logits of the first `num_rows` rows' last tokens, replicated, and the new
    pages.

    On a tensor-parallel mesh the LM head is split by vocab: its logits are computed on each
    device's vocab slice, then gathered once (`logits_shardings`: (split, replicated)). Left to
    itself, XLA moves the gather elsewhere once sampling follows in the same program (sampling
    from vocab shards: three more collectives; or gathering the whole LM head weight)."""
    meta = AttentionInputs(
        slot_mapping=slot_mapping,
        kv_lens=kv_lens,
        page_table=row["page_table"],
        cu_q_lens=row["cu_q_lens"],
        distribution=row["distribution"],
    )
    hidden, kv_pages = model(input_ids, positions, kv_pages, meta, kv_scales)
    logits = model.compute_logits(hidden[row["logits_indices"][:num_rows]])  # [R, V]
    for sharding in logits_shardings:
        logits = jax.lax.with_sharding_constraint(logits, sharding)
    logits = add_logit_bias(logits, row["bias_rows"], row["bias_tokens"], row["bias_values"])
    return logits, kv_pages


def forward(
    graphdef,
    packed,
    layout,
    kv_scales,
    logits_shardings,
    bucket,
    params,
    kv_pages,
    prev_samples,
    logits_state,
    step,
):
    model, kv_scales = model_from(graphdef, packed, params, kv_scales)
    tok, row = unpack_tokens(layout, step, bucket), unpack_rows(layout, step)
    logits, kv_pages = _logits(
        model,
        kv_scales,
        logits_shardings,
        logit_rows(layout.max_num_seqs, bucket),
        row,
        _input_ids(tok, prev_samples),
        tok["positions"],
        tok["slot_mapping"],
        row["kv_lens"],
        kv_pages,
    )
    # Greedy sampling in the same program: a greedy step needs no second launch. (The argmax and
    # log-sum-exp are one pass over the logits, which the sampler programs would make anyway.)
    greedy = _pack(*_sample_row(GREEDY, logits, row, row["sample_index"]))
    samples = _pad_rows(greedy, layout.max_num_seqs)
    if logits.shape[0] < logits_state.shape[0]:  # R < S rows: into the first R
        logits = jax.lax.dynamic_update_slice(logits_state, logits, (0, 0))
    return samples, logits, kv_pages


def _sample_row(program, logits, row, sample_index):
    """(tokens int32[R], logprobs float32[R]) of the logits' R rows."""
    r = logits.shape[0]
    return sample(
        logits,
        row["temperature"][:r],
        row["top_p"][:r],
        row["top_k"][:r],
        row["min_p"][:r],
        row["seeds"][:r],
        sample_index[:r],
        row["filter_rows"],  # indices of rows < R, then padding (S), which the sampler drops
        program=program,
    )


def sample_from_logits(layout, program, rows, samples, logits_state, step):
    """New `samples` from the first `rows` logits: the forward pass's (donated) with its greedy
    rows replaced, its top logprobs (of the same logits) kept."""
    row = unpack_rows(layout, step)
    out = _pack(*_sample_row(program, logits_state[:rows], row, row["sample_index"]))
    return jax.lax.dynamic_update_slice(samples, _pad_rows(out, layout.max_num_seqs), (0, 0))


def penalize(layout, num_listed, logits_state, counts, in_prompt, step):
    """The step's tokens recorded in its listed penalty rows' counts, then those rows of the
    forward pass's logits penalized (all three buffers donated, returned in place); one program
    per bucket of listed rows (`num_listed`, static). Reads every token slot of the buffer, so one
    program serves every token bucket (slots past the step's tokens belong to no row)."""
    row = unpack_rows(layout, step)
    tok = unpack_tokens(layout, step, layout.token_capacity)
    counts, in_prompt = record_step_tokens(
        counts, in_prompt, row, tok["input_ids"], tok["positions"], num_listed
    )
    return apply_penalties(logits_state, counts, in_prompt, row, num_listed), counts, in_prompt


def count_sampled(layout, counts, samples, step):
    """The penalty counts (donated) with the tokens the listed rows sampled in this step."""
    return count_samples(counts, samples[0, : layout.max_num_seqs], unpack_rows(layout, step))


def prompt_logprobs_from_logits(layout, top, count, logits_state, step):
    """int32[2, count x (1 + top)]: for each of the step's first `count` prompt-logprob rows
    (core/step_layout.py), its target's rank (1 + how many tokens are likelier; the host knows the
    target) and logprob, then (top 1 or TOP_LOGPROBS) the most likely tokens' ids and theirs,
    each beside its logprob's bits. Rows past the step's own, so the
    logits are the forward pass's as they are: no logit_bias, no penalty. One program per (top,
    count) bucket; it runs only in a step with such rows, and its output is a fresh array the
    host copies back only then."""
    row = unpack_rows(layout, step)
    s, vocab = logits_state.shape
    rows = row["prompt_logprob_rows"][:count]
    targets = row["prompt_logprob_targets"][:count]
    logprobs = jax.nn.log_softmax(logits_state[jnp.minimum(rows, s - 1)], axis=-1)  # [L, V]
    target = jnp.clip(targets, 0, vocab - 1)[:, None]
    values = jnp.take_along_axis(logprobs, target, axis=-1)
    ids = 1 + jnp.sum(logprobs > values, axis=-1, keepdims=True, dtype=jnp.int32)  # its rank
    if top == 1:  # an argmax: one read of the row
        best = jnp.argmax(logprobs, axis=-1)[:, None].astype(jnp.int32)
        ids = jnp.concatenate([ids, best], axis=1)
        values = jnp.concatenate([values, jnp.take_along_axis(logprobs, best, axis=-1)], axis=1)
    elif top > 1:
        k = min(top, vocab)
        best_values, best = top_k(logprobs, k)
        if k < top:  # a vocabulary smaller than `top`: never asked for more
            pad = [(0, 0), (0, top - k)]
            best_values, best = jnp.pad(best_values, pad, constant_values=-1e30), jnp.pad(best, pad)
        ids = jnp.concatenate([ids, best.astype(jnp.int32)], axis=1)
        values = jnp.concatenate([values, best_values], axis=1)
    return _pack(ids.reshape(-1), values.reshape(-1))


def multi_step(
    graphdef,
    packed,
    layout,
    kv_scales,
    logits_shardings,
    page_size,
    num_steps,
    program,
    bucket,
    params,
    kv_pages,
    prev_samples,
    all_samples,
    step,
):
    """`num_steps` decode steps in one program: forward pass and sampler, each step's samples
    the next one's inputs, in a `lax.scan` of static length (XLA knows its trip count: no host
    synchronization). The plan holds decode rows only (token j is row j). Row i computes its
    first `decode_steps[i]` steps; in the later ones its token writes the null page and reads
    its last real length, and its samples are garbage the host drops.

    Returns (samples int32[k, 2, S], the last step's samples int32[2, S] (the next launch's
    `prev_samples`), kv_pages).
    """
    model, kv_scales = model_from(graphdef, packed, params, kv_scales)
    tok, row = unpack_tokens(layout, step, bucket), unpack_rows(layout, step)
    s, t = layout.max_num_seqs, bucket
    r = logit_rows(s, t)
    token_row = jnp.minimum(jnp.arange(t), r - 1)
    is_row = jnp.arange(t) < row["distribution"][0]
    token_steps = jnp.where(is_row, row["decode_steps"][token_row], 0)  # int32[T]
    row_steps = jnp.maximum(row["decode_steps"], 1)  # int32[S]; padding rows: 1
    page_table, positions0 = row["page_table"], tok["positions"]
    pages_per_seq = page_table.shape[1]

    def one_step(carry, i):
        kv_pages, input_ids = carry
        active = i < token_steps
        positions = positions0 + i
        page = jnp.minimum(positions // page_size, pages_per_seq - 1)
        slot = page_table[token_row, page] * page_size + positions % page_size
        slot_mapping = jnp.where(active, slot, 0)  # done rows and padding: the null page
        kv_lens = row["kv_lens"] + jnp.where(row["kv_lens"] > 0, jnp.minimum(i, row_steps - 1), 0)
        logits, kv_pages = _logits(
            model,
            kv_scales,
            logits_shardings,
            r,
            row,
            input_ids,
            positions,
            slot_mapping,
            kv_lens,
            kv_pages,
        )
        sampled, logprobs = _sample_row(program, logits, row, row["sample_index"] + i)
        next_ids = jnp.where(is_row, sampled[token_row], 0)
        # no top logprobs: the scheduler plans no multi-step launch for a request that asks
        return (kv_pages, next_ids), _pad_rows(_pack(sampled, logprobs), layout.max_num_seqs)

    del all_samples  # its buffer becomes the first output's
    (kv_pages, _), samples = jax.lax.scan(
        one_step, (kv_pages, _input_ids(tok, prev_samples)), jnp.arange(num_steps, dtype=jnp.int32)
    )
    return samples, samples[-1], kv_pages
