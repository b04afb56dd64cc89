"""`nori-jax plan calibrate`: record step profiles on the real engine, fit the step model.

Every engine step of these phases is a profile (its features, and its host and device times):
  1. decode grid: for each context C and batch B that fit, B requests of C random tokens are
     prefilled (those chunked-prefill steps are profiles too), then `steps` steps in which every
     row decodes;
  2. prefill: one prompt of each length alone (chunks from position 0 and after the context the
     earlier chunks wrote), then again beside a running decode batch (mixed steps);
  3. KV transfer: the pages of every layer copied to a second device, or out through the host
     and back when there is one device (the cost `--disaggregate` charges per request);
  4. check: for each decode shape, `steps` more steps timed as the engine runs them (overlapped
     scheduling), against what the fitted model predicts for the same steps.

Timing: profiles are taken with the core in synchronous mode, each launch waited for at once, so
the device is idle when a step starts:
    schedule_s, postprocess_s   the engine core's own stage clocks for the step
    launch_s                    host time of the executor's launch (transfer + dispatch)
    device_s                    from the end of the forward pass's dispatch until the step's
                                tokens are on the host (the sampler's dispatch overlaps it)
On a GPU that is the step's device execution. On a CPU the computation shares the cores with the
host and part of it may run inside the dispatch, so the split between host and device is only
nominal there; the sum, which is what the simulator replays, is still measured.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nori_jax.core.engine_core import EngineCore, EngineCoreRequest
from nori_jax.engine_config import EngineConfig
from nori_jax.plan import core_io
from nori_jax.plan.calibration import (
    CALIBRATION_DIR,
    CalibratedEngine,
    Calibration,
    CalibrationKey,
    KVTransfer,
    save_calibration,
)
from nori_jax.plan.features import StepFeatures, step_features
from nori_jax.plan.step_model import (
    DEVICE_TERMS,
    HOST_STAGES,
    HOST_TERMS,
    LinearModel,
    StepCosts,
    fit_quality,
)
from nori_jax.plan.virtual_device import loop_seconds
from nori_jax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_LONG = 1 << 30  # max_tokens of requests that decode until aborted


@dataclasses.dataclass(frozen=True)
class ProfileGrid:
    batches: tuple[int, ...] = (1, 16, 64, 256, 1024)  # those above max_num_seqs are skipped
    contexts: tuple[int, ...] = (256, 1024, 4096)
    prefill_lens: tuple[int, ...] = (128, 1024, 4096, 8000)
    mixed_batch: int = 32  # decoders running beside the prefill prompts (0: no mixed phase)
    steps: int = 8  # timed decode steps per shape (and as many overlapped ones for the check)

    def __post_init__(self) -> None:
        for name in ("batches", "contexts", "prefill_lens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be positive numbers, got {values}")
        if self.steps < 2 or self.mixed_batch < 0:
            raise ValueError(f"need steps >= 2 and mixed_batch >= 0, got {self}")


@dataclasses.dataclass(frozen=True)
class Profile:
    phase: str  # fill, decode, prefill, mixed
    features: StepFeatures
    schedule_s: float
    launch_s: float
    device_s: float
    postprocess_s: float


class _Recorder:
    """Wraps the engine's executor: in `measure` mode each launch waits for its step."""

    def __init__(self, inner, runner):
        self.inner, self.runner = inner, runner
        self.measure = True
        self.last: tuple[StepFeatures, float, float] | None = None
        self.launched: list[StepFeatures] = []

    @property
    def num_recompiles(self) -> int:
        return self.inner.num_recompiles

    def launch(self, plan):
        f = step_features(plan)
        self.launched.append(f)
        if not self.measure:
            return self.inner.launch(plan)
        lt = self.runner.launch_times
        before = lt.transfer + lt.forward
        t0 = time.perf_counter()
        handle = self.inner.launch(plan)
        t1 = time.perf_counter()
        result = self.inner.fetch(handle)
        t2 = time.perf_counter()
        forward_dispatched = t0 + (lt.transfer + lt.forward - before)
        self.last = (f, t1 - t0, max(t2 - forward_dispatched, 0.0))
        return _Done(result)

    def fetch(self, handle):
        return handle.result if isinstance(handle, _Done) else self.inner.fetch(handle)


@dataclasses.dataclass
class _Done:
    result: tuple


class _Session:
    """The engine core driven phase by phase, every step recorded."""

    def __init__(self, parts, grid: ProfileGrid, log: Callable[[str], None]):
        self.parts, self.grid, self.log = parts, grid, log
        core = parts.core
        self.rec = _Recorder(core.executor, parts.runner)
        self.sync = EngineCore(core.scheduler, core.builder, self.rec, async_scheduling=False)
        self.overlapped = EngineCore(core.scheduler, core.builder, self.rec, async_scheduling=True)
        self.scheduler = core.scheduler
        self.rng = np.random.default_rng(0)
        self.vocab = parts.model.config.vocab_size
        self.profiles: list[Profile] = []
        self.check: list[dict] = []
        self._n = 0

    def add(self, num_tokens: int, max_tokens: int) -> str:
        rid = f"cal{self._n}"
        self._n += 1
        prompt = self.rng.integers(10, self.vocab - 10, num_tokens).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.sync.add_request(EngineCoreRequest(rid, prompt, params, 0, [], time.monotonic()))
        return rid

    def step(self, phase: str):
        st = self.sync.step_times
        s0, p0 = st.schedule, st.postprocess
        out = self.sync.step()
        if self.rec.last is not None:
            f, launch_s, device_s = self.rec.last
            self.rec.last = None
            self.profiles.append(
                Profile(phase, f, st.schedule - s0, launch_s, device_s, st.postprocess - p0)
            )
        return out

    def until_first_tokens(self, ids: list[str], phase: str) -> None:
        waiting = set(ids)
        for _ in range(100_000):
            if not waiting:
                return
            waiting -= set(self.step(phase).request_ids)
        raise RuntimeError(f"{len(waiting)} calibration requests never got a first token")

    def until_finished(self, rid: str, phase: str) -> None:
        for _ in range(100_000):
            if any(f.request_id == rid for f in self.step(phase).finished):
                return
        raise RuntimeError(f"calibration request {rid} never finished")

    def abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.sync.abort(rid)

    def fits(self, batch: int, context: int) -> bool:
        cfg, alloc = self.scheduler.config, self.scheduler.allocator
        length = context + 3 * self.grid.steps + 4
        pages = batch * -(-length // cfg.page_size)
        usable = alloc.num_usable_pages * (1 - cfg.kv_headroom) * 0.95
        return batch <= cfg.max_num_seqs and length <= cfg.max_model_len and pages <= usable

    def decode_grid(self) -> None:
        g = self.grid
        for context in sorted(g.contexts):
            for batch in sorted(g.batches):
                if not self.fits(batch, context):
                    self.log(f"skip decode {batch} x {context}: beyond the engine's limits")
                    continue
                ids = [self.add(context, _LONG) for _ in range(batch)]
                self.until_first_tokens(ids, "fill")
                for _ in range(g.steps):
                    self.step("decode")
                self.check.append(self._overlapped_check(batch, context))
                self.abort(ids)
                self.log(
                    f"decode {batch} x {context}: {self.check[-1]['measured_ms']:.2f} ms/step "
                    f"overlapped ({len(self.profiles)} profiles so far)"
                )

    def _overlapped_check(self, batch: int, context: int) -> dict:
        """Time `steps` overlapped iterations; the model is replayed on them after the fit."""
        self.rec.measure, start = False, len(self.rec.launched)
        t0 = time.perf_counter()
        for _ in range(self.grid.steps):
            self.overlapped.step()
        wall = time.perf_counter() - t0
        self.overlapped.drain()
        self.rec.measure = True
        features = self.rec.launched[start:]
        return {
            "shape": f"decode {batch} x {context}",
            "measured_ms": 1e3 * wall / self.grid.steps,
            "features": features,
        }

    def prefill(self) -> None:
        g, cfg = self.grid, self.scheduler.config
        lens = [n for n in sorted(g.prefill_lens) if n + 2 <= cfg.max_model_len]
        for n in lens:
            self.until_finished(self.add(n, 2), "prefill")
        if not g.mixed_batch:
            return
        batch, context = min(g.mixed_batch, cfg.max_num_seqs - 1), min(g.contexts)
        if batch < 1 or not self.fits(batch + 1, max(context, max(lens, default=0))):
            self.log("skip the mixed phase: beyond the engine's limits")
            return
        ids = [self.add(context, _LONG) for _ in range(batch)]
        self.until_first_tokens(ids, "fill")
        for n in lens:
            self.until_finished(self.add(n, 2), "mixed")
        self.abort(ids)


def measure_kv_transfer(runner, bytes_per_page: int, repeats: int = 5) -> KVTransfer:
    """Latency and bandwidth of copying KV pages of every layer: to a second device when there
    is one, else to the host and back (the path of a transfer staged through host memory)."""
    import jax

    devices = jax.devices()
    kv = runner.kv_pages
    direct = len(devices) > 1 and len(runner.mesh.devices.flat) == 1
    target = devices[1] if direct else devices[0]

    def copy_seconds(n: int) -> float:
        pages = [x[1 : 1 + n] for x in kv]
        jax.block_until_ready(pages)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            if direct:
                moved = [jax.device_put(p, target) for p in pages]
            else:
                moved = [jax.device_put(np.asarray(p), target) for p in pages]
            jax.block_until_ready(moved)
            best = min(best, time.perf_counter() - t0)
        return best

    # Time over sizes, least squares for (latency, seconds per byte); with no measurable slope
    # (a pool too small to time) the largest copy's mean rate stands for the bandwidth.
    largest = max(2, min(runner.num_pages - 1, 1024))
    sizes = sorted({1, largest // 4, largest // 2, largest} - {0})
    seconds = np.array([copy_seconds(n) for n in sizes])
    nbytes = np.array(sizes, dtype=np.float64) * bytes_per_page
    slope, intercept = np.polyfit(nbytes, seconds, 1)
    if slope > 0:
        bw, latency = 1.0 / slope, max(float(intercept), 0.0)
    else:
        bw, latency = nbytes[-1] / seconds[-1], 0.0
    return KVTransfer(bw, latency, "device-device" if direct else "device-host-device")


def fit_launch_wait(
    costs: StepCosts, features: list[list[StepFeatures]], measured_s: list[float], steps: int
) -> float:
    """The launch_wait in [0, 1] whose replay of the overlapped checks is closest to their
    measured time per step (least squares on relative errors, over a grid of 0.01)."""
    if not features:
        return 0.0
    measured = np.asarray(measured_s)

    def error(w: float) -> float:
        c = dataclasses.replace(costs, launch_wait=w)
        pred = np.array([loop_seconds(c, f, overlapped=True) / steps for f in features])
        return float((((pred - measured) / measured) ** 2).sum())

    return min(np.linspace(0.0, 1.0, 101).tolist(), key=error)


def _git_commit() -> str:
    """The commit of the source that runs, or "unknown": only when this package's tree is the
    work tree's top (a copy of the sources inside another checkout would report that one's)."""
    source = Path(__file__).resolve().parent.parent.parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=source,
        )
    except OSError:
        return "unknown"
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != source:
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=5,
        cwd=source,
    ).stdout.strip()
    return lines[1] + ("+changes" if dirty else "")


def fit(profiles: list[Profile]) -> tuple[StepCosts, dict]:
    feats = [p.features for p in profiles]
    models = {"device": LinearModel.fit(DEVICE_TERMS, feats, [p.device_s for p in profiles])}
    for stage in HOST_STAGES:
        models[stage] = LinearModel.fit(
            HOST_TERMS, feats, [getattr(p, f"{stage}_s") for p in profiles]
        )
    quality = {
        name: fit_quality(m, feats, [getattr(p, f"{name}_s") for p in profiles])
        for name, m in models.items()
    }
    return StepCosts(**models), quality


def model_name(config: EngineConfig) -> str:
    if config.model is None:
        return "default"
    return Path(config.model).name.removesuffix(".gguf")


def calibrate(
    config: EngineConfig,
    grid: ProfileGrid = ProfileGrid(),
    log: Callable[[str], None] = logger.info,
) -> tuple[Calibration, list[Profile]]:
    """Build the engine of `config`, record the grid's profiles, fit them."""
    import jax

    from nori_jax.engine import build_engine
    from nori_jax.executor.kv_cache import bytes_per_page
    from pallas_kernels.kv_layout import kv_page_dtype

    # Profiles are of single steps (a multi-step launch would time k steps as one): the engine
    # is built with one step per launch whatever the preset says; the simulator composes them.
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, num_scheduler_steps=1)
    )
    started = time.perf_counter()
    parts = build_engine(config)
    mcfg, runner = parts.model.config, parts.runner
    log(f"engine built in {time.perf_counter() - started:.1f}s; recording profiles")
    session = _Session(parts, grid, log)
    session.decode_grid()
    session.prefill()
    profiles = session.profiles
    if parts.core.executor.num_recompiles:
        n = parts.core.executor.num_recompiles
        raise RuntimeError(f"{n} programs compiled while profiling: the profiles are not clean")
    costs, quality = fit(profiles)
    check_features = [c.pop("features") for c in session.check]
    measured = [c["measured_ms"] / 1e3 for c in session.check]
    costs = dataclasses.replace(
        costs, launch_wait=fit_launch_wait(costs, check_features, measured, grid.steps)
    )
    check = [
        c | {"predicted_ms": 1e3 * loop_seconds(costs, f, overlapped=True) / grid.steps}
        for c, f in zip(session.check, check_features, strict=True)
    ]
    dtype = np.dtype(parts.model.dtype).name
    # The pages' dtype, not the model's: fp8 pages (--kv-cache-dtype) are a calibration apart.
    kv_dtype = kv_page_dtype(config.kv_cache_dtype, parts.model.dtype)
    ps = parts.scheduler_config.page_size
    transfer = measure_kv_transfer(runner, bytes_per_page(mcfg, ps, kv_dtype))
    # The served core's send path on this host (no device involved): core_io.py.
    io = {n: core_io.measure(n) for n in core_io.MEASURED_API_SERVERS}
    kind = jax.devices()[0].device_kind
    kv_name = np.dtype(kv_dtype).name
    key = CalibrationKey(model_name(config), dtype, kv_name, kind, config.mesh.model)
    scfg = parts.scheduler_config
    engine = CalibratedEngine(
        page_size=ps,
        num_pages=runner.num_pages,
        max_model_len=scfg.max_model_len,
        max_num_seqs=scfg.max_num_seqs,
        max_num_batched_tokens=scfg.max_num_batched_tokens,
        vocab_size=mcfg.vocab_size,
        kv_bytes_per_token=bytes_per_page(mcfg, 1, kv_dtype),
        attention_backend=config.attention_backend,
        async_scheduling=config.async_scheduling,
    )
    feature_max = {
        f.name: float(max(getattr(p.features, f.name) for p in profiles))
        for f in dataclasses.fields(StepFeatures)
    }
    source = (
        f"nori-jax plan calibrate, {kind} ({jax.default_backend()}, jax {jax.__version__}), "
        f"{datetime.date.today().isoformat()}, commit {_git_commit()}, {len(profiles)} profiles"
    )
    cal = Calibration(
        key, engine, costs, feature_max, quality, source, False, transfer, tuple(check), core_io=io
    )
    return cal, profiles


def write(cal: Calibration, out: str | Path | None = None) -> Path:
    """To `out` (a file, or a directory for the key's file name), else configs/calibration/."""
    path = Path(out) if out else CALIBRATION_DIR
    if path.is_dir() or str(out or "").endswith("/") or not out:
        path = path / cal.key.filename
    header = (
        f"Step-time model of {cal.key.describe()}.\n"
        f"Recorded by: {cal.source}.\n"
        "Seconds per unit of each term (docs/planning.md); regenerate with nori-jax plan calibrate."
    )
    return save_calibration(cal, path, header)
