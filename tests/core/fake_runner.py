"""Drive the Scheduler without a model: tokens are a deterministic function of the sequence.

`make_scheduler` attaches a PlanBuilder, so `fake_step` and `run_to_completion` go through the
same schedule -> build -> execute -> update path as the engine, with a fake device that resolves
placeholder tokens from the previous step's samples exactly as the jitted step does.
"""

from __future__ import annotations

import numpy as np

from nori_jax.core.paging import PageAllocator
from nori_jax.core.plan_builder import PlanBuilder
from nori_jax.core.request import Request
from nori_jax.core.scheduler import Scheduler
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.core.scheduler_output import SchedulerOutput
from nori_jax.core.step_plan import StepPlan
from nori_jax.sampling_params import SamplingParams

VOCAB = 1003


def next_token(tokens: list[int]) -> int:
    """What the fake model 'predicts' after a sequence: depends on the whole sequence only."""
    return (sum(tokens) * 31 + len(tokens)) % 1000 + 3


def make_scheduler(num_pages: int = 64, **overrides) -> Scheduler:
    cfg = dict(max_model_len=256, page_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    cfg.update(overrides)
    config = SchedulerConfig(**cfg)
    s = Scheduler(config, PageAllocator(num_pages, config.page_size, config.enable_prefix_caching))
    s._builder = PlanBuilder(
        config.max_num_seqs,
        config.max_pages_per_seq,
        config.page_size,
        num_pages,
        s.buckets,
        VOCAB,
    )
    return s


def shared_prefix_requests(
    n: int, seed: int, max_own: int, max_tokens: tuple[int, int]
) -> list[Request]:
    """`n` requests that all start with the same 40-token system prompt (prefix-cache hits),
    then 1 to `max_own - 1` tokens of their own, asking for `max_tokens` [low, high) tokens."""
    system = list(range(300, 340))
    rng = np.random.default_rng(seed)
    return [
        make_request(
            f"r{i}",
            system + rng.integers(3, 900, int(rng.integers(1, max_own))).tolist(),
            int(rng.integers(*max_tokens)),
        )
        for i in range(n)
    ]


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **params) -> Request:
    return Request(
        rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params), seed=0
    )


def build(s: Scheduler, out: SchedulerOutput) -> StepPlan:
    return s._builder.build(out)


def check_plan(s: Scheduler, plan: StepPlan) -> None:
    """Every plan sits in a bucket, respects the budget, lists decodes first, and its token and
    slot arrays agree with the requests' pages. Call right after schedule() + build()."""
    assert plan.bucket in s.buckets and plan.num_tokens <= plan.bucket
    assert plan.num_tokens <= s.config.max_num_batched_tokens
    assert plan.num_rows <= s.config.max_num_seqs
    n = plan.num_scheduled_tokens
    first_prefill = next((i for i, k in enumerate(n) if k != 1), len(n))
    assert all(k == 1 for k in n[:first_prefill]) and all(k != 1 for k in n[first_prefill:])
    assert plan.distribution.tolist() == [first_prefill, plan.num_rows]
    assert plan.cu_q_lens[plan.num_rows] == plan.num_tokens
    assert (plan.slot_mapping[plan.num_tokens :] == 0).all()  # padding writes go to page 0
    assert (plan.prev_index[first_prefill:] == -1).all()  # only decode rows use device tokens
    assert (plan.page_table[plan.num_rows :] == 0).all()  # padding rows read the null page
    ps = s.page_size
    for i, req in enumerate(plan.scheduled.row_requests):
        lo, hi = plan.cu_q_lens[i], plan.cu_q_lens[i + 1]
        start = int(plan.kv_lens[i]) - (hi - lo)
        # Advanced at schedule time, by every step of a multi-step launch.
        steps = 1 if plan.num_steps == 1 else int(plan.decode_steps[i])
        assert s.num_computed_tokens(req) == plan.kv_lens[i] + steps - 1
        assert len(req.pages) * ps >= plan.kv_lens[i] + steps - 1, "a step without its page"
        assert plan.positions[lo:hi].tolist() == list(range(start, start + hi - lo))
        known = plan.prev_index[lo:hi] < 0
        expected = req.token_ids(start, start + hi - lo)
        assert [t for t, k in zip(plan.input_ids[lo:hi].tolist(), known, strict=True) if k] == [
            t for t, k in zip(expected, known, strict=False) if k
        ]
        pages = np.asarray(req.pages)
        assert plan.page_table[i, : len(pages)].tolist() == req.pages
        pos = plan.positions[lo:hi]
        assert (plan.slot_mapping[lo:hi] == pages[pos // ps] * ps + pos % ps).all()
        assert (plan.slot_mapping[lo:hi] >= ps).all(), "a real token writes into the null page"


class FakeDevice:
    """Executes plans in launch order, resolving placeholder tokens from the previous plan's
    samples exactly as the jitted step does (prev_index)."""

    def __init__(self, s: Scheduler):
        self.s = s
        self.prev_tokens = np.zeros(s.config.max_num_seqs, np.int32)
        self.last_sample: dict[str, int] = {}
        self.samples: dict[str, dict[int, int]] = {}  # multi-step: output index -> token

    def execute(self, plan: StepPlan) -> np.ndarray:
        """The plan's samples: int32[S], or int32[k, S] for a multi-step launch."""
        if plan.num_steps > 1:
            return self._execute_steps(plan)
        ids = np.where(
            plan.prev_index >= 0, self.prev_tokens[np.maximum(plan.prev_index, 0)], plan.input_ids
        )
        tokens = np.zeros(self.s.config.max_num_seqs, np.int32)
        for i, (req, samples) in enumerate(
            zip(plan.scheduled.row_requests, plan.samples, strict=True)
        ):
            rid = req.request_id
            lo, hi = plan.cu_q_lens[i], plan.cu_q_lens[i + 1]
            start = int(plan.kv_lens[i]) - (hi - lo)
            for j in range(lo, hi):
                if plan.prev_index[j] >= 0:  # must be this request's previous sample
                    assert ids[j] == self.last_sample[rid]
            if samples:
                seq = self._before(req, start) + ids[lo:hi].tolist()
                tokens[i] = self.last_sample[rid] = next_token(seq)
                self.samples.setdefault(rid, {})[len(seq) - req.num_prompt_tokens] = int(tokens[i])
        self.prev_tokens = tokens
        return tokens

    def _before(self, req, start: int) -> list[int]:
        """The request's tokens before position `start`. Those the host does not know yet
        (sampled by a multi-step launch still in flight) come from this device's own record."""
        known = min(start, req.num_tokens)
        history = self.samples.get(req.request_id, {})
        n_prompt = req.num_prompt_tokens
        return req.token_ids(0, known) + [history[j - n_prompt] for j in range(known, start)]

    # What a multi-step launch samples in a step its row does not compute: a valid token id
    # that the host must drop (never a stop token of the tests' requests).
    DROPPED = 2

    def _execute_steps(self, plan: StepPlan) -> np.ndarray:
        """k decode steps: row i computes its first decode_steps[i], each sample the next input."""
        assert plan.distribution.tolist() == [plan.num_rows] * 2, "multi-step: decode rows only"
        ids = np.where(
            plan.prev_index >= 0, self.prev_tokens[np.maximum(plan.prev_index, 0)], plan.input_ids
        )
        k = plan.num_steps
        tokens = np.full((k, self.s.config.max_num_seqs), self.DROPPED, np.int32)
        for i, req in enumerate(plan.scheduled.row_requests):
            rid, start = req.request_id, int(plan.positions[i])
            if plan.prev_index[i] >= 0:
                assert ids[i] == self.last_sample[rid]
            seq = self._before(req, start) + [int(ids[i])]
            history, n_prompt = self.samples.setdefault(rid, {}), req.num_prompt_tokens
            for step in range(int(plan.decode_steps[i])):
                tokens[step, i] = self.last_sample[rid] = next_token(seq)
                history[len(seq) - n_prompt] = int(tokens[step, i])
                seq.append(int(tokens[step, i]))
        self.prev_tokens = tokens[-1]
        return tokens


class FakeExecutor:
    """An EngineCore executor over a FakeDevice: `launch` runs the plan, `fetch` returns its
    tokens and `logprobs(n)` for them (zeros unless a test wants values it can recognize)."""

    num_recompiles = 0

    def __init__(self, device: FakeDevice, logprobs=lambda n: np.zeros(n, np.float32)):
        self.device = device
        self.logprobs = logprobs

    def launch(self, plan):
        return self.device.execute(plan)

    def fetch(self, tokens):
        if tokens.ndim == 2:  # a multi-step launch: [k, S]
            return tokens, np.stack([self.logprobs(tokens.shape[1]) for _ in tokens])
        return tokens, self.logprobs(len(tokens))


def fake_step(s: Scheduler, out: SchedulerOutput):
    """Synchronous: build and execute the step, then update."""
    if not hasattr(s, "_fake"):
        s._fake = FakeDevice(s)
    plan = build(s, out)
    return s.update(out, s._fake.execute(plan))


def finish_counting(s: Scheduler, out: SchedulerOutput, count, on_plan=None) -> int:
    """Step `out` and every later step synchronously until nothing is left, checking the
    invariants; the most `count(s.running)` was after any schedule. `on_plan(plan)` sees each
    plan but the first."""
    s.check_invariants()
    fake_step(s, out)
    most = 0
    while s.has_unfinished():
        out = s.schedule()
        s.check_invariants()
        if out is None:
            break
        plan = build(s, out)
        if on_plan is not None:
            on_plan(plan)
        most = max(most, count(s.running))
        fake_step(s, out)
    return most


def run_to_completion(
    s: Scheduler,
    requests: list[Request],
    max_steps: int = 10_000,
    on_step=None,
    overlap: bool = False,
    device: FakeDevice | None = None,
) -> dict[str, Request]:
    """Run until every request finishes. With `overlap`, plan N+1 is built before plan N's
    samples are delivered, as the engine's async scheduling does. `device`: a FakeDevice of `s`
    (a subclass that checks more), or a new one."""
    for r in requests:
        s.add_request(r)
    device = device or FakeDevice(s)
    s._fake = device
    done: dict[str, Request] = {}
    in_flight = None
    for _ in range(max_steps):
        out = s.schedule()
        s.check_invariants()
        if out is not None:
            plan = build(s, out)
            check_plan(s, plan)
            if on_step:
                on_step(s, plan)
            launched = (out, device.execute(plan))
        else:
            launched = None
        finish = in_flight if overlap else launched
        in_flight = launched if overlap else None
        if finish is None and launched is None:
            break
        if finish is not None:
            for req in s.update(*finish).finished:
                done[req.request_id] = req
        s.check_invariants()
    assert not s.has_unfinished(), "scheduler stopped making progress"
    assert s.allocator.num_used_pages == 0, "pages leaked"
    return done


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt) :]
