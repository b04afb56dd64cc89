"""The step-time model: device time and host time of a step as linear functions of its features.

    device_s   = c_step + c_bucket*T + c_kv*decode_kv_tokens + c_pairs*prefill_pairs + c_rows*rows
    schedule_s = a_step + a_rows*rows + a_tokens*tokens   (Scheduler.schedule + PlanBuilder.build)
    launch_s   = b_step + b_rows*rows + b_tokens*tokens   (buffer transfer + dispatch)
    post_s     = p_step + p_rows*rows + p_tokens*tokens   (Scheduler.update + the step's outputs)

`plan calibrate` fits one more device term, c_mixed*mixed_decode_kv_tokens (features.py: the
decode KV of a step that also prefills), to its mixed steps (CALIBRATED_DEVICE_TERMS); files
recorded before it profiled mixed steps at size have no such term (0), and an offline run can
set it instead (offline_fit.py).

T is the compiled token bucket, so device time is piecewise constant in the step's real tokens
between two buckets (the matmuls run over the padding too), plus the attention's KV reads (decode)
and (query, key) pairs (prefill), which scale with what the rows hold. Every coefficient is a
non-negative number of seconds per unit; they are fitted by non-negative least squares on the
*relative* error (each profile weighted by 1/its time, floored at 5% of the median), so a
1 ms step counts as much as a 30 ms one. A term the profiles never exercised (an all-zero
column) fits to 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nori_jax.plan.features import DERIVED, StepFeatures

DEVICE_TERMS = ("step", "bucket", "decode_kv_tokens", "prefill_pairs", "num_rows")
MIXED_KV_TERM = "mixed_decode_kv_tokens"
CALIBRATED_DEVICE_TERMS = (*DEVICE_TERMS, MIXED_KV_TERM)  # what `plan calibrate` fits
HOST_TERMS = ("step", "num_rows", "num_tokens")
HOST_STAGES = ("schedule", "launch", "postprocess")
MIN_WEIGHTED_S = 1e-5
_FEATURES = {f.name for f in dataclasses.fields(StepFeatures)} | set(DERIVED)


def term_matrix(features: Sequence[StepFeatures], terms: Sequence[str]) -> np.ndarray:
    """[N, len(terms)]: 1 for "step", else the feature of that name."""
    cols = [
        np.ones(len(features)) if t == "step" else np.array([getattr(f, t) for f in features])
        for t in terms
    ]
    return np.stack(cols, axis=1).astype(np.float64) if features else np.zeros((0, len(terms)))


@dataclasses.dataclass(frozen=True)
class LinearModel:
    terms: tuple[str, ...]
    coefficients: tuple[float, ...]  # seconds per unit of each term

    def __post_init__(self) -> None:
        if len(self.terms) != len(self.coefficients):
            raise ValueError(f"{len(self.terms)} terms but {len(self.coefficients)} coefficients")
        for t, c in zip(self.terms, self.coefficients, strict=True):
            if t != "step" and t not in _FEATURES:
                raise ValueError(f"unknown model term {t!r}; terms are 'step' and {_FEATURES}")
            if not (math.isfinite(c) and c >= 0):
                raise ValueError(f"coefficient of {t!r} must be finite and >= 0, got {c}")

    def predict(self, f: StepFeatures) -> float:
        total = 0.0
        for t, c in zip(self.terms, self.coefficients, strict=True):
            if c:
                total += c if t == "step" else c * getattr(f, t)
        return total

    def predict_many(self, features: Sequence[StepFeatures]) -> np.ndarray:
        return term_matrix(features, self.terms) @ np.asarray(self.coefficients)

    @classmethod
    def zero(cls, terms: Sequence[str] = HOST_TERMS) -> LinearModel:
        return cls(tuple(terms), (0.0,) * len(terms))

    @classmethod
    def fit(
        cls, terms: Sequence[str], features: Sequence[StepFeatures], seconds: Sequence[float]
    ) -> LinearModel:
        """Non-negative least squares on the relative error of each profile."""
        from scipy.optimize import nnls

        y = np.asarray(seconds, dtype=np.float64)
        if len(features) != len(y) or len(y) < len(terms):
            raise ValueError(
                f"fitting {len(terms)} terms needs at least as many profiles, got {len(y)}"
            )
        if not (np.isfinite(y).all() and (y >= 0).all()):
            raise ValueError("profile times must be finite and >= 0")
        # Relative weights, floored so that a stage that costs next to nothing (a few us of
        # timer noise) does not dominate the fit.
        w = 1.0 / np.maximum(y, max(MIN_WEIGHTED_S, 0.05 * float(np.median(y))))
        a = term_matrix(features, terms) * w[:, None]
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0  # a term never exercised: its column is 0 and fits to 0
        coef, _ = nnls(a / scale, y * w, maxiter=50 * len(terms))
        return cls(tuple(terms), tuple(float(c) for c in coef / scale))

    def to_dict(self) -> dict[str, float]:
        return dict(zip(self.terms, self.coefficients, strict=True))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> LinearModel:
        if not isinstance(d, Mapping) or not d:
            raise ValueError(f"{what}: expected a mapping of term -> seconds, got {d!r}")
        try:
            return cls(tuple(d), tuple(float(v) for v in d.values()))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: {e}") from None


def fit_quality(model: LinearModel, features: Sequence[StepFeatures], seconds) -> dict[str, float]:
    """How well the model reproduces the profiles it was fitted on (relative errors)."""
    y = np.asarray(seconds, dtype=np.float64)
    pred = model.predict_many(features)
    rel = np.abs(pred - y) / np.maximum(y, MIN_WEIGHTED_S)
    ss_res, ss_tot = float(((pred - y) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return {
        "profiles": len(y),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "median_rel_error": float(np.median(rel)),
        "p90_rel_error": float(np.percentile(rel, 90)),
        "max_rel_error": float(rel.max()),
    }


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """The simulator's whole cost model of one engine step."""

    device: LinearModel
    schedule: LinearModel = LinearModel.zero()
    launch: LinearModel = LinearModel.zero()
    postprocess: LinearModel = LinearModel.zero()
    # Share of the previous step's remaining device time that a launch waits out before its
    # dispatch (0: host and device overlap fully, as overlapped scheduling intends; 1: every
    # dispatch starts when the device is idle). Fitted by calibrate's overlapped check: on the
    # H200 a step took close to host + device time at 1,024 sequences (docs/benchmarks.md).
    launch_wait: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.launch_wait <= 1.0:
            raise ValueError(f"launch_wait={self.launch_wait} must be in [0, 1]")
