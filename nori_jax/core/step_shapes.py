"""Where an engine's wall time goes by the shape of its steps: token bucket, kind, steps a launch.

A run's mean step time hides the regimes it mixes. The benchmark workload's 600-request offline run
on the Llama-3.1-8B shape, for one, is 1,868 launches of which 51 carry prompt tokens and 996 decode
about six sequences in bucket 16 (the long outputs' tail, bound by reading the weights), while
a few hundred decode hundreds of sequences (bound by the KV reads;
benchmarks/engine/shape_mix.py counts them): a change that speeds one regime and slows another
moves the mean by their mix. `StepShapes` keeps, per shape, the steps fetched
and the wall time each took, so two runs can be compared shape by shape (`bench offline` prints
the table).

A step's time is the interval that ends when its samples reach the host and starts when the
previous step's samples did, or when it was launched if that was later (the engine was idle in
between). With overlapped scheduling on a device-bound run that is the step's device time; where
the host bounds the loop it is the host's time per step; with `async_scheduling` off it adds the
host's own work of the step to the device's.
"""

from __future__ import annotations

import dataclasses

STEP_KINDS = ("decode", "mixed", "prefill")


def step_kind(num_decodes: int, num_prefills: int) -> str:
    """ "decode": decode rows only; "prefill": prefill chunks only; "mixed": both."""
    if not num_prefills:
        return "decode"
    return "mixed" if num_decodes else "prefill"


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    bucket: int  # the compiled token bucket the launch ran
    kind: str  # one of STEP_KINDS
    num_steps: int = 1  # decode steps of a multi-step launch


@dataclasses.dataclass
class ShapeTimes:
    launches: int = 0
    tokens: int = 0  # real tokens run (not the bucket's padding)
    seconds: float = 0.0


class StepShapes:
    """Launches, tokens and seconds by StepShape; `minus` gives a run's share of them."""

    def __init__(self, by_shape: dict[StepShape, ShapeTimes] | None = None):
        self.by_shape: dict[StepShape, ShapeTimes] = by_shape or {}

    def observe(self, shape: StepShape, tokens: int, seconds: float, launches: int = 1) -> None:
        t = self.by_shape.get(shape)
        if t is None:
            t = self.by_shape[shape] = ShapeTimes()
        t.launches += launches
        t.tokens += tokens
        t.seconds += seconds

    def copy(self) -> StepShapes:
        return StepShapes({s: dataclasses.replace(t) for s, t in self.by_shape.items()})

    def minus(self, earlier: StepShapes) -> StepShapes:
        """What was observed since `earlier` (a `copy()` of this one), shapes with launches only."""
        out = {}
        for shape, t in self.by_shape.items():
            e = earlier.by_shape.get(shape, ShapeTimes())
            if t.launches > e.launches:
                out[shape] = ShapeTimes(
                    t.launches - e.launches, t.tokens - e.tokens, t.seconds - e.seconds
                )
        return StepShapes(out)

    @staticmethod
    def merged(parts: list[StepShapes]) -> StepShapes:
        """Several cores' shapes in one (their seconds add up: each core's own wall per step)."""
        total = StepShapes()
        for p in parts:
            for shape, t in p.by_shape.items():
                total.observe(shape, t.tokens, t.seconds, t.launches)
        return total

    def rows(self) -> list[dict]:
        """One dict a shape, by bucket, kind and steps a launch; `share`: of all rows' seconds."""
        total = sum(t.seconds for t in self.by_shape.values()) or 1.0
        return [
            {
                "bucket": s.bucket,
                "kind": s.kind,
                "num_steps": s.num_steps,
                "launches": t.launches,
                "tokens_per_launch": t.tokens / t.launches,
                "ms_per_launch": 1e3 * t.seconds / t.launches,
                "seconds": t.seconds,
                "share": t.seconds / total,
            }
            for s, t in sorted(self.by_shape.items())
        ]


# format_rows' columns: header, row key, cell format
_COLUMNS = (
    ("bucket", "bucket", "{:>7}"),
    ("kind", "kind", " {:<8}"),
    ("steps", "num_steps", "{:>6}"),
    ("launches", "launches", " {:>9}"),
    ("tokens", "tokens_per_launch", " {:>8.0f}"),
    ("ms", "ms_per_launch", " {:>8.2f}"),
)


def format_rows(
    rows: list[dict], title: str = "Wall time by step shape", width: int = 60, fill: str = "="
) -> str:
    """The table `bench offline` prints under its result (and `bench serve` under the server's
    numbers, whose rows from /metrics lack the steps and tokens columns: those are left out)."""
    cols = [c for c in _COLUMNS if not rows or all(c[1] in r for r in rows)]
    head = "".join(fmt.replace(".0f", "").replace(".2f", "").format(h) for h, _, fmt in cols)
    lines = [f" {title} ".center(width, fill), head + " {:>7}".format("share")]
    for r in rows:
        cells = "".join(fmt.format(r[key]) for _, key, fmt in cols)
        lines.append(cells + f" {100 * r['share']:>6.1f}%")
    lines.append(fill * width)
    return "\n".join(lines)
