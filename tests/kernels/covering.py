"""Covering designs for the kernel tests: few cases that hold every allowed pair of values.

A full product of the kernel's parameters is hundreds of thousands of cases, each seconds of
interpret mode. A strength-2 covering design (pairwise testing) holds, for every two parameters,
every pair of their values that the constraints allow, in some case; faults that need one value or
an interaction of two are then all reached. The design is built greedily (AETG: start each case
from an uncovered pair, then give each other parameter the value that covers the most uncovered
pairs) from a fixed seed, so the cases are the same in every run.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence

# allowed(assignment) -> bool on a partial assignment; constraints are between two parameters.
Allowed = Callable[[Mapping[str, object]], bool]


def _pairs_of(case: Mapping[str, object], names: Sequence[str]) -> set:
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}


def _gain(case: Mapping[str, object], name: str, value, uncovered: set) -> int:
    """Uncovered pairs that name=value would cover together with the case's values so far."""
    return sum(
        (n, v, name, value) in uncovered or (name, value, n, v) in uncovered
        for n, v in case.items()
    )


def allowed_pairs(factors: Mapping[str, Sequence], allowed: Allowed) -> set:
    names = list(factors)
    return {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
        if allowed({a: va, b: vb})
    }


def pairwise(
    factors: Mapping[str, Sequence],
    allowed: Allowed,
    *,
    seed: int = 0,
    tries: int = 16,
) -> list[dict]:
    """Cases (one value per factor) in which every allowed pair of values occurs."""
    names = list(factors)
    rng = random.Random(seed)
    uncovered = allowed_pairs(factors, allowed)
    cases: list[dict] = []
    while uncovered:
        best, best_gain = None, -1
        for _ in range(tries):
            a, va, b, vb = rng.choice(sorted(uncovered, key=repr))
            case = {a: va, b: vb}
            for name in rng.sample(names, len(names)):
                if name in case:
                    continue
                options = [v for v in factors[name] if allowed({**case, name: v})]
                if not options:
                    break
                gains = [_gain(case, name, v, uncovered) for v in options]
                top = max(gains)
                case[name] = rng.choice(
                    [v for v, g in zip(options, gains, strict=True) if g == top]
                )
            if len(case) < len(names):
                continue
            new = len(_pairs_of({n: case[n] for n in names}, names) & uncovered)
            if new > best_gain:
                best, best_gain = {n: case[n] for n in names}, new
        assert best is not None, "the constraints leave no case"
        cases.append(best)
        uncovered -= _pairs_of(best, names)
    return cases


def uncovered_pairs(
    cases: Sequence[Mapping[str, object]], factors: Mapping[str, Sequence], allowed: Allowed
) -> set:
    """Allowed pairs that no case holds (empty for a covering design)."""
    held = set().union(*(_pairs_of(c, list(factors)) for c in cases))
    return allowed_pairs(factors, allowed) - held
