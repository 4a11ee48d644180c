"""What a bench runs: its config (BenchConfig) and the checks of it, and each method's
options under it (method_options: mode, input shape, precision, the user's --set values).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tta_core.adashadow.memory_budget import check_budget_mib
from tta_core.eval.streaming import check_stream_params
from tta_core.model.user_card import UserModel
from tta_core.registry import available_methods, method_class
from tta_core.runtime.device import check_device
from tta_core.runtime.precision import check_precision

# (): every registered method that can run on the bench's model (bench_run.runnable_methods)
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


def config_dict(cfg: BenchConfig) -> dict:
    """JSON-ready copy of the config."""
    d = asdict(cfg)
    d["model_card"] = None if cfg.user_model is not None else str(cfg.model_card)
    if cfg.user_model is not None:
        d["user_model"]["weights"] = str(cfg.user_model.weights)
    return d
