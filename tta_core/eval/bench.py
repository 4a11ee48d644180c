"""The accuracy–latency–memory benchmark: every method on the same shift stream.

The stream is built once (deterministic by seed); each method gets a fresh copy of the
source model from its checkpoint, adapts online batch by batch, and leaves per-frame
records (domain, label, prediction, per-phase times of its batch) for `tta_core.eval.report`,
which writes the JSON, the markdown table (AdaShadow Table 5 layout plus memory) and
the plots. Accuracy is reproducible for a seed; timings are wall-clock and vary.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch import nn

from tta_core.adashadow.memory_budget import check_budget_mib
from tta_core.api import DeadlineTunable, WarmsUp
from tta_core.data.preprocess import images_to_tensor
from tta_core.errors import InputError
from tta_core.eval.live_telemetry import LiveExpansion
from tta_core.eval.report import FrameRecord, RunRecord, lr_markdown, summarize
from tta_core.eval.report_files import ReportFiles, write_report
from tta_core.eval.report_identity import samples_text
from tta_core.eval.saved_memory import ActivationMeter, saved_note
from tta_core.eval.shifts import run_meta as shift_meta
from tta_core.eval.shifts import shifts_markdown
from tta_core.eval.streaming import (
    NODE_BATCH_WAIT_MS,
    NODE_QUEUE_SIZE,
    StreamResult,
    StreamSummary,
    check_stream_params,
    simulate_stream,
    timed_step,
)
from tta_core.model.user_card import UserModel
from tta_core.registry import available_methods, build_method, method_class
from tta_core.runtime.device import check_device
from tta_core.runtime.gc_pauses import frozen_heap
from tta_core.runtime.precision import check_precision

# (): every registered method that can run on the bench's model (runnable_methods)
DEFAULT_METHODS: tuple[str, ...] = ()
MODES = ("sequential", "parallel")
DEFAULT_CARD = Path("checkpoints/small_resnet_signs32.json")


@dataclass
class BenchConfig:
    """What to run; defaults give a meaningful comparison in minutes on 2 CPU cores."""

    methods: tuple[str, ...] = DEFAULT_METHODS
    order: str = "continual"
    severity: int = 5
    batch_size: int = 4
    samples_per_domain: int = 500
    model_card: Path = DEFAULT_CARD
    mode: str = "sequential"
    seed: int = 0
    threads: int = 1  # torch intra-op threads, fixed for comparable timings (0: default)
    device: str = "cpu"
    method_options: dict[str, dict] = field(default_factory=dict)  # per-method config
    # live telemetry for methods that plan with it (eval.live_telemetry): "" off, "live"
    # (default calibration) or the path of a `tta calibrate` file
    telemetry: str = ""
    # streaming accuracy at these frame rates (Hz) after the report (eval.streaming); () off
    stream_hz: tuple[float, ...] = ()
    # streaming: frames per object track (data.streams "Tracks"; 1: i.i.d. frames) and the
    # latency allowance L in ms (None: (2 * batch_size - 1) / rate, eval.streaming)
    stream_track: int = 1
    stream_latency_ms: float | None = None
    # the stream: "" the synthetic signs; else KIND:DIR of the user's data (data.sources)
    data: str = ""
    # the corruptions streamed, in order; () the 15 standard ones (found in --data)
    corruptions: tuple[str, ...] = ()
    # the user's model (arch or factory, weights, input size, normalisation) instead of
    # model_card (model.user_card); None: model_card
    user_model: UserModel | None = None
    # count saved activations per step (eval.saved_memory); off: hooks cost time
    measure_activations: bool = False
    # saved-activation budget, MiB, for the methods that take one (memory_budget_mb:
    # adashadow); turns measure_activations on (eval.saved_memory); None: off
    memory_budget_mb: float | None = None
    # forward precision (runtime.precision) of every method that takes it (the others run
    # fp32, said once); fp16 needs a CUDA device
    precision: str = "fp32"

    def validate(self) -> None:
        """Raise ValueError naming the first bad value."""
        known = set(available_methods())
        bad = [m for m in self.methods if method_base(m) not in known]
        if bad:
            raise ValueError(f"unknown method(s) {bad}; available: {sorted(known)}")
        from tta_core.data.streams import ORDERS

        if self.order not in ORDERS:
            raise ValueError(f"order {self.order!r} not in {ORDERS}")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} not in {MODES}")
        if not 1 <= self.severity <= 5:
            raise ValueError(f"severity must be 1..5, got {self.severity}")
        if self.batch_size < 1 or self.samples_per_domain < 1:
            raise ValueError(f"batch_size {self.batch_size} and samples_per_domain "
                             f"{self.samples_per_domain} must be >= 1")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        check_precision(self.precision, check_device(self.device))
        check_budget_mib("memory_budget_mb", self.memory_budget_mb)
        if self.telemetry not in ("", "live") and not Path(self.telemetry).is_file():
            raise ValueError(f"telemetry {self.telemetry!r} is neither 'live' nor a "
                             f"calibration file")
        for hz in self.stream_hz:
            check_stream_params(hz, self.batch_size, self.batch_size, 0.0,
                                self.stream_latency_ms)
        if not isinstance(self.stream_track, int) or self.stream_track < 1:
            raise ValueError(f"stream_track must be an integer >= 1, got {self.stream_track!r}")
        if len(set(self.methods)) < len(self.methods):
            raise ValueError(f"methods {self.methods} name one twice: give a variant its "
                             "own name, e.g. surgeon,surgeon@robot")
        for name, opts in self.method_options.items():
            if method_base(name) in known:
                check_option_types(name, opts)
        if self.data:
            from tta_core.data.sources import parse_data

            parse_data(self.data)
        if self.corruptions:
            from tta_core.data.sources import parse_corruptions

            parse_corruptions(",".join(self.corruptions))
        if self.user_model is not None:
            self.user_model.check()


    @property
    def measures_activations(self) -> bool:
        """Whether steps are metered (measure_activations, or a memory budget to check)."""
        return self.measure_activations or self.memory_budget_mb is not None


def method_base(name: str) -> str:
    """The registered method of a bench name: "surgeon@robot" -> "surgeon" (a variant:
    its own options via --set surgeon@robot.KEY=VALUE, its own row in the report)."""
    return name.partition("@")[0]


def check_option_types(method: str, options: dict[str, Any]) -> None:
    """ValueError naming an option the method does not have, or one whose value is not of
    its config field's kind (a number, a bool, a string: what the default is), before the
    method compares it."""
    spec = {f.name: f.default for f in fields(method_class(method_base(method)).config_cls)}
    for key, value in options.items():
        if key not in spec:
            raise ValueError(f"option {method}.{key}: method {method_base(method)} has no "
                             f"option {key!r}; known: {', '.join(sorted(spec))}")
        default = spec.get(key, MISSING)
        if isinstance(default, bool):
            ok, what = isinstance(value, bool), "true or false"
        elif isinstance(default, int | float):
            ok = isinstance(value, int | float) and not isinstance(value, bool) and (
                isinstance(value, int) or isinstance(default, float))
            what = "a number" if isinstance(default, float) else "an integer"
        elif isinstance(default, str):
            ok, what = isinstance(value, str), "a string"
        else:
            continue
        if not ok:
            raise ValueError(f"option {method}.{key}={value!r} must be {what}")


@dataclass
class Batch:
    """One batch of the stream: images [N, C, H, W] (model input), labels, domain."""

    x: torch.Tensor
    labels: np.ndarray
    domain: str


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


def method_options(name: str, cfg: BenchConfig, input_shape: tuple[int, ...]) -> dict:
    """Config of method `name` for this bench: mode, input shape, user overrides.

    Parallel mode: AdaShadow adapts in a background thread; methods with a reforward
    predict with the pre-update model instead (the two-stage mode of AdaShadow §5.4).
    """
    cls_fields = set(method_class(method_base(name)).config_cls.__dataclass_fields__)
    opts: dict = {}
    if "input_shape" in cls_fields:
        opts["input_shape"] = tuple(input_shape)
    if method_base(name) == "adashadow":
        opts["mode"] = cfg.mode
    elif "reforward" in cls_fields and cfg.mode == "parallel":
        opts["reforward"] = False
    if "seed" in cls_fields:
        opts["seed"] = cfg.seed
    if cfg.memory_budget_mb is not None and "memory_budget_mb" in cls_fields:
        opts["memory_budget_mb"] = cfg.memory_budget_mb
    if cfg.precision != "fp32" and takes_precision(name, cfg.precision):
        opts["precision"] = cfg.precision
    opts.update(cfg.method_options.get(name, {}))
    return opts


def takes_precision(name: str, precision: str) -> bool:
    """Whether method `name`'s forwards take `precision` (TTAMethod.precisions)."""
    return precision in getattr(method_class(method_base(name)), "precisions", ("fp32",))


def precision_note(cfg: BenchConfig, methods: Sequence[str]) -> str:
    """The line naming the methods that run fp32 under a reduced --precision ('' when
    none do)."""
    fp32 = [m for m in methods if cfg.precision != "fp32" and not takes_precision(
        m, cfg.method_options.get(m, {}).get("precision", cfg.precision))]
    return (f"precision {cfg.precision}: {', '.join(fp32)} run fp32 (their forwards do not "
            "take it)") if fp32 else ""


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
    meth = build_method(method_base(name), model, **opts)
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


def batches_from_arrays(x: torch.Tensor, labels: np.ndarray, domains: Sequence[str],
                        batch_size: int) -> list[Batch]:
    """Cut a stream into batches that never straddle a domain change. Each batch owns its
    memory (contiguous copy), as a camera batch does: a slice would share the whole
    stream's storage, and saved-activation accounting (by storage) would charge a method
    that saves its input (surgeon's first conv) for the entire stream (measured: 18.4 MB
    instead of 48 KB at 100 frames per domain)."""
    if not len(x) == len(labels) == len(domains):
        raise ValueError(f"lengths differ: x {len(x)}, labels {len(labels)}, "
                         f"domains {len(domains)}")
    out: list[Batch] = []
    start = 0
    for i in range(1, len(x) + 1):
        if i == len(x) or domains[i] != domains[start] or i - start == batch_size:
            out.append(Batch(x[start:i].clone(memory_format=torch.contiguous_format),
                             np.asarray(labels[start:i]), str(domains[start])))
            start = i
    return out


def config_dict(cfg: BenchConfig) -> dict:
    """JSON-ready copy of the config."""
    d = asdict(cfg)
    d["model_card"] = None if cfg.user_model is not None else str(cfg.model_card)
    if cfg.user_model is not None:
        d["user_model"]["weights"] = str(cfg.user_model.weights)
    return d


def describe_inputs(cfg: BenchConfig) -> str:
    """The model and data of a bench, for the report header."""
    um = cfg.user_model
    model = (f"model card: {cfg.model_card}" if um is None else
             f"model: {um.model}, weights {um.weights}, {um.input_size} px")
    return f"{model}; data: {cfg.data or 'synthetic signs'}"


def write_bench(runs: list[RunRecord], out: Path, cfg: BenchConfig,
                clean_accuracy: float) -> tuple[ReportFiles, str]:
    """Write the report files; the markdown gets a header naming stream and model and a
    table of the learning rate each method ran with."""
    title = (f"tta bench — {cfg.order} stream, severity {cfg.severity}, batch {cfg.batch_size},"
             f" {cfg.mode}, seed {cfg.seed}"
             + (f", {cfg.precision}" if cfg.precision != "fp32" else ""))
    files = write_report(runs, out, title=title)
    text = files.markdown.read_text()
    clean = "–" if math.isnan(clean_accuracy) else f"{100 * clean_accuracy:.1f}%"
    ran = runs[0].meta.get("ran") if runs else None
    samples = (samples_text(ran["samples"]) if isinstance(ran, dict)
               else f"{cfg.samples_per_domain} samples per domain")
    head = (f"{describe_inputs(cfg)}; clean accuracy {clean}; "
            f"{samples}; torch threads {cfg.threads or 'all'}"
            + (f"; code {ran['code_version']}" if isinstance(ran, dict) else "") + "\n\n")
    text = (text.replace("Accuracy in %", head + "Accuracy in %", 1)
            + saved_note(cfg.measures_activations) + lr_markdown(runs)
            + shifts_markdown(runs))
    files.markdown.write_text(text)
    return files, text


def _card_get(card: object, key: str, default: object = None) -> object:
    if isinstance(card, dict):
        return card.get(key, default)
    return getattr(card, key, default)


def images_to_input(images: np.ndarray, card: object, device: str = "cpu") -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float [N, 3, H, W], normalised by the card's mean/std (what
    the source model was trained on; [0, 1] when the card has none)."""
    mean = _card_get(card, "mean") or (0.0, 0.0, 0.0)
    std = _card_get(card, "std") or (1.0, 1.0, 1.0)
    return images_to_tensor(images, tuple(mean), tuple(std)).to(device)


def build_stream(cfg: BenchConfig, card: object, progress: bool = False,
                 track_length: int = 1) -> list[Batch]:
    """The shift stream of `cfg` as model-ready batches (tta_core.data.streams), each
    object seen over `track_length` frames."""
    from tta_core.data import streams

    extra = {"corruptions": cfg.corruptions} if cfg.corruptions else {}
    spec = streams.StreamSpec(order=cfg.order, severity=cfg.severity, **extra,
                              samples_per_domain=cfg.samples_per_domain,
                              image_size=int(_card_get(card, "image_size", 32)), seed=cfg.seed,
                              num_classes=int(_card_get(card, "num_classes", 16)),
                              track_length=track_length)
    stream = streams.build_stream(spec, progress=progress)
    x = images_to_input(stream.images, card, cfg.device)
    return batches_from_arrays(x, stream.labels, stream.domains.tolist(), cfg.batch_size)


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


def _card(cfg: BenchConfig, classes: Sequence[str]) -> tuple[Any, Path]:
    """(model card, the folder its checkpoint is relative to): `cfg.model_card`, or one
    made for `cfg.user_model` (classes: its own, else `classes`, the user data's)."""
    from tta_core.model.source import find_card, load_card
    from tta_core.model.user_card import make_card

    um = cfg.user_model
    if um is None:
        path = find_card(cfg.model_card)  # relative: looked up (tta_core.io.shipped)
        return load_card(path), path.parent
    if not (um.class_names or um.num_classes) and classes:
        um = replace(um, class_names=tuple(classes))
    return make_card(um), Path(".")


def bench_inputs(cfg: BenchConfig, progress: bool = False
                 ) -> tuple[Any, Callable[[], nn.Module], list[Batch]]:
    """(card, a maker of fresh source models, the stream's batches) of `cfg`: the card's
    or the user's model, the synthetic stream or the user's data at the model's input
    size; the weights are loaded and run once first, so a bad file fails before the stream."""
    from tta_core.data.signs import CLASS_NAMES
    from tta_core.data.sources import load_data, parse_data
    from tta_core.model.source import load_card, load_model
    from tta_core.model.user_card import check_card_model

    size = (load_card(cfg.model_card).image_size if cfg.user_model is None
            else cfg.user_model.input_size)
    data = (load_data(parse_data(cfg.data), size, cfg.severity, cfg.samples_per_domain,
                      cfg.seed, cfg.order, _bag_frames, cfg.corruptions) if cfg.data else None)
    card, base = _card(cfg, data.class_names if data is not None else ())
    check_card_model(card, base)
    if data is None and card.num_classes > len(CLASS_NAMES):
        raise InputError(f"the model has {card.num_classes} classes; the synthetic signs "
                         f"stream has at most {len(CLASS_NAMES)}: give --data KIND:DIR")
    if data is None:
        stream = build_stream(cfg, card, progress)
    elif data.class_names and card.num_classes != len(data.class_names):
        raise InputError(f"the model has {card.num_classes} classes, --data {cfg.data} "
                         f"has {len(data.class_names)} ({', '.join(data.class_names[:5])}"
                         f"{', ...' if len(data.class_names) > 5 else ''})")
    else:
        stream = batches_from_arrays(images_to_input(data.images, card, cfg.device),
                                     data.labels, data.domains.tolist(), cfg.batch_size)
        if (data.labels < 0).all():  # a recorded bag without ground truth
            stream = label_by_source(stream, load_model(card, base))
    return card, (lambda: load_model(card, base)), stream


def _bag_frames(root: Path) -> Iterable[Any]:
    """A recorded bag's frames, ground truth optional (`--data bag:DIR`)."""
    from tta_core.io.bag import read_bag

    return read_bag(root, require_ground_truth=False)


def label_by_source(stream: list[Batch], model: nn.Module) -> list[Batch]:
    """The stream with the unadapted model's predictions as labels: on data without ground
    truth, accuracy becomes agreement with the source model (report.json meta.ran.data
    says so)."""
    model.eval()
    with torch.no_grad():
        for b in stream:
            b.labels = model(b.x).argmax(1).cpu().numpy().astype(np.int64)
    return stream


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


def model_identity(cfg: BenchConfig) -> dict[str, Any]:
    """The model that ran: the --model spec and weights (path, sha256 prefix), or the model
    card and its checkpoint."""
    from tta_core.eval.report_identity import sha256_prefix
    from tta_core.model.source import find_card, load_card

    um = cfg.user_model
    if um is not None:
        w = Path(um.weights)
        return {"model": um.model, "weights": str(w.resolve()), "weights_sha256":
                sha256_prefix(w), "input_size": um.input_size, "kwargs": dict(um.kwargs)}
    path = find_card(cfg.model_card)
    card = load_card(path)
    ckpt = path.parent / card.checkpoint
    return {"model_card": str(cfg.model_card), "arch": card.arch,
            "weights": str(ckpt.resolve()), "weights_sha256": sha256_prefix(ckpt)}


def data_identity(cfg: BenchConfig) -> dict[str, Any]:
    """The data that ran: kind, folder and its content identity (file count, bytes, listing
    hash), or the synthetic stream's settings."""
    common = {"order": cfg.order, "severity": cfg.severity, "seed": cfg.seed,
              **({"corruptions": list(cfg.corruptions)} if cfg.corruptions else {})}
    if not cfg.data:
        return {"kind": "synthetic-signs", **common}
    from tta_core.data.sources import parse_data
    from tta_core.eval.report_identity import folder_identity

    spec = parse_data(cfg.data)
    out = {"kind": spec.kind, **folder_identity(spec.root), **common}
    if spec.kind == "bag":
        from tta_core.io.bag import bag_info

        out["labels"] = ("ground truth" if bag_info(spec.root).has_ground_truth else
                         "source predictions (accuracy = agreement with the unadapted model)")
    return out


def ran_meta(cfg: BenchConfig, stream: Sequence[Batch],
             left_out: dict[str, str]) -> dict[str, Any]:
    """report.json `meta.ran`: samples used, model, data, code version, methods left out."""
    from tta_core.eval.report_identity import code_version, samples_used

    domains = [b.domain for b in stream for _ in range(len(b.labels))]
    return {"samples": samples_used(domains, cfg.samples_per_domain),
            "model": model_identity(cfg), "data": data_identity(cfg),
            "code_version": code_version(), "methods_left_out": left_out}


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
    clean = float(_card_get(card, "clean_accuracy", math.nan))
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


def streaming_stream(cfg: BenchConfig, card: object, stream: list[Batch]) -> list[Batch]:
    """The stream of the streaming benchmark: the synthetic signs with tracks of
    cfg.stream_track frames (re-rendered views); a --data stream gets each image repeated
    stream_track times (no jitter), cut at its domain's length so domains keep their size."""
    k = cfg.stream_track
    if k == 1:
        return stream
    if not cfg.data:
        return build_stream(cfg, card, False, k)
    x = torch.cat([b.x for b in stream])
    labels = np.concatenate([b.labels for b in stream])
    domains = [b.domain for b in stream for _ in range(len(b.labels))]
    idx, start = [], 0
    for n in (len(list(g)) for _, g in groupby(domains)):  # each domain's run
        idx += [start + (j // k) * k for j in range(n)]
        start += n
    return batches_from_arrays(x[idx], labels[idx], [domains[i] for i in idx], cfg.batch_size)


def stream_options(name: str, cfg: BenchConfig, input_shape: tuple[int, ...],
                   hz: float) -> dict:
    """method_options for streaming at `hz`: a method with deadline modes (AdaShadow)
    plans against the camera's deadline at the stream's rate (deadline_mode "camera",
    camera_hz = hz) unless its deadline_mode is set by --set."""
    opts = method_options(name, cfg, input_shape)
    if "deadline_mode" in method_class(method_base(name)).config_cls.__dataclass_fields__:
        opts.setdefault("deadline_mode", "camera")
        if opts["deadline_mode"] == "camera":
            opts["camera_hz"] = float(hz)
    return opts


def stream_batch_wait_ms(hz: float, batch_size: int) -> float:
    """How long the streaming benchmark's node waits for a batch to fill: the camera's fill
    time, (batch_size - 1/2) frame periods, at least the node's default NODE_BATCH_WAIT_MS.
    A user sets the node's batch_timeout_s so at a slow camera (30 Hz, batch 4: 117 ms);
    with the default 50 ms there, batches close at 2 frames and batch statistics of 2
    images are what every BN-based method would be judged on."""
    return max(NODE_BATCH_WAIT_MS, (batch_size - 0.5) * 1000.0 / hz)


def warm_up(model: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward of a copy of `model` on `x`: the process's first kernels
    at a shape pay one-time setup (kernel selection, allocations) that a camera node pays
    before its first frame; without this the first method's first steps would put tens of
    ms of it on the stream. `model` itself is untouched (its state and statistics)."""
    probe = copy.deepcopy(model).train()
    with torch.enable_grad():
        probe(x).logsumexp(1).mean().backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize()


def stream_method(name: str, model: nn.Module, stream: Sequence[Batch], cfg: BenchConfig,
                  hz: float, on_step: Callable[[Any], None] | None = None) -> StreamResult:
    """Method `name` in streaming mode at `hz` (eval.streaming) with the perception node's
    queue (keep-latest, NODE_QUEUE_SIZE frames) and batching (batch_size frames, waiting
    at most stream_batch_wait_ms after the first); its step time is its measured wall
    time. AdaShadow plans against each batch's deadline at `hz` (stream_options).
    `on_step` sees each step's StepResult (e.g. the sizes an elastic method served)."""
    torch.manual_seed(cfg.seed)
    x = torch.cat([b.x for b in stream])
    labels = np.concatenate([b.labels for b in stream]).tolist()
    domains = [b.domain for b in stream for _ in range(len(b.labels))]
    warm_up(model, x[:cfg.batch_size])
    meth = build_method(method_base(name), model,
                        **stream_options(name, cfg, tuple(x.shape[1:]), hz))
    if isinstance(meth, WarmsUp):  # its fixed costs learnt (on noise), as a node at start
        meth.warm_up(torch.randn_like(x[:cfg.batch_size]))
    cuda = x.device.type == "cuda"
    late_aware = isinstance(meth, DeadlineTunable)

    def run(frames: Sequence[int], late_ms: float) -> list[int]:
        if late_aware:
            meth.set_lateness(late_ms)  # as the node does: a backlog shortens the deadline
        res = meth.step(x[list(frames)])
        pred = res.logits.argmax(1)
        if on_step is not None:
            on_step(res)
        if cuda:
            torch.cuda.synchronize()
        return pred.tolist()

    try:
        with frozen_heap():  # as the node serves: full collections skip start-up objects
            return simulate_stream(labels, hz, timed_step(run), cfg.batch_size,
                                   NODE_QUEUE_SIZE, domains,
                                   stream_batch_wait_ms(hz, cfg.batch_size),
                                   cfg.stream_latency_ms)
    finally:
        meth.finish()
        meth.close()


def run_streaming(stream: Sequence[Batch], make_model: Callable[[], nn.Module],
                  cfg: BenchConfig) -> list[tuple[str, StreamSummary]]:
    """Every method of `cfg` at every rate of `cfg.stream_hz`, each on a fresh model."""
    cfg.validate()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    rows = []
    for name in cfg.methods:
        for hz in cfg.stream_hz:
            model = make_model().to(stream[0].x.device)
            rows.append((name, stream_method(name, model, stream, cfg, hz).summary))
            del model
    return rows
