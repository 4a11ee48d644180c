"""The AdaShadow Table 9 experiment on this machine: is the runtime latency predictor right?

Offline (idle): the model's per-unit profile (profiler.profile_model) is measured once (or
an earlier run's profile.json is reused: `--profile`) and a fixed sparse plan is chosen:
planner.solve at `sigma` with importance = ones on the offline profile (the most units
that fit sigma*T; deterministic for a given profile). Then, for each
resource condition, competing processes are started (bounded in time, always stopped), and
over >= 30 batches we

- measure the backward latency of that plan: forward, entropy loss, torch.autograd.grad to
  the selected units' parameters only (as the engine does); only the backward is timed;
- sample telemetry between batches (psutil competing processes, sysfs frequency, perf LLC
  hit rate) and predict T_b'(S) = sum_{l in S} w_l + sum_{l > d} x_l (DESIGN §3) from
  predictor.runtime_times(profile, pi1, pi2) (runtime predictor), from those corrected by
  the measured forward (predictor.planning_times) and further by the measured backwards of
  the batches before (backward_feedback), and from the offline times alone (the
  ElasticTrainer-style offline predictor);
- report error % = |median prediction - median measurement| / median measurement.

Conditions: offline (idle), dr2 (3 compute-bound competitors), dr3 (1 cache-thrashing
memory-bound competitor), dr4 (both); dr1 (thermal/DVFS) only where sysfs exposes cpufreq.

pi1 / pi2 come from the product's code:
tta_core.adashadow.expansion.ExpansionModel.evaluate, the same
call the resource monitor's TelemetrySampler makes, evaluated for both runtime models
("share", the default headline, and "paper"; `model` picks the headline one) and both fed
to predictor.runtime_times (Eq. 4). The models and the pi2 sources are described in
tta_core.adashadow.expansion; what is specific to this bench:
- The reference (expansion.OfflineReference) is this run's own offline profiling run, not
  the `tta calibrate` file: n_off = competing processes psutil saw while profiling (a shared
  machine is never idle and the profile already contains its background load), the CPU
  frequency and LLC hit rate then, and the BandwidthProbe (telemetry.BandwidthProbe)
  bandwidth measured right after profiling (mean of `probe_window` runs).
- pi2 without LLC counters (no PMU in a VM): with `pi2_mode="probe"` the probe runs between
  batches and pi2 uses the mean of its last `probe_window` runs; `pi2_mode="perf"` uses
  only the hit rate (pi2 = 1 when unknown).
- T (torch threads) is `threads`, C (cores) `cores` or this process's affinity.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tta_core.adashadow import planner
from tta_core.adashadow.calibration import BusyProcesses
from tta_core.adashadow.expansion import MODELS, PI2_MODES, ExpansionModel, OfflineReference
from tta_core.adashadow.predictor import Calibration, UnitProfile, planning_times, runtime_times
from tta_core.adashadow.profiler import SPLITS
from tta_core.io.strict_json import dumps as json_dumps
from tta_core.model.units import StagedModel
from tta_core.runtime.backward_feedback import BackwardFeedback
from tta_core.runtime.losses import entropy_loss
from tta_core.telemetry.bandwidth_probe import BandwidthProbe

SCHEMA = "tta.predictor_bench/1"
#: condition -> (compute-bound competitors, memory-bound competitors)
CONDITIONS: dict[str, tuple[int, int]] = {
    "offline": (0, 0), "dr2": (3, 0), "dr3": (0, 1), "dr4": (3, 1)}


@dataclass
class BenchConfig:
    """What to run. Times in seconds."""

    arch: str = "resnet50"
    image_size: int = 224
    batch_size: int = 4
    batches: int = 30
    threads: int = 1
    conditions: tuple[str, ...] = ("offline", "dr2", "dr3", "dr4")
    sigma: float = 0.5
    num_classes: int = 16
    profile_repeats: int = 5
    warmup: int = 2
    settle_s: float = 2.2  # after starting competitors: two psutil windows (see run_condition)
    max_condition_s: float = 90.0  # measuring stops here even if fewer batches were done
    pi2_mode: str = "probe"
    probe_window: int = 8  # pi2 probe: mean bandwidth of the last k probes (a monitor's smoothing)
    model: str = "share"  # headline runtime model (both are evaluated)
    split: str = "plans"  # profiler split of a unit's backward into dw / dx (profiler.SPLITS)
    cores: int = 0  # CPUs the scheduler shares ("share" model); 0 = this process's affinity

    def __post_init__(self) -> None:
        bad = [c for c in self.conditions if c not in CONDITIONS]
        if bad or not self.conditions:
            raise ValueError(f"conditions must be among {tuple(CONDITIONS)}, got {bad or ()}")
        if self.pi2_mode not in PI2_MODES:
            raise ValueError(f"pi2_mode must be one of {PI2_MODES}, got {self.pi2_mode!r}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.cores < 0:
            raise ValueError(f"cores must be >= 0, got {self.cores!r}")
        for name in ("image_size", "batch_size", "batches", "threads", "profile_repeats",
                     "probe_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0.0 < self.sigma <= 1.0:
            raise ValueError(f"sigma must be in (0, 1], got {self.sigma!r}")
        if not self.max_condition_s > 0:
            raise ValueError(f"max_condition_s must be > 0, got {self.max_condition_s!r}")


@dataclass
class ConditionResult:
    """One row of Table 9."""

    name: str
    compute_procs: int
    memory_procs: int
    batches: int
    measured_ms: float  # median backward latency of the plan
    measured_iqr_ms: tuple[float, float]
    offline_pred_ms: float
    runtime_pred_ms: float
    err_offline_pct: float
    err_runtime_pct: float
    runtime_alt_pred_ms: float  # the other runtime model (see BenchConfig.model)
    err_runtime_alt_pct: float
    # runtime times + "memory" forward feedback (the scheduler's forward_feedback option)
    # (predictor.feedback_pis; median over batches)
    feedback_pred_ms: float
    err_feedback_pct: float
    err_feedback_per_batch_pct: float  # median over batches of |pred_i - meas_i| / meas_i
    # the same with "uniform" feedback (the engine's and the scheduler's default)
    feedback_uniform_pred_ms: float
    err_feedback_uniform_pct: float
    # uniform feedback x the closed-loop backward correction (backward_feedback), learnt
    # from this run's earlier batches (carried over from the previous condition, as a
    # running system would); backward_factor: its median over the condition
    backward_fb_pred_ms: float
    err_backward_fb_pct: float
    backward_factor: float
    measured_mean_ms: float
    pi1: float  # headline model's pi1, median over batches (relative to the offline run)
    pi2: float  # headline model's pi2
    pi1_alt: float
    pi2_alt: float
    share: float  # round-robin sharing factor s(n)
    pi2_mem: float  # memory expansion before sharing (hit rate, probe or 1)
    pi2_source: str  # "perf" | "probe" | "none"
    competing: float  # median competing processes seen by psutil
    cache_hit_rate: float
    probe_bw_gbs: float
    cpu_percent: float
    loadavg_1m: float
    elapsed_s: float
    truncated: bool  # stopped by max_condition_s before `batches` were measured
    measured_all_ms: list[float] = field(default_factory=list)


@dataclass
class BenchResult:
    """Everything the command writes (JSON), plus the table/plot helpers."""

    config: dict[str, Any]
    calibration: dict[str, Any]
    calibration_source: str
    plan_units: list[str]
    n_units: int
    forward_ms: float
    full_backward_ms: float
    offline: OfflineReference  # what the offline profiling run saw
    offline_profile_s: float  # time spent profiling (0 when a profile was reused)
    conditions: list[ConditionResult]
    skipped: dict[str, str]
    sources: dict[str, str]
    loadavg_start: tuple[float, float, float]
    loadavg_end: tuple[float, float, float]
    profile: UnitProfile | None = None  # the offline profile used (written as profile.json)
    host: str = field(default_factory=socket.gethostname)
    machine: str = field(default_factory=platform.machine)
    cpu_count: int = field(default_factory=lambda: os.cpu_count() or 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("profile")  # arrays: written on its own by write_outputs
        return _clean({"schema": SCHEMA, **d})


def _clean(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None, tuples -> lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


# ---------------------------------------------------------------- predictions
def plan_backward_ms(w: np.ndarray, x: np.ndarray, update: np.ndarray) -> float:
    """T_b'(S) of the DESIGN §3 contract (planner.backward_cost)."""
    return planner.backward_cost(w, x, update)


def fixed_plan(profile: UnitProfile, stage_start: np.ndarray, sigma: float) -> np.ndarray:
    """planner.solve on the offline profile with importance = ones (most units in budget)."""
    n = len(profile.unit_names)
    plan = planner.solve(planner.PlanProblem(
        w=profile.w_ms, x=profile.x_ms, r=profile.r_ms, stage_start=stage_start,
        importance=np.ones(n), forward_ms=profile.forward_ms, sigma=sigma))
    if not plan.update.any():
        raise ValueError(f"sigma={sigma} leaves no budget for any unit: choose a larger sigma")
    return np.asarray(plan.update, dtype=bool)


class PlanBackward:
    """Times the sparse backward of a fixed plan on a fixed input batch."""

    def __init__(self, staged: StagedModel, update: np.ndarray, x: torch.Tensor) -> None:
        self.model, self.x = staged.model, x
        self.params = [p for u in staged.units if update[u.index] for p in u.parameters()]
        if not self.params:
            raise ValueError("the plan selects no parameters")

    def once(self) -> tuple[float, float]:
        """(forward ms, backward ms): forward + entropy loss, then autograd.grad to the
        plan's params only; the forward is timed for the engine's forward feedback."""
        with torch.enable_grad():
            t0 = time.perf_counter()
            logits = self.model(self.x)
            t1 = time.perf_counter()
            loss = entropy_loss(logits)
            t2 = time.perf_counter()
            grads = torch.autograd.grad(loss, self.params)
            t3 = time.perf_counter()
        del grads
        return (t1 - t0) * 1e3, (t3 - t2) * 1e3


@dataclass
class _Trace:
    """Per-batch values collected during one condition."""

    measured: list[float] = field(default_factory=list)
    runtime_pred: list[float] = field(default_factory=list)
    alt_pred: list[float] = field(default_factory=list)
    fb_pred: list[float] = field(default_factory=list)
    fb_uniform_pred: list[float] = field(default_factory=list)
    bwd_fb_pred: list[float] = field(default_factory=list)
    bwd_factor: list[float] = field(default_factory=list)
    pi1: list[float] = field(default_factory=list)
    pi1_alt: list[float] = field(default_factory=list)
    pi2_alt: list[float] = field(default_factory=list)
    share: list[float] = field(default_factory=list)
    pi2_mem: list[float] = field(default_factory=list)
    pi2: list[float] = field(default_factory=list)
    pi2_src: list[str] = field(default_factory=list)
    competing: list[float] = field(default_factory=list)
    hit: list[float] = field(default_factory=list)
    bw: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def _nanmedian(xs: list[float]) -> float:
    arr = np.asarray(xs, dtype=np.float64)
    return float(np.nanmedian(arr)) if np.isfinite(arr).any() else float("nan")


def _err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas * 100.0 if meas > 0 else float("nan")


# ---------------------------------------------------------------- the experiment
@dataclass
class _Bench:
    """State shared by all conditions of one run."""

    cfg: BenchConfig
    profile: UnitProfile
    update: np.ndarray
    meas: PlanBackward
    sampler: Any  # TelemetrySampler
    probe: BandwidthProbe | None
    models: dict[str, ExpansionModel]  # both runtime models on the offline reference
    backward_fb: BackwardFeedback = field(default_factory=BackwardFeedback)

    def feedback_prediction(self, pis: tuple[float, float], forward_ms: float,
                            mode: str, backward_factor: float = 1.0) -> float:
        """What the planners plan with (predictor.planning_times): the runtime times at
        `pis` corrected by this batch's measured forward (`mode`: feedback_pis) and by
        `backward_factor`."""
        w, x, _ = planning_times(self.profile, *pis, forward_ms, mode,
                                 backward_factor=backward_factor)
        return plan_backward_ms(w, x, self.update)

    def observe(self, trace: _Trace) -> tuple[float, float]:
        """Telemetry + probe between batches -> the runtime predictions; returns the headline
        model's (pi1, pi2)."""
        s = self.sampler.sample()
        if self.probe is not None:
            trace.bw.append(self.probe.measure())
        bw = float(np.mean(trace.bw[-self.cfg.probe_window:])) if trace.bw else float("nan")
        alt_name = next(m for m in MODELS if m != self.cfg.model)
        head = self.models[self.cfg.model].evaluate(s, bw)
        alt = self.models[alt_name].evaluate(s, bw)
        for ex, out in ((head, trace.runtime_pred), (alt, trace.alt_pred)):
            w, x, _ = runtime_times(self.profile, ex.pi1, ex.pi2)
            out.append(plan_backward_ms(w, x, self.update))
        trace.pi1.append(head.pi1)
        trace.pi1_alt.append(alt.pi1)
        trace.pi2_alt.append(alt.pi2)
        trace.share.append(head.share)
        trace.pi2_mem.append(head.pi2_mem)
        trace.pi2.append(head.pi2)
        trace.pi2_src.append(head.pi2_source)
        trace.competing.append(s.competing_processes)
        trace.hit.append(s.cache_hit_rate)
        trace.cpu.append(s.cpu_percent)
        return head.pi1, head.pi2


def _measure(bench: _Bench, tick: Callable[[int], None]) -> tuple[_Trace, bool, float]:
    """Warm-up, then up to cfg.batches (observe, time the backward); bounded in time."""
    cfg = bench.cfg
    trace = _Trace()
    for _ in range(cfg.warmup):
        bench.meas.once()
    t0 = time.monotonic()
    truncated = False
    for _ in range(cfg.batches):
        if time.monotonic() - t0 > cfg.max_condition_s:
            truncated = True
            break
        pis = bench.observe(trace)
        forward_ms, backward_ms = bench.meas.once()
        trace.measured.append(backward_ms)
        trace.fb_pred.append(bench.feedback_prediction(pis, forward_ms, "memory"))
        trace.fb_uniform_pred.append(bench.feedback_prediction(pis, forward_ms, "uniform"))
        fb = bench.backward_fb
        trace.bwd_factor.append(fb.factor)
        trace.bwd_fb_pred.append(bench.feedback_prediction(pis, forward_ms, "uniform",
                                                           fb.factor))
        fb.update(trace.bwd_fb_pred[-1], backward_ms)  # known only after this batch
        tick(1)
    return trace, truncated, time.monotonic() - t0


def run_condition(bench: _Bench, name: str,
                  tick: Callable[[int], None] = lambda _n: None) -> ConditionResult:
    """Start the condition's competitors, measure, stop them (also on errors)."""
    nc, nm = CONDITIONS[name]
    cfg = bench.cfg
    life = cfg.settle_s + cfg.max_condition_s + 60.0  # hard bound even if we hang
    with BusyProcesses(nc, "compute", life), BusyProcesses(nm, "memory", life):
        # psutil rates a pid only once it was in the previous scan: the first window after
        # the start only registers the new pids, the second one counts them
        for _ in range(2):
            time.sleep(max(cfg.settle_s / 2, 1.05))
            bench.sampler.sample()
        trace, truncated, elapsed = _measure(bench, tick)
    meas = float(np.median(trace.measured))
    q1, q3 = np.percentile(trace.measured, [25, 75])
    off_pred = plan_backward_ms(bench.profile.w_ms, bench.profile.x_ms, bench.update)
    rt_pred = float(np.median(trace.runtime_pred))
    alt_pred = float(np.median(trace.alt_pred))
    fb_pred = float(np.median(trace.fb_pred))
    fb_uni = float(np.median(trace.fb_uniform_pred))
    bwd_fb = float(np.median(trace.bwd_fb_pred))
    per_batch = [_err(p, m) for p, m in zip(trace.fb_pred, trace.measured, strict=True)]
    srcs = sorted(set(trace.pi2_src), key=trace.pi2_src.count)
    return ConditionResult(
        name=name, compute_procs=nc, memory_procs=nm, batches=len(trace.measured),
        measured_ms=meas, measured_iqr_ms=(float(q1), float(q3)), offline_pred_ms=off_pred,
        runtime_pred_ms=rt_pred, err_offline_pct=_err(off_pred, meas),
        err_runtime_pct=_err(rt_pred, meas), runtime_alt_pred_ms=alt_pred,
        err_runtime_alt_pct=_err(alt_pred, meas), feedback_pred_ms=fb_pred,
        err_feedback_pct=_err(fb_pred, meas), err_feedback_per_batch_pct=_nanmedian(per_batch),
        feedback_uniform_pred_ms=fb_uni, err_feedback_uniform_pct=_err(fb_uni, meas),
        backward_fb_pred_ms=bwd_fb, err_backward_fb_pct=_err(bwd_fb, meas),
        backward_factor=float(np.median(trace.bwd_factor)),
        measured_mean_ms=float(np.mean(trace.measured)),
        pi1=_nanmedian(trace.pi1), pi1_alt=_nanmedian(trace.pi1_alt),
        pi2_alt=_nanmedian(trace.pi2_alt), share=_nanmedian(trace.share),
        pi2_mem=_nanmedian(trace.pi2_mem),
        pi2=_nanmedian(trace.pi2), pi2_source=srcs[-1], competing=_nanmedian(trace.competing),
        cache_hit_rate=_nanmedian(trace.hit), probe_bw_gbs=_nanmedian(trace.bw),
        cpu_percent=_nanmedian(trace.cpu), loadavg_1m=os.getloadavg()[0], elapsed_s=elapsed,
        truncated=truncated, measured_all_ms=[float(v) for v in trace.measured])


def _sampler() -> Any:
    """psutil (our competitors count: exclude_children=False), sysfs, perf on this pid.

    No calibration: the bench evaluates the expansion models itself (`_Bench.observe`),
    relative to its own offline run.
    """
    from tta_core.telemetry import PerfSource, PsutilSource, SysfsSource, TelemetrySampler

    return TelemetrySampler(sources=[PsutilSource(exclude_children=False), SysfsSource(),
                                     PerfSource(os.getpid())])


def _build(cfg: BenchConfig) -> tuple[StagedModel, torch.Tensor]:
    from tta_core.model.norms import set_bn_mode
    from tta_core.model.units import decompose
    from tta_core.model.zoo import build_model

    model = build_model(cfg.arch, cfg.num_classes)
    set_bn_mode(model, "batch")  # TTA: BN on batch statistics, as adaptation runs
    shape = (3, cfg.image_size, cfg.image_size)
    staged = decompose(model, shape, arch=cfg.arch)
    gen = torch.Generator().manual_seed(0)
    return staged, torch.randn(cfg.batch_size, *shape, generator=gen)


def check_profile(profile: UnitProfile, staged: StagedModel, cfg: BenchConfig) -> None:
    """Raise ValueError unless `profile` was measured for this model, batch and input."""
    profile.check_units([u.name for u in staged.units])
    shape = (3, cfg.image_size, cfg.image_size)
    if profile.batch_size != cfg.batch_size or tuple(profile.input_shape) != shape:
        raise ValueError(f"profile was measured at batch {profile.batch_size}, input "
                         f"{tuple(profile.input_shape)}; the bench runs batch "
                         f"{cfg.batch_size}, input {shape}")


def offline_phase(staged: StagedModel, cfg: BenchConfig, sampler: Any,
                  probe: BandwidthProbe | None, profile: UnitProfile | None = None,
                  ) -> tuple[UnitProfile, OfflineReference, float]:
    """Profile idle -> (profile, reference, profiling seconds); `sampler` was made just
    before, so its first psutil window spans the profiling run (padded to >= 1 s). A given
    `profile` (an earlier run's, `tta profile`'s) is reused: the reference is still
    measured now, and the offline condition then shows whether the profile still fits."""
    from tta_core.adashadow.profiler import profile_model

    t0 = time.monotonic()
    if profile is None:
        profile = profile_model(staged, cfg.batch_size, cfg.profile_repeats, split=cfg.split,
                                input_shape=(3, cfg.image_size, cfg.image_size))
    else:
        check_profile(profile, staged, cfg)
    elapsed = time.monotonic() - t0
    time.sleep(max(0.0, 1.05 - elapsed))
    s = sampler.sample()
    bw = float(np.mean([probe.measure() for _ in range(cfg.probe_window)])) if probe else \
        float("nan")
    n = s.competing_processes if math.isfinite(s.competing_processes) else 0.0
    hit = s.cache_hit_rate if 0.0 <= s.cache_hit_rate <= 1.0 else float("nan")
    return profile, OfflineReference(competing=n, freq_mhz=s.cpu_freq_mhz, cache_hit_rate=hit,
                                     probe_bw_gbs=bw), elapsed


def _skipped(sampler: Any) -> dict[str, str]:
    freq = sampler.sample().cpu_freq_mhz
    sysfs = next((d for d in sampler.describe() if d.name == "sysfs"), None)
    detail = sysfs.detail if sysfs else "no sysfs source"
    if not math.isfinite(freq):
        return {"dr1": f"thermal/DVFS not observable here: {detail}; the frequency term of "
                       "pi1 can be neither read nor induced"}
    return {"dr1": "not induced: heating the CPU until it throttles is not bounded in time "
                   f"(cpufreq is readable: {freq:.0f} MHz, so pi1 would track it)"}


def run_bench(cfg: BenchConfig, cal: Calibration, cal_source: str = "",
              tick: Callable[[int], None] = lambda _n: None,
              profile: UnitProfile | None = None) -> BenchResult:
    """The whole experiment; torch threads are set to cfg.threads and restored after.
    `profile`: reuse this offline profile instead of measuring one (see offline_phase)."""
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    load0 = os.getloadavg()
    staged, x = _build(cfg)
    probe = BandwidthProbe() if cfg.pi2_mode == "probe" else None
    sampler = _sampler()  # its psutil window starts now: right before profiling
    try:
        profile, off, profile_s = offline_phase(staged, cfg, sampler, probe, profile)
        tick(1)
        update = fixed_plan(profile, staged.stage_start(), cfg.sigma)
        models = {m: ExpansionModel(model=m, calibration=cal, reference=off, threads=cfg.threads,
                                    cores=cfg.cores, pi2_mode=cfg.pi2_mode) for m in MODELS}
        bench = _Bench(cfg, profile, update, PlanBackward(staged, update, x), sampler,
                       probe, models)
        rows = [run_condition(bench, name, tick) for name in cfg.conditions]
        skipped = _skipped(sampler)
        sources = {d.name: d.detail for d in sampler.describe()}
    finally:
        sampler.close()
        torch.set_num_threads(prev_threads)
    return BenchResult(
        config=asdict(cfg), calibration=asdict(cal), calibration_source=cal_source,
        plan_units=[n for n, u in zip(profile.unit_names, update, strict=True) if u],
        n_units=len(profile.unit_names), forward_ms=profile.forward_ms,
        full_backward_ms=float(profile.w_ms.sum() + profile.x_ms[1:].sum()), offline=off,
        offline_profile_s=profile_s, conditions=rows, skipped=skipped, sources=sources,
        loadavg_start=load0, loadavg_end=os.getloadavg(), profile=profile)


# ---------------------------------------------------------------- outputs
def to_markdown(res: BenchResult) -> str:
    """Table 9 style markdown table (+ the skipped conditions and the machine load)."""
    cfg = res.config
    alt = next(m for m in MODELS if m != cfg["model"])
    lines = [
        f"Predictor bench: {cfg['arch']} {cfg['image_size']} px, batch {cfg['batch_size']}, "
        f"{cfg['threads']} torch thread(s); plan = {len(res.plan_units)}/{res.n_units} units "
        f"(sigma {cfg['sigma']}); n_off = {res.offline.competing:g} competing processes while "
        f"profiling; runtime model: {cfg['model']} (also shown: {alt}); pi2 without LLC "
        f"counters: {cfg['pi2_mode']}",
        "",
        "| condition | started (cpu+mem) | n | pi1 | pi2 (src) | measured ms median (mean) | "
        "runtime pred ms | runtime err % | + memory feedback pred ms | err % (per batch) | "
        "+ uniform feedback err % | + backward feedback pred ms (factor) | err % | "
        f"offline pred ms | offline err % | {alt} pi1 / pi2 | {alt} err % | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res.conditions:
        lines.append(
            f"| {c.name} | {c.compute_procs}+{c.memory_procs} | {c.competing:g} | {c.pi1:.3f} | "
            f"{c.pi2:.3f} ({c.pi2_source}) | {c.measured_ms:.1f} ({c.measured_mean_ms:.1f}) | "
            f"{c.runtime_pred_ms:.1f} | "
            f"{c.err_runtime_pct:.1f} | {c.feedback_pred_ms:.1f} | {c.err_feedback_pct:.1f} "
            f"({c.err_feedback_per_batch_pct:.1f}) | {c.err_feedback_uniform_pct:.1f} | "
            f"{c.backward_fb_pred_ms:.1f} ({c.backward_factor:.3f}) | "
            f"{c.err_backward_fb_pct:.1f} | "
            f"{c.offline_pred_ms:.1f} | {c.err_offline_pct:.1f} | "
            f"{c.pi1_alt:.3f} / {c.pi2_alt:.3f} | {c.err_runtime_alt_pct:.1f} | "
            f"{c.loadavg_1m:.2f} |")
    lines += ["", "- runtime: offline profile x Eq. 4 with pi1/pi2 from telemetry; + memory "
              "feedback: telemetry pi1, pi2 solved so that Eq. 4 gives the forward measured on "
              "the batch (scheduler option); + uniform feedback: every time "
              "scaled by measured / predicted forward (engine and scheduler default); "
              "see predictor.feedback_pis; + backward feedback: uniform, then scaled by the "
              "EMA of measured / predicted backward of the earlier batches "
              "(tta_core.runtime.backward_feedback: what the ROS nodes plan with)",
              *(f"- {k} skipped: {v}" for k, v in res.skipped.items()),
              f"- load average (1/5/15 min) start {tuple(round(v, 2) for v in res.loadavg_start)}"
              f", end {tuple(round(v, 2) for v in res.loadavg_end)}"]
    return "\n".join(lines) + "\n"


def plot_errors(res: BenchResult, path: Path) -> Path:
    """Bar chart: error % per condition, runtime vs offline-only predictor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c.name for c in res.conditions]
    pos = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    alt = next(m for m in MODELS if m != res.config["model"])
    bars = ((f"runtime ({res.config['model']})", "err_runtime_pct"),
            ("+ memory feedback", "err_feedback_pct"),
            ("+ uniform feedback", "err_feedback_uniform_pct"),
            ("+ uniform + backward feedback (ROS nodes)", "err_backward_fb_pct"),
            (f"runtime ({alt})", "err_runtime_alt_pct"), ("offline only", "err_offline_pct"))
    width = 0.8 / len(bars)
    for i, (label, key) in enumerate(bars):
        ax.bar(pos + (i - (len(bars) - 1) / 2) * width,
               [getattr(c, key) for c in res.conditions], width, label=label)
    ax.axhline(5.0, color="k", ls="--", lw=0.8, label="5 % goal")
    ax.set_xticks(pos, names)
    ax.set_ylabel("backward latency error %")
    ax.set_title(f"{res.config['arch']} {res.config['image_size']} px b{res.config['batch_size']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(res: BenchResult, out_dir: str | Path) -> dict[str, Path]:
    """results.json, table.md, errors.png and profile.json (the offline profile, for
    `--profile` on a later run) in out_dir (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "table.md",
             "plot": out / "errors.png"}
    paths["json"].write_text(json_dumps(res.to_dict(), indent=1) + "\n")
    if res.profile is not None:
        paths["profile"] = out / "profile.json"
        res.profile.save(paths["profile"])
    paths["markdown"].write_text(to_markdown(res))
    plot_errors(res, paths["plot"])
    return paths
