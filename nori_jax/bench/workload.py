"""What both benchmarks send: request lengths, arrival times, their seeds and their flags.

`bench serve` and `bench offline` draw from the same seeded streams in the same order, so one seed
and rate give both the same input and output lengths and the same arrival times: an offline run
and a served run of one seed compare the same workload (the server's overhead is the difference).

Arrival gaps are i.i.d. Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate and
coefficient of variation 1/sqrt(burstiness), so burstiness 1 is a Poisson process, below 1
burstier, above 1 smoother, inf evenly spaced. As `vllm bench serve` does, the times are rescaled
so the last arrival falls exactly at num/rate: the offered rate of a finite run is then exactly
`rate` instead of off by the sampling noise of the gap sum.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

DATASETS = ("lognormal", "fixed", "jsonl")
_STREAM_REQUESTS, _STREAM_WARMUP, _STREAM_ARRIVALS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class LognormalLengths:
    """Token counts drawn as round(exp(N(mu, sigma))), clipped to [min_len, max_len]."""

    mu: float
    sigma: float
    min_len: int = 1
    max_len: int = 1 << 30

    def __post_init__(self) -> None:
        if not math.isfinite(self.mu):
            raise ValueError(f"lognormal mu must be finite, got {self.mu=}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"lognormal sigma must be finite and >= 0, got {self.sigma=}")
        if self.min_len < 1 or self.max_len < self.min_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len=} {self.max_len=}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raw = np.exp(rng.normal(self.mu, self.sigma, size=n))
        return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)


# The project's benchmark workload (docs/benchmarks.md, Conventions). The clip bounds keep
# input + output within an 8k context (SmolLM2) while cutting less than 0.1% of inputs and about
# 0.1% of outputs.
DEFAULT_INPUT = LognormalLengths(mu=6.2, sigma=0.8, min_len=1, max_len=6144)
DEFAULT_OUTPUT = LognormalLengths(mu=5.5, sigma=0.7, min_len=1, max_len=2048)


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "lognormal"  # lognormal, fixed, or jsonl (prompts from `path`)
    num_prompts: int = 1000
    input_lengths: LognormalLengths = DEFAULT_INPUT
    output_lengths: LognormalLengths = DEFAULT_OUTPUT
    input_len: int = 1024  # `fixed`
    output_len: int = 128  # `fixed`, and `jsonl` lines that give no output length
    path: str | None = None  # `jsonl`
    warmup_requests: int = 0
    request_rate: float = math.inf  # req/s; inf: every request at t=0
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; use one of {DATASETS}")
        if self.num_prompts < 1 or self.warmup_requests < 0:
            raise ValueError(
                f"need --num-prompts >= 1 and --warmup-requests >= 0, got {self.num_prompts} and "
                f"{self.warmup_requests}"
            )
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(
                f"--input-len and --output-len must be >= 1, got {self.input_len} and "
                f"{self.output_len}"
            )
        if self.dataset == "jsonl" and not self.path:
            raise ValueError("the jsonl dataset needs a path (--dataset-path)")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.path is not None and self.dataset != "jsonl":
            raise ValueError(
                f"--dataset-path is read only with --dataset jsonl (got --dataset {self.dataset})"
            )
        self._arrival_pattern(self.num_prompts)  # refuses a burstiness too small to draw from

    def streams(self) -> tuple[np.random.Generator, np.random.Generator]:
        """(requests, warm-up requests) generators: lengths first, then prompt tokens."""
        return (
            np.random.default_rng([self.seed, _STREAM_REQUESTS]),
            np.random.default_rng([self.seed, _STREAM_WARMUP]),
        )

    def lengths(self, n: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
        """n (input, output) lengths of the lognormal or fixed dataset."""
        if self.dataset == "fixed":
            return [self.input_len] * n, [self.output_len] * n
        ins = self.input_lengths.sample(n, rng)
        return ins.tolist(), self.output_lengths.sample(n, rng).tolist()

    def arrival_times(self, n: int, rate: float | None = None) -> np.ndarray:
        """[n] seconds after the start, non-decreasing; one gap pattern for every rate."""
        rate = self.request_rate if rate is None else rate
        if math.isinf(rate):
            return np.zeros(n)
        return self._arrival_pattern(n) / rate

    def _arrival_pattern(self, n: int) -> np.ndarray:
        """The arrival times at rate 1, the last one at exactly n. ValueError when the gamma
        gaps of a tiny burstiness underflow (all 0, or a sum too small to rescale): there is no
        schedule to send, only NaN."""
        if math.isinf(self.burstiness):
            gaps = np.ones(n)
        else:
            rng = np.random.default_rng([self.seed, _STREAM_ARRIVALS])
            gaps = rng.gamma(self.burstiness, 1.0 / self.burstiness, size=n)
        times = np.cumsum(gaps)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            scaled = times * (n / times[-1]) if n else times
        if n and not (times[-1] > 0 and np.all(np.isfinite(scaled))):
            raise ValueError(
                f"burstiness {self.burstiness:g} is too small to build an arrival schedule of "
                f"{n} requests (its gamma gaps underflow to 0); use a larger --burstiness"
            )
        return scaled


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends every flag's default, except unset ones, whose help says what unset means."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == []:
            return action.help or ""
        return super()._get_help_string(action) or ""


def add_workload_args(
    p: argparse.ArgumentParser, datasets: tuple[str, ...], seed_flag: str, warmup: int
) -> None:
    """The dataset and load flags of both benchmarks (dest names are WorkloadConfig's)."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="lognormal", choices=datasets, help="request lengths")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests measured")
    for side, d in (("input", DEFAULT_INPUT), ("output", DEFAULT_OUTPUT)):
        g.add_argument(f"--{side}-mu", type=float, default=d.mu, help=f"lognormal {side} mu")
        g.add_argument(f"--{side}-sigma", type=float, default=d.sigma, help="and its sigma")
        g.add_argument(f"--{side}-min", type=int, default=d.min_len, help=f"lower {side} clip")
        g.add_argument(f"--{side}-max", type=int, default=d.max_len, help=f"upper {side} clip")
    g.add_argument("--input-len", type=int, default=1024, help="input length of --dataset fixed")
    g.add_argument(
        "--output-len", type=int, default=128, help="output length of fixed (and jsonl lines)"
    )
    g.add_argument(
        "--warmup-requests", type=int, default=warmup, help="sent first, all at once, unreported"
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="offered load in req/s (gamma gaps); inf sends everything at t=0",
    )
    g.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 is Poisson"
    )
    g.add_argument(
        seed_flag,
        dest="workload_seed",
        metavar="SEED",
        type=int,
        default=0,
        help="fixes lengths and arrivals",
    )


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        input_lengths=LognormalLengths(
            args.input_mu, args.input_sigma, args.input_min, args.input_max
        ),
        output_lengths=LognormalLengths(
            args.output_mu, args.output_sigma, args.output_min, args.output_max
        ),
        input_len=args.input_len,
        output_len=args.output_len,
        path=getattr(args, "dataset_path", None),
        warmup_requests=args.warmup_requests,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.workload_seed,
    )
