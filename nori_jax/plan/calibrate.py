"""`nori-jax plan calibrate`: record step profiles on the real engine, fit the step model.

Every engine step of these phases is a profile (its features, and its host and device times):
  1. decode grid: for each context C and batch B that fit, B requests of C random tokens are
     prefilled (those chunked-prefill steps are profiles too), then `steps` steps in which every
     row decodes;
  2. prefill: one prompt of each length alone (chunks from position 0 and after the context the
     earlier chunks wrote), then again beside running decode batches (mixed steps): each batch
     of `mixed_batches` (at most max_num_seqs - 1: the prompt needs a slot) beside the
     prompts, so the decode KV of the mixed steps spans what steps near the knee hold. Each
     runs at every context with the decoders of the smallest decode-grid batch that holds it,
     the others let go (no fill of its own; one larger than every grid batch is filled at the
     smallest context). The device model's `mixed_decode_kv_tokens` term is fitted to these
     steps and to the fill steps (whose first requests decode while later ones prefill);
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
    CALIBRATED_DEVICE_TERMS,
    DEVICE_TERMS,
    HOST_STAGES,
    HOST_TERMS,
    MIXED_KV_TERM,
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
    # Decoders running beside the prefill prompts, at every context (mixed steps; () for none).
    # Those above max_num_seqs - 1 are run at max_num_seqs - 1 (the prompt needs a slot).
    mixed_batches: tuple[int, ...] = (32, 256, 1024)
    steps: int = 8  # timed decode steps per shape (and as many overlapped ones for the check)

    def __post_init__(self) -> None:
        for name in ("batches", "contexts", "prefill_lens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be positive numbers, got {values}")
        if self.mixed_batches and min(self.mixed_batches) < 1:
            raise ValueError(f"mixed_batches must be positive numbers, got {self.mixed_batches}")
        if self.steps < 2:
            raise ValueError(f"need steps >= 2, got {self}")


@dataclasses.dataclass(frozen=True)
class Profile:
    phase: str  # fill, decode, prefill, mixed
    features: StepFeatures
    schedule_s: float
    launch_s: float
    device_s: float
    postprocess_s: float
    shape: str = ""  # of a mixed step: "mixed B x C", B decoders of context C beside a prompt


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

    def __init__(self, core, runner, vocab: int, grid: ProfileGrid, log: Callable[[str], None]):
        self.grid, self.log = grid, log
        self.rec = _Recorder(core.executor, runner)
        self.sync = EngineCore(core.scheduler, core.builder, self.rec, async_scheduling=False)
        self.overlapped = EngineCore(core.scheduler, core.builder, self.rec, async_scheduling=True)
        self.scheduler = core.scheduler
        self.rng = np.random.default_rng(0)
        self.vocab = vocab
        self.profiles: list[Profile] = []
        self.check: list[dict] = []
        self.shape = ""  # the label of the profiles being recorded (mixed steps only)
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
                Profile(
                    phase, f, st.schedule - s0, launch_s, device_s, st.postprocess - p0, self.shape
                )
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
                self.log(
                    f"decode {batch} x {context}: {self.check[-1]['measured_ms']:.2f} ms/step "
                    f"overlapped ({len(self.profiles)} profiles so far)"
                )
                self._mix_beside(ids, batch, context)

    def _mix_beside(self, ids: list[str], batch: int, context: int) -> None:
        """The mixed batches this decode shape holds, largest first, each with that many of its
        decoders (the others let go); then every decoder aborted."""
        grown = 2 * self.grid.steps + 1  # decode steps, overlapped check, its drain
        for m in self.mixed_hosts().get(batch, []):
            if not self.mixed_fits(m, context, grown):
                self.log(f"skip mixed {m} x {context}: beyond the engine's limits")
                continue
            self.abort(ids[m:])
            ids = ids[:m]
            grown += self.mix(m, context)
        self.abort(ids)

    def mixed_hosts(self) -> dict[int, list[int]]:
        """Decode-grid batch -> the mixed batches run beside its decoders, largest first: each
        beside the smallest grid batch that holds it (no fill of its own)."""
        cap = self.scheduler.config.max_num_seqs
        grid = sorted(b for b in self.grid.batches if b <= cap)
        hosts: dict[int, list[int]] = {}
        for m in self.mixed_batches():
            b = next((b for b in grid if b >= m), None)
            if b is not None:
                hosts.setdefault(b, []).insert(0, m)
        return hosts

    def mixed_batches(self) -> list[int]:
        """The grid's mixed batches, each at most max_num_seqs - 1 (the prompt needs a slot)."""
        cap = self.scheduler.config.max_num_seqs - 1
        return sorted({min(b, cap) for b in self.grid.mixed_batches} - {0}) if cap > 0 else []

    def prefill_lens(self) -> list[int]:
        cfg = self.scheduler.config
        return [n for n in sorted(self.grid.prefill_lens) if n + 2 <= cfg.max_model_len]

    def mixed_fits(self, batch: int, context: int, grown: int = 0) -> bool:
        """`batch` decoders of `context` tokens (already `grown` longer) and, beside them, each
        prompt in turn, within the engine's sequences, token budget, lengths and KV pool."""
        cfg, alloc = self.scheduler.config, self.scheduler.allocator
        lens = self.prefill_lens()
        room = cfg.max_num_batched_tokens - batch  # a step's tokens left for the prompt's chunk
        if not lens or batch + 1 > cfg.max_num_seqs or room < 1:
            return False
        steps = sum(-(-n // room) + 1 for n in lens)  # chunks, then the prompt's last token
        fill = -(-batch * context // cfg.max_num_batched_tokens)  # the first decode meanwhile
        length = context + grown + fill + steps + 4
        pages = batch * -(-length // cfg.page_size) + -(-(max(lens) + 2) // cfg.page_size)
        usable = alloc.num_usable_pages * (1 - cfg.kv_headroom) * 0.95
        return length <= cfg.max_model_len and pages <= usable

    def mix(self, batch: int, context: int) -> int:
        """Each prompt prefilled (and given its two tokens) beside the running decoders; the
        steps it took."""
        start, self.shape = len(self.profiles), f"mixed {batch} x {context}"
        for n in self.prefill_lens():
            self.until_finished(self.add(n, 2), "mixed")
        self.shape = ""
        kv = max(p.features.mixed_decode_kv_tokens for p in self.profiles[start:])
        self.log(
            f"mixed {batch} x {context}: {len(self.profiles) - start} steps beside the prompts, "
            f"up to {kv:,} decode KV tokens"
        )
        return len(self.profiles) - start

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
        for n in self.prefill_lens():
            self.until_finished(self.add(n, 2), "prefill")
        # A mixed batch larger than every decode-grid batch: its decoders filled here, at the
        # smallest context only (the fill steps cost more than the mixed ones they serve).
        context, hosted = min(self.grid.contexts), set().union(*self.mixed_hosts().values())
        for batch in self.mixed_batches():
            if batch in hosted:
                continue
            if not self.mixed_fits(batch, context):
                self.log(f"skip mixed {batch} x {context}: beyond the engine's limits")
                continue
            ids = [self.add(context, _LONG) for _ in range(batch)]
            self.until_first_tokens(ids, "fill")
            self.mix(batch, context)
            self.abort(ids)


def dry_run(
    engine, grid: ProfileGrid = ProfileGrid(), log: Callable[[str], None] = lambda _: None
) -> tuple[list[Profile], int]:
    """The steps `calibrate` takes on `engine` (a simulator.SimEngine), with the real scheduler
    and no device: the profiles (features, every time 0) and the overlapped check's steps.
    To count what a grid costs, and to give fits realistic steps in tests."""
    from types import SimpleNamespace

    from nori_jax.plan.simulator import build_core
    from nori_jax.plan.virtual_device import SimClock, SimExecutor

    zero = StepCosts(LinearModel.zero(DEVICE_TERMS))
    core = build_core(engine, SimExecutor(zero, SimClock(), engine.scheduler.max_num_seqs))
    runner = SimpleNamespace(launch_times=SimpleNamespace(transfer=0.0, forward=0.0))
    session = _Session(core, runner, engine.vocab_size, grid, log)
    session.decode_grid()
    session.prefill()
    return session.profiles, len(session.rec.launched) - len(session.profiles)


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
    """Each stage's model fitted to every profile. The device model has the mixed-step term
    (0 when no profile mixes decodes with a prefill chunk); `quality` gives each stage's errors
    and, where there are mixed steps, the device model's on them alone, with the term and with
    a fit that leaves it out (`device_mixed_steps`, `device_mixed_steps_no_term`)."""
    feats = [p.features for p in profiles]
    device_s = [p.device_s for p in profiles]
    models = {"device": LinearModel.fit(CALIBRATED_DEVICE_TERMS, feats, device_s)}
    for stage in HOST_STAGES:
        models[stage] = LinearModel.fit(
            HOST_TERMS, feats, [getattr(p, f"{stage}_s") for p in profiles]
        )
    quality = {
        name: fit_quality(m, feats, [getattr(p, f"{name}_s") for p in profiles])
        for name, m in models.items()
    }
    mixed = [i for i, f in enumerate(feats) if getattr(f, MIXED_KV_TERM)]
    if len(mixed) >= 2:
        without = LinearModel.fit(DEVICE_TERMS, feats, device_s)
        sub, sub_s = [feats[i] for i in mixed], [device_s[i] for i in mixed]
        quality["device_mixed_steps"] = fit_quality(models["device"], sub, sub_s)
        quality["device_mixed_steps_no_term"] = fit_quality(without, sub, sub_s)
    return StepCosts(**models), quality


def mixed_report(costs: StepCosts, profiles: list[Profile]) -> list[dict]:
    """Per mixed shape (decoders x context beside the prompts), over its steps that hold a
    prefill chunk: the measured device time against the model's, and the mixed-step term's
    part of the model's, in ms per step (means)."""
    shapes: dict[str, list[Profile]] = {}
    for p in profiles:
        if p.shape and p.features.prefill_tokens:
            shapes.setdefault(p.shape, []).append(p)
    coef = costs.device.to_dict().get(MIXED_KV_TERM, 0.0)
    return [
        {
            "shape": shape,
            "steps": len(ps),
            "decode_kv_tokens": float(np.mean([p.features.decode_kv_tokens for p in ps])),
            "measured_ms": 1e3 * float(np.mean([p.device_s for p in ps])),
            "predicted_ms": 1e3
            * float(np.mean(costs.device.predict_many([p.features for p in ps]))),
            "term_ms": 1e3 * coef * float(np.mean([p.features.mixed_decode_kv_tokens for p in ps])),
        }
        for shape, ps in shapes.items()
    ]


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
    session = _Session(parts.core, runner, mcfg.vocab_size, grid, log)
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
    # The mixed-step term's range too, where the profiles exercised it (offline_fit.py reads
    # it as "the term was calibrated").
    if mixed_max := max(getattr(p.features, MIXED_KV_TERM) for p in profiles):
        feature_max[MIXED_KV_TERM] = float(mixed_max)
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
