"""The accuracy–latency–memory benchmark: every method on the same shift stream.

The stream is built once (deterministic by seed); each method gets a fresh copy of the
source model from its checkpoint, adapts online batch by batch, and leaves per-frame
records (domain, label, prediction, per-phase times of its batch) for `tta_core.eval.report`,
which writes the JSON, the markdown table (AdaShadow Table 5 layout plus memory) and
the plots. Accuracy is reproducible for a seed; timings are wall-clock and vary. Before
its stream each method is warmed up as the perception node warms it up at start: the
process's first kernels at the batch's shape, and a method that learns its run-time costs
(api.WarmsUp) learns them on noise, its weights and state then put back.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from tta_core.eval.bench_config import (
    BenchConfig,
    config_dict,
    method_options,
    precision_note,
)
from tta_core.eval.bench_inputs import Batch, bench_inputs, card_field
from tta_core.eval.bench_report import ran_meta, write_bench
from tta_core.eval.bench_stream import run_streaming, start_method, streaming_stream
from tta_core.eval.live_telemetry import LiveExpansion
from tta_core.eval.report import FrameRecord, RunRecord, lr_markdown, summarize
from tta_core.eval.report_files import ReportFiles
from tta_core.eval.saved_memory import ActivationMeter, saved_note
from tta_core.eval.shifts import run_meta as shift_meta
from tta_core.eval.streaming import NODE_QUEUE_SIZE
from tta_core.registry import available_methods, build_method


@dataclass
class BenchResult:
    """The runs, the files written and the printed markdown."""

    runs: list[RunRecord]
    files: ReportFiles | None
    markdown: str
    clean_accuracy: float = math.nan
    stream_files: list[Path] = field(default_factory=list)


class PeakRSS:
    """Peak resident memory of this process while active, sampled by a thread (MB)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self._proc = psutil.Process()
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        self.peak_mb = max(self.peak_mb, self._proc.memory_info().rss / 2**20)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakRSS:
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


def serving_meta(meth: Any, opts: dict) -> dict[str, Any]:
    """report.json meta of how the method served: its precision and, where it has them,
    its CUDA graphs (captures, replays, graphs held, why eager: runtime.graphs)."""
    graphs = getattr(meth, "graphs", None)
    return {"precision": opts.get("precision", "fp32"),
            "cuda_graphs": graphs.stats() if graphs is not None else None}


def _phases(res) -> dict[str, float]:
    t = res.times
    out = {"forward": t.forward_ms, "plan": t.plan_ms, "backward": t.backward_ms,
           "reforward": t.reforward_ms}
    if t.post_ms:
        out["post"] = t.post_ms
    return out


def run_method(name: str, model: nn.Module, stream: Sequence[Batch], cfg: BenchConfig,
               progress: Callable[[int], None] | None = None,
               live: LiveExpansion | None = None) -> RunRecord:
    """Run method `name` online over `stream` and return its per-frame records; `live`
    feeds telemetry pi1/pi2 to a method that plans with them, before each batch;
    cfg.measure_activations counts each step's saved activations (eval.saved_memory)."""
    torch.manual_seed(cfg.seed)
    opts = method_options(name, cfg, tuple(stream[0].x.shape[1:]))
    meth = start_method(name, model, opts, stream[0].x[:cfg.batch_size])
    # a method's own memory budget (--set M.memory_budget_mb) is what its run is held to
    budget = opts.get("memory_budget_mb", cfg.memory_budget_mb)
    meter = ActivationMeter(model, cfg.measures_activations or budget is not None, budget)
    cuda = stream[0].x.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    frames: list[FrameRecord] = []
    busy = 0.0
    rates: dict[int, float] = {}  # batch size -> SGD rate its steps ran with
    # (domain, shift perceived, backward, its reason) per batch of a method that says why
    # it backpropagated (darda: stats["reason"]); scored in meta["shifts"]
    triggers: list[tuple[str, bool, bool, str]] = []
    start_mb = psutil.Process().memory_info().rss / 2**20
    with PeakRSS() as mem:
        for b_id, b in enumerate(stream):
            if live is not None:
                live.feed(meth)
            t0 = time.perf_counter()
            with meter.step():
                res = meth.step(b.x)
            _note_lr(meth, len(b.labels), rates)
            pred = res.logits.argmax(1)
            if cuda:
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
            # work a method leaves for between batches (a background update, AdaShadow's
            # next plan) runs in the gap a camera's frame interval gives, after the answer:
            # in the throughput, not in the batch's latency (bench_paper_ratios does alike)
            t1 = time.perf_counter()
            meth.finish()
            busy += (wall_ms + (time.perf_counter() - t1) * 1e3) / 1e3
            meter.note(res.stats)
            triggers += _trigger(b.domain, res)
            frames += _frames(b, b_id, res, pred, {**_phases(res), "total": wall_ms})
            if progress is not None:
                progress(len(b.labels))
        meth.finish()
        meth.close()
    meta = {"options": {k: v for k, v in opts.items() if k != "input_shape"},
            "mode": cfg.mode, "batch_size": cfg.batch_size, "threads": torch.get_num_threads(),
            "rss_peak_mb": mem.peak_mb, "rss_start_mb": start_mb, "lr": _lr_meta(meth, rates),
            "memory_format": getattr(getattr(meth, "format", None), "format", None),
            **serving_meta(meth, opts), **_measured_meta(meter, triggers, len(stream), live)}
    if cuda:
        meta["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    # RSS is process-wide and methods run one after another: report the growth over the
    # RSS at the method's start (its models, optimizer state, activations); absolute in meta
    peak = meta.get("cuda_peak_mb", max(mem.peak_mb - start_mb, 0.0))
    return RunRecord(name, frames, busy, float(peak), 0, meta)


def _measured_meta(meter: ActivationMeter, triggers: list, batches: int,
                   live: LiveExpansion | None) -> dict[str, Any]:
    """meta of what the run measured: saved activations, the shift test's scores (when
    every batch said why it backpropagated), the live telemetry fed (then cleared)."""
    meta: dict[str, Any] = {}
    if meter.meta() is not None:
        meta["saved_activations"] = meter.meta()
    if len(triggers) == batches:
        meta["shifts"] = shift_meta(triggers)
    if live is not None and live.fed:
        meta["telemetry"] = live.summary()
        live.fed.clear()
    return meta


def _trigger(domain: str, res: Any) -> list[tuple[str, bool, bool, str]]:
    """[(domain, shift perceived, backward, its reason)] of a step that says why it
    backpropagated (stats["reason"]); [] for a method that does not."""
    if "reason" not in res.stats:
        return []
    return [(domain, bool(res.stats.get("shift")), bool(res.adapted),
             str(res.stats["reason"]))]


def _frames(b: Batch, b_id: int, res: Any, pred: torch.Tensor,
            phases: dict[str, float]) -> list[FrameRecord]:
    """The frame records of batch `b` (number `b_id`) stepped into `res`."""
    conf = res.logits.float().softmax(1).max(1).values.tolist()
    return [FrameRecord(b.domain, int(label), int(p), b_id, phases, confidence=float(c),
                        budget_ms=res.budget_ms, adapted=bool(res.adapted),
                        recognised=res.domain)
            for label, p, c in zip(b.labels.tolist(), pred.tolist(), conf, strict=True)]


def _note_lr(meth: Any, batch: int, rates: dict[int, float]) -> None:
    """Record the SGD rate the optimizer ran the last step with (methods without one: no
    entry)."""
    opt = getattr(meth, "optimizer", None)
    if opt is not None and batch not in rates:
        rates[batch] = float(opt.param_groups[0]["lr"])


def _lr_meta(meth: Any, rates: dict[int, float]) -> dict[str, Any] | None:
    """The method's learning rate as configured (at batch lr_ref_batch) and as it ran,
    per batch size; None when it has no optimizer (source, bn_adapt, lame)."""
    if not rates:
        return None
    cfg = meth.config
    return {"lr": cfg.lr, "ref_batch": cfg.lr_ref_batch,
            "effective": {str(b): r for b, r in sorted(rates.items(), reverse=True)}}


def run_methods(stream: Sequence[Batch], make_model: Callable[[], nn.Module],
                cfg: BenchConfig, progress: bool = True) -> list[RunRecord]:
    """Every method of `cfg` over the same `stream`, each on a fresh `make_model()`."""
    from tqdm import tqdm

    cfg.validate()
    if not stream:
        raise ValueError("empty stream")
    if not cfg.methods:
        cfg = replace(cfg, methods=runnable_methods(make_model, tuple(stream[0].x.shape[1:]),
                                                    cfg)[0])
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    total = sum(len(b.labels) for b in stream) * len(cfg.methods)
    live = (LiveExpansion.from_calibration(None if cfg.telemetry == "live" else cfg.telemetry,
                                           cfg.threads) if cfg.telemetry else None)
    runs = []
    try:
        with tqdm(total=total, unit="img", disable=not progress, desc="bench") as bar:
            for name in cfg.methods:
                bar.set_postfix_str(name)
                model = make_model().to(stream[0].x.device)
                runs.append(run_method(name, model, stream, cfg, bar.update, live))
                del model
    finally:
        if live is not None:
            live.close()
    return runs


def runnable_methods(make_model: Callable[[], nn.Module], input_shape: tuple[int, ...],
                     cfg: BenchConfig) -> tuple[tuple[str, ...], dict[str, str]]:
    """Every registered method (tta_core.registry; source first, the rest by name) that
    builds on the model with this bench's options, and for each one that does not, why
    (its one-line error: e.g. elastic needs a gated master)."""
    from tta_core.errors import one_line

    names = sorted(available_methods(), key=lambda m: (m != "source", m))
    model = make_model()
    ok, left = [], {}
    for name in names:
        try:
            meth = build_method(name, copy.deepcopy(model),
                                **method_options(name, cfg, input_shape))
            meth.close()
        except Exception as exc:  # whatever stops it building: it cannot run here
            left[name] = one_line(exc)
            continue
        ok.append(name)
    return tuple(ok), left


def run_bench(cfg: BenchConfig, out: str | Path | None, progress: bool = True,
              log: Callable[[str], None] | None = None) -> BenchResult:
    """Build the stream once, run every method from the checkpoint, write the report.
    No methods in `cfg`: every one that can run on the model (`log` gets one line per
    method left out, with the reason)."""
    cfg.validate()
    card, fresh, stream = bench_inputs(cfg, progress)
    left: dict[str, str] = {}
    if not cfg.methods:
        names, left = runnable_methods(fresh, tuple(stream[0].x.shape[1:]), cfg)
        for name, why in left.items():
            (log or print)(f"{name} left out: it cannot run on this model ({why})")
        cfg = replace(cfg, methods=names)
    if note := precision_note(cfg, cfg.methods):
        (log or print)(note)
    runs = run_methods(stream, fresh, cfg, progress)
    clean = float(card_field(card, "clean_accuracy", math.nan))
    ran = ran_meta(cfg, stream, left)
    for r in runs:
        r.meta["config"] = config_dict(cfg)
        r.meta["ran"] = ran
    if out is None:
        from tta_core.eval.report import markdown_table

        return BenchResult(runs, None, markdown_table([summarize(r) for r in runs])
                           + saved_note(cfg.measures_activations) + lr_markdown(runs), clean)
    files, text = write_bench(runs, Path(out), cfg, clean)
    result = BenchResult(runs, files, text, clean)
    if cfg.stream_hz:
        from tta_core.eval.streaming_report import write_streaming

        rows = run_streaming(streaming_stream(cfg, card, stream), fresh, cfg)
        offline = {r.method: summarize(r).overall_accuracy for r in runs}
        result.stream_files, table = write_streaming(rows, Path(out), cfg.batch_size,
                                                     NODE_QUEUE_SIZE, cfg.stream_track,
                                                     offline if cfg.stream_track == 1 else None)
        result.markdown += "\n" + table
    return result
