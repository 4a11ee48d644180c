"""perception node: camera images -> TTA method (tta_core) -> predictions + status.

Frames are taken on an intake thread and converted to the model's input on converter
threads (tta_ros.nodes.intake; decoded and reduced by tta_ros.convert.frame_tensor) before
they enter a bounded keep-latest FrameQueue (drops counted), so one costly frame delays
no batch; one worker thread batches the ready tensors, runs the method's step and
publishes `predictions` (one ClassPrediction per image, header = image header),
`adaptation_status` and `layer_importance` (once per batch). With `plan_source: topic` the
latest LayerPlan applies to the next batch; when plans go stale (PlanGate) it plans inline
and says so on /diagnostics (WARN), and goes back to the topic as soon as plans resume.
A divergence guard calls method.reset() (source weights) and sets status.reset.

A managed (lifecycle) node (tta_ros.lifecycle): built, it declares its parameters; configure
loads the source model, builds and warms up the method (profile, domain bank, fleet
calibration), creates its publishers, subscriptions and the worker (idle); activate opens
the image intake; deactivate closes it, finishes the batch under way and drops the queued
frames (counted) while the method keeps its adapted state (activation serves on from it);
cleanup stops the worker, saves the bank and frees the method and the source model.

Parameters: the node's own (`param_specs`: input, batching, queue, input checks, device,
threads, plans, feed timeout, divergence guard, odometry, fleet calibration, hardware_id,
the `method` name) and, for the selected method, one `method.<field>` per field of its
config (tta_ros.nodes.method_params: type, range, choices and help from the config's
options; input_shape and arch come from the model card). A change is validated in one
on-set callback (ranges, choices, and the method's own config validation) and applied by
a post-set callback: the method's setters take lr, sigma, the deadline options and keep
between batches, any other option rebuilds the method between batches; a new `method`
undeclares the old method.* parameters and declares the new method's.

What the node may do with a method comes from its capabilities (tta_core.api): a
TakesPlan method follows LayerPlans, a RuntimeTunable one takes sigma changes, a
TakesTelemetry one plans inline with the live pi1/pi2 of the `telemetry` topic (offline
factors when it is older than `feed_timeout_s`), a Resizable one reports to a fleet
scheduler (tta_ros.nodes.fleet_wiring). In parallel mode the predictions are published as
soon as the forward is done; the AdaptationStatus follows when the background update has
finished, so it carries that update's backward_ms.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from diagnostic_msgs.msg import DiagnosticStatus
from rcl_interfaces.msg import SetParametersResult
from rclpy.context import Context
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from tta_msgs.msg import (
    AdaptationStatus,
    ClassPrediction,
    LayerImportance,
    LayerPlan,
    ResourceTelemetry,
)

from tta_core.adashadow.planning import Plan, telemetry_pis
from tta_core.api import (
    DeadlineTunable,
    StepResult,
    TakesPlan,
    TTAMethodLike,
    WarmsUp,
)
from tta_core.errors import one_line as exc_line
from tta_core.io.image_msg import (
    FrameLimits,
    FrameTooLarge,
    Preprocess,
    decode_budget,
    one_line,
)
from tta_core.model.source import load_source
from tta_core.model.units import decompose
from tta_core.registry import available_methods, build_method
from tta_core.runtime.deadline import DeadlineConfig, batch_deadline_ms
from tta_core.runtime.device import check_device
from tta_core.runtime.gc_pauses import freeze_startup_heap
from tta_ros import ros_params
from tta_ros.convert import (
    FRAME_INPUTS,
    check_plan,
    frame_tensor,
    frame_topic,
    importance_msg,
    peak_memory_mb,
    prediction_msgs,
    status_msg,
)
from tta_ros.diagnostics import ERROR, HARDWARE_ID, OK, WARN, DiagnosticsPublisher, status
from tta_ros.lifecycle import ManagedNode
from tta_ros.nodes import plausibility
from tta_ros.nodes.deadline_wiring import ODOMETRY_PARAMS, SpeedFeed, resolve_topic
from tta_ros.nodes.domain_wiring import DomainWiring
from tta_ros.nodes.fleet_wiring import PERCEPTION_FLEET_PARAMS, PerceptionFleet
from tta_ros.nodes.intake import FrameIntake
from tta_ros.nodes.method_params import (
    PREFIX,
    MethodOptions,
    apply_live,
    check_live,
    check_precision_param,
    report_given,
)
from tta_ros.nodes.perception_support import (
    DivergenceGuard,
    FrameQueue,
    PlanGate,
    TelemetryFeed,
)
from tta_ros.nodes.plausibility import (
    PLAUSIBILITY_PARAMS,
    Bounds,
    RateLimit,
    Refusals,
    check_speed,
    check_telemetry,
)
from tta_ros.ros_params import ParamSpec, check_initial, declare_all, start_values, validate, values

FEED_TIMEOUT = "feed_timeout_s"


class ReadyFrame(NamedTuple):
    """A frame converted on an intake thread: its header and its 1x3xSxS model input."""

    header: Any
    x: torch.Tensor


def param_specs() -> tuple[ParamSpec, ...]:
    """The node's own parameters (method choices come from the tta_core registry; the
    method's options are the generated method.* parameters)."""
    return (
        ParamSpec("model_card", "", "model card JSON of the source model", read_only=True),
        ParamSpec("method", "adashadow", "TTA method; its options are the method.* "
                  "parameters, declared anew when it changes",
                  choices=tuple(available_methods())),
        ParamSpec("input", "raw", "camera frames: sensor_msgs/Image on `image` (raw) or "
                  "sensor_msgs/CompressedImage on `image/compressed` (compressed: JPEG, PNG)",
                  choices=tuple(FRAME_INPUTS), read_only=True),
        ParamSpec("device", "cpu", "torch device (cpu, cuda, cuda:N)", read_only=True),
        ParamSpec("num_threads", 0, "torch intra-op threads (0: torch default)", 0, 256,
                  read_only=True),
        ParamSpec("batch_size", 8, "frames per adaptation batch", 1, 256),
        ParamSpec("batch_timeout_s", 0.05, "run a partial batch this long after its first "
                  "frame", 0.0, 10.0),
        ParamSpec("queue_size", 32, "bounded frame queue (keep latest)", 1, 4096),
        ParamSpec("publish_scores", False, "fill ClassPrediction.scores with the softmax"),
        ParamSpec("float_range", [0.0, 1.0], "32FC1/32FC3 frames with a value outside "
                  "[low, high] are rejected", read_only=True),
        ParamSpec("max_pixels", 4096 * 4096, "frames with more pixels are rejected "
                  "(before decoding)", 1, 2**30, read_only=True),
        ParamSpec("max_aspect", 20.0, "frames whose long side exceeds this times the short "
                  "side are rejected (before decoding)", 1.0, 1e6, read_only=True),
        ParamSpec("max_decode_bytes", 0, "compressed frames whose header declares more "
                  "decoded bytes (pixels x channels x bytes per channel) are rejected before "
                  "decoding; 0: one 4K UHD RGB frame, more for models over 240 px "
                  "(image_msg.decode_budget)", 0, 2**34, read_only=True),
        ParamSpec("plan_source", "topic", "plans from layer_plan (topic) or solved here "
                  "(inline)", choices=("topic", "inline")),
        ParamSpec(FEED_TIMEOUT, 1.0, "side inputs older than this count as missing: an "
                  "importance unanswered on layer_plan (plan inline), telemetry (offline "
                  "pi1 = pi2 = 1), odometry (unknown speed: min_deadline_ms)", 0.01, 3600.0),
        ParamSpec("reset_entropy_ratio", 0.95, "divergence guard: entropy limit as a "
                  "fraction of ln(num_classes)", 0.0, 1.0),
        ParamSpec("reset_patience", 5, "divergence guard: batches above the limit", 1,
                  100000),
        *ODOMETRY_PARAMS, *PERCEPTION_FLEET_PARAMS, *PLAUSIBILITY_PARAMS, HARDWARE_ID,
    )


@dataclasses.dataclass
class Counters:
    """What the node reports about its input side."""

    batches: int = 0
    rejected: int = 0
    too_large: int = 0  # of the rejected: over a size or decode limit, refused undecoded
    last_rejection: str = ""
    step_errors: int = 0
    last_error: str = ""
    inline_batches: int = 0
    topic_batches: int = 0
    saved_mib: float = math.nan  # saved activations of the last batch (memory budget)

    def count_batch(self, from_topic: bool) -> None:
        self.batches += 1
        if from_topic:
            self.topic_batches += 1
        else:
            self.inline_batches += 1


def build_warm(name: str, config: Mapping[str, Any], model: torch.nn.Module,
               batch_size: int, sample: tuple[int, ...]) -> TTAMethodLike:
    """Method `name` with `config`, warmed up (api.WarmsUp) on noise batches of `sample`
    (C, H, W) at the batch size: its run-time costs learnt before the first frame, its
    state untouched (a deadline's first updates otherwise plan blind and miss)."""
    meth = build_method(name, model, **config)
    if isinstance(meth, WarmsUp):
        dev = next(model.parameters()).device
        meth.warm_up(torch.randn(batch_size, *sample, device=dev))
    freeze_startup_heap()  # full garbage collections skip what exists now (gc_pauses)
    return meth


def planning_message(node: PerceptionNode) -> str:
    """What the planning status says: topic, inline (and why), or why nothing fits."""
    p, opts = node.p, node.options
    if not node.accepts_plans:
        return f"method {opts.method} plans nothing"
    if node._no_room:
        mode = opts.get("deadline_mode", "sigma")
        budget = f"sigma={opts.get('sigma', math.nan):g}" if mode == "sigma" \
            else f"deadline_mode={mode}"
        return f"{budget}: {node._no_room} (adapting BN statistics only)"
    if p["plan_source"] == "inline":
        return "planning inline (plan_source: inline)"
    if node._inline_fallback:
        return (f"no plan on layer_plan for {node.gate.silent_for():.1f} s "
                f"(timeout {node.gate.timeout_s:g} s): planning inline")
    return "plans from layer_plan"


def speed_text(feed: SpeedFeed) -> str:
    """The odometry speed for diagnostics, or why it is unknown."""
    speed = feed.speed()
    return f"{speed:.4g} m/s" if speed is not None else feed.describe()


def batch_deadline(node: PerceptionNode, batch_size: int) -> float:
    """AdaptationStatus.deadline_ms: the deadline of a batch of `batch_size` frames by the
    method's deadline settings and the speed it was given (the whole deadline, before any
    lateness; a plan from layer_plan was made against the scheduler's, which follows
    these settings: its deadline_from); NaN in sigma*T mode or for a method without deadlines."""
    cfg = getattr(node.method, "config", None)
    if not isinstance(cfg, DeadlineConfig):
        return math.nan
    return batch_deadline_ms(cfg, batch_size, node.speed.speed())


def status_mode(opts: MethodOptions) -> str:
    """AdaptationStatus.mode: parallel when the method adapts in the background."""
    return "parallel" if opts.get("mode") == "parallel" else "sequential"


def memory_values(opts: MethodOptions) -> dict[str, str]:
    """The method's saved-activation options, for the adaptation status (those it has)."""
    out = {}
    if "method.memory_budget_mb" in opts.params:
        out["memory_budget_mb"] = f"{opts.get('memory_budget_mb') or 0.0:g}"
    if "method.activation_bits" in opts.params:
        out["activation_bits"] = str(opts.get("activation_bits") or "dense")
    return out


def perception_statuses(node: PerceptionNode) -> list[DiagnosticStatus]:
    """The node's input, planning and adaptation statuses for /diagnostics."""
    c, q, p, opts = node.counters, node.queue, node.p, node.options
    planning_warn = node._inline_fallback or bool(node._no_room)
    return [
        status("input", OK, "ok", {
            "received": q.received, "dropped": q.dropped, "rejected": c.rejected,
            "too_large": c.too_large,
            "queue": f"{len(q)}/{q.maxlen}", "last_rejection": c.last_rejection,
            **node.refusals.values()}),
        status("planning", WARN if planning_warn else OK,
               planning_message(node), {
                   "plan_source": p["plan_source"],
                   "topic_batches": c.topic_batches, "inline_batches": c.inline_batches,
                   "deadline_mode": opts.get("deadline_mode", "-"),
                   **({"speed": speed_text(node.speed)}  # only where the speed counts
                      if opts.get("deadline_mode") == "speed" else {})}),
        status("adaptation", ERROR if node.build_error else OK,
               node.build_error or f"{opts.method} ({status_mode(opts)})",
               {"batches": c.batches, "resets": node.guard.resets,
                "step_errors": c.step_errors, "last_error": c.last_error,
                "saved_activation_mib": f"{c.saved_mib:.4g}", **memory_values(opts)}),
        *node.domain.statuses(), *node.fleet.statuses()]


def unit_names(node: PerceptionNode) -> list[str]:
    """The units plans and importance name: the method's own (TakesPlan), else the source
    model's (decomposed without a forward through the method's hooks); [] for a model with
    no decomposition (a gated master, elastic: it plans nothing, sends no importance)."""
    if isinstance(node.method, TakesPlan):
        return list(node.method.unit_names)
    s = node.pre.image_size
    try:
        return [u.name for u in decompose(node.source_model, (3, s, s), node.card.arch).units]
    except ValueError as exc:
        node.get_logger().info(f"no layer importance for this model: {exc}")
        return []


def publish_batch(node: PerceptionNode, frames: list[Any], logits: torch.Tensor,
                  res: StepResult, plan_id: int, reset: bool) -> None:
    """Predictions now; status (after a background update finished) and importance."""
    batch_id = node.counters.batches
    probs = torch.softmax(logits, dim=1).cpu().numpy()  # numpy: cheap per-row access
    for pred in prediction_msgs([f.header for f in frames], probs, batch_id,
                                list(node.card.class_names), node.p["publish_scores"]):
        node.pub_pred.publish(pred)
    node.method.finish()  # parallel mode: the status carries this update's backward
    node.fleet.on_batch(res.stats, logits)  # the size's confidence (fleet accuracy proxy)
    node.counters.saved_mib = float(res.stats.get(
        "saved_mib", res.stats.get("saved_bytes", math.nan) / 2**20))  # tent: bytes only
    header = frames[-1].header
    node.pub_status.publish(status_msg(
        header, batch_id, res, method=node.method.name, mode=status_mode(node.options),
        plan_id=plan_id, reset=reset, frames_dropped=int(node.queue.dropped),
        peak_mb=peak_memory_mb(node.device), deadline_ms=batch_deadline(node, len(frames))))
    imp = importance_msg(header, batch_id, node.model_name, node.unit_names, res,
                         len(frames))
    if imp is not None:
        node.pub_imp.publish(imp)
        if node.accepts_plans and node.p["plan_source"] == "topic":
            node.gate.on_importance_sent()


def override_values(node: Node) -> dict[str, Any]:
    """The parameter values given at start (params file, -p, parameter_overrides:
    ros_params.start_values); the method.* ones are declared per method."""
    return start_values(node)


def check_change(node: PerceptionNode, params: Sequence[Parameter]) -> SetParametersResult:
    """on_set_parameters: the node's own values in range, a valid odometry topic, then the
    method side (check_method_change)."""
    res = validate(node.specs, params)
    if not res.successful or node.declaring:
        return res
    new = {p.name: p.value for p in params}
    try:
        if "odometry_topic" in new:
            resolve_topic(node, new["odometry_topic"])
    except ValueError as exc:
        return SetParametersResult(successful=False, reason=str(exc))
    reason = check_method_change(node, new)
    return SetParametersResult(successful=not reason, reason=reason)


def check_method_change(node: PerceptionNode, new: Mapping[str, Any]) -> str:
    """'' or why not: a new method must build with its start values (and come alone);
    method.* values must be changeable now, valid for the method's config and takeable by
    its setters."""
    method = new.get("method", node.options.method)
    changes = {k: v for k, v in new.items() if k.startswith(PREFIX)}
    if method != node.options.method:
        if changes:
            return (f"method={method!r}: set method alone (its method.* parameters are "
                    f"declared anew with it), then its options")
        opts = MethodOptions(method, override_values(node))
        return opts.check(opts.values) or check_precision_param(
            method, opts.get("precision"), getattr(node, "device", None))
    if not changes:
        return ""
    params = node.options.params
    return node.options.check(changes) or check_precision_param(
        method, changes.get(PREFIX + "precision"), getattr(node, "device", None)) or check_live(
        node.method, {k[len(PREFIX):]: params[k].config_value(v) for k, v in changes.items()})


class PerceptionNode(ManagedNode):
    """Runs a tta_core method on the camera stream; see the module docstring."""

    def __init__(self, node_name: str = "perception", *, context: Context | None = None,
                 parameter_overrides: Sequence[Parameter] | None = None,
                 cli_args: Sequence[str] | None = None) -> None:
        self._stop = threading.Event()  # first: destroy_node runs on a half-built node too
        self._worker: threading.Thread | None = None
        self._batch_lock = threading.Lock()  # held while a batch runs (deactivate waits)
        self.intake: FrameIntake | None = None
        self.method: TTAMethodLike | None = None
        self.source_model: torch.nn.Module | None = None
        self.declaring = False  # method.* parameters being declared (callbacks skip them)
        self.build_error = ""  # why the last rebuild failed ('' when it did not)
        self._pending: dict[str, Any] = {}
        self._pending_lock = threading.Lock()
        super().__init__(node_name, context=context, parameter_overrides=parameter_overrides,
                         cli_args=list(cli_args) if cli_args else None,
                         automatically_declare_parameters_from_overrides=True)  # start_values
        self.specs = param_specs()
        declare_all(self, self.specs)
        self.p = values(self, self.specs)
        check_initial(self.specs, self.p)
        self.options = self._declare_method(self.p["method"])
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self.add_post_set_parameters_callback(self._after_set_parameters)

    # ------------------------------------------------------------ lifecycle
    def _configure(self) -> None:
        """Read the parameters, load the source model and build the method (its artifacts:
        profile, bank, calibration), create the publishers, subscriptions, the diagnostics
        timer and the worker thread (idle until activated)."""
        self.p = values(self, self.specs)
        with self._pending_lock:
            self._pending = {}  # every value is read here
        self._load_source()
        self.domain = DomainWiring(self)  # domain reports, bank saves
        self.fleet = PerceptionFleet(self, self.p["fleet_calibration"],  # fleet mode
                                     self.fleet_settings)
        self._build_method()
        self.queue = FrameQueue(self.p["queue_size"])
        self.gate = PlanGate(self.p[FEED_TIMEOUT])
        self.guard = DivergenceGuard(self.card.num_classes, self.p["reset_entropy_ratio"],
                                     self.p["reset_patience"])
        self.counters = Counters()
        self.bounds = Bounds.from_params(self.p)  # plausibility of plans, telemetry, speed
        self.refusals = Refusals(self.get_logger().warning)
        self._rejection_diags = RateLimit(per_s=5)  # rejections published right away
        self._rejection_lock = threading.Lock()  # frames are refused on converter threads
        self._inline_fallback = False
        self._no_room = ""  # inline planning: why no trainable unit fits sigma * T
        self.telemetry = TelemetryFeed(self.p[FEED_TIMEOUT])
        self.speed = SpeedFeed(self, self.p["odometry_topic"], self.p["odometry_type"],
                               self.p[FEED_TIMEOUT],
                               lambda: self.get_clock().now().nanoseconds * 1e-9)
        self.speed.admit = lambda v: self.refusals.admit("odometry", check_speed, v,
                                                         self.bounds)
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.pub_pred = self.create_lifecycle_publisher(ClassPrediction, "predictions", 100)
        self.pub_status = self.create_lifecycle_publisher(AdaptationStatus,
                                                          "adaptation_status", reliable)
        self.pub_imp = self.create_lifecycle_publisher(LayerImportance, "layer_importance",
                                                       reliable)
        self.diag = DiagnosticsPublisher(self)
        self.create_subscription(LayerPlan, "layer_plan", self._on_plan, reliable)
        self.create_subscription(ResourceTelemetry, "telemetry", self._on_telemetry, 10)
        self.create_timer(1.0, self._publish_diagnostics)
        self._stop.clear()
        self._worker = threading.Thread(target=self._run, name="perception-worker",
                                        daemon=True)
        self._worker.start()

    def _activate(self) -> None:
        """Take frames: the image subscription (on an intake thread of its own, never
        faster than the worker uses frames, converted before they are queued:
        tta_ros.nodes.intake says why) exists only while the node is active."""
        self.gate = PlanGate(self.gate.timeout_s)  # no plan made before deactivation
        self._inline_fallback = False
        self.intake = FrameIntake(self, self.queue, frame_topic(self, self.p["input"]),
                                  qos_profile_sensor_data, self._backlog,
                                  FRAME_INPUTS[self.p["input"]].msg_type, self._prepare)

    def _deactivate(self) -> None:
        """Stop serving: no more frames taken, the running batch finished (its outputs
        published), the frames still queued dropped (counted). The method keeps its
        adapted state: activation serves on from it."""
        if self.intake is not None:
            self.intake.close()
            self.intake = None
        with self._batch_lock:  # the batch under way ends; none starts while inactive
            self.queue.clear()

    def _cleanup(self) -> None:
        """Stop and join the worker, save the domain bank, close the method, then free the
        method and the source model (ManagedNode hands their memory back). Also after a
        configure that failed half way."""
        self._stop.set()
        queue, domain, fleet = (getattr(self, name, None) for name in ("queue", "domain",
                                                                        "fleet"))
        if self._worker is not None:
            if queue is not None:
                queue.close()
            self._worker.join(timeout=30.0)
        if self.method is not None:
            if domain is not None:
                domain.close(self._worker)  # the bank's last save, after the worker stopped
            self.method.close()
        self._worker = None
        # the wiring's callbacks (destroyed services still in an executor's wait list) may
        # outlive this transition: they must not keep the method
        for wiring in (domain, fleet):
            if wiring is not None:
                wiring.method = None
        self.method = self.source_model = None
        for name in ("domain", "fleet", "queue", "gate", "telemetry", "speed"):
            setattr(self, name, None)  # what may hold the method or its tensors

    # ------------------------------------------------------------ set-up
    def _load_source(self) -> None:
        """Device, threads, the source model (loaded once: every (re)built method adapts
        a copy of it), its preprocessing and the frame limits."""
        self.device = check_device(self.p["device"])
        if self.p["num_threads"] > 0:
            torch.set_num_threads(self.p["num_threads"])
        if not self.p["model_card"]:
            raise ValueError("parameter model_card is empty: the perception node needs one")
        self.source_model, self.card = load_source(
            ros_params.resolve_data_path(self.p["model_card"]))
        self.pre = Preprocess.from_card(self.card)
        self.limits = FrameLimits(tuple(self.p["float_range"]), self.p["max_pixels"],
                                  self.p["max_aspect"], self.p["max_decode_bytes"]
                                  or decode_budget(self.pre.image_size))
        self.model_name = self.card.name or self.card.arch

    def _declare_method(self, name: str) -> MethodOptions:
        """Declare method `name`'s method.* parameters with their start values (given at
        start, else the config's defaults); ValueError naming a bad one."""
        opts = MethodOptions(name, override_values(self))
        # the device is checked after the method's options (None: fp16 is refused when
        # the method is built on a CPU)
        if reason := opts.check(opts.values) or check_precision_param(
                name, opts.get("precision"), getattr(self, "device", None)):
            raise ValueError(reason)
        self.declaring = True
        try:
            for pname, prm in opts.params.items():
                value = opts.values[pname]
                if value == []:  # no type to infer from: declare it typed, then set it
                    self.declare_parameter(pname, prm.ros_type, prm.descriptor(),
                                           ignore_override=True)
                    self.set_parameters([Parameter(pname, prm.ros_type, [])])
                else:
                    self.declare_parameter(pname, value, prm.descriptor(),
                                           ignore_override=True)
        finally:
            self.declaring = False
        self._report_foreign(opts)
        return opts

    def _report_foreign(self, opts: MethodOptions) -> None:
        """Name the given values the node cannot take (method_params.report_given)."""
        report_given(self, opts)

    def _build_method(self) -> None:
        """Build the configured method on a fresh copy of the source model; the old one
        (its bank saved) is closed once the new one is built."""
        opts, s = self.options, self.pre.image_size
        fill = {"input_shape": (3, s, s), "arch": self.card.arch}
        config = {**opts.config(), **{k: v for k, v in fill.items() if k in opts.filled}}
        model = copy.deepcopy(self.source_model).to(self.device)
        if self.method is not None:
            self.domain.save("method rebuilt")  # the rebuilt method loads it
        with self.domain.loading():  # a bad bank file: one line, from domain.attach
            method = build_warm(opts.method, config, model, int(self.p["batch_size"]),
                                (3, s, s))
        if self.method is not None:
            self.method.close()
        self.method = method
        self.domain.attach(method, opts.get("bank_path") or "")
        self.fleet.attach(method)
        self.unit_names = unit_names(self)

    def fleet_settings(self) -> dict[str, Any]:
        """The batch size and the method's options (keep, camera_hz, deadline_*)."""
        return {**self.options.config(), "batch_size": int(self.p["batch_size"])}

    @property
    def accepts_plans(self) -> bool:
        """Whether the current method follows LayerPlans."""
        return isinstance(self.method, TakesPlan)

    # ------------------------------------------------------------ parameters
    def _on_set_parameters(self, params: Sequence[Parameter]) -> SetParametersResult:
        return check_change(self, params)

    def _after_set_parameters(self, params: Sequence[Parameter]) -> None:
        """Accepted changes: a new method's parameters declared here; the rest applied by
        the worker between batches (the odometry subscription: here)."""
        if self.declaring:
            return
        new = {p.name: p.value for p in params}
        if new.get("method", self.options.method) != self.options.method:
            for name in self.options.params:
                self.undeclare_parameter(name)
            self.options = self._declare_method(new["method"])
        self.options.values.update({k: v for k, v in new.items() if k in self.options.params})
        if not self.configured:
            return  # configure reads every value
        with self._pending_lock:
            self._pending.update(new)
        self.speed.on_params(new, FEED_TIMEOUT)

    def _apply_pending(self) -> None:
        """Apply parameter changes between batches (worker thread): the method's setters
        where it has them, else a rebuild."""
        with self._pending_lock:
            changes, self._pending = self._pending, {}
        if not changes:
            return
        self.p.update({k: v for k, v in changes.items() if k in self.p})
        opts = self.options
        changed = [opts.params[k] for k in changes if k in opts.params]
        fields = {p.info.name: p.config_value(changes[p.name]) for p in changed}
        rebuild = "method" in changes or not all(p.info.runtime for p in changed)
        if rebuild or (fields and self._apply_live(fields)):
            self._rebuild()
        if "queue_size" in changes:
            self.queue.resize(self.p["queue_size"])
        self.gate.timeout_s = self.telemetry.timeout_s = float(self.p[FEED_TIMEOUT])
        self.guard.ratio = float(self.p["reset_entropy_ratio"])
        self.guard.patience = int(self.p["reset_patience"])

    def _apply_live(self, fields: dict[str, Any]) -> bool:
        """Changed options through the method's setters; True when some need a rebuild."""
        try:
            return bool(apply_live(self.method, fields))
        except ValueError as exc:  # e.g. a size the method does not serve
            reason = f"{', '.join(PREFIX + k for k in fields)} not applied: {exc_line(exc)}"
            self.get_logger().warning(reason)
            self._diag_now("adaptation", WARN, reason)
            return False

    def _rebuild(self) -> None:
        """Rebuild the method; on failure the previous one goes on serving (ERROR)."""
        try:
            self._build_method()
        except Exception as exc:  # a bad profile file, a model the method cannot adapt
            self.build_error = (f"method {self.options.method} not rebuilt "
                                f"({exc_line(exc)}): still running {self.method.name}")
            self.get_logger().error(self.build_error)
            self._diag_now("adaptation", ERROR, self.build_error)
            return
        self.build_error = ""
        self.get_logger().info(f"method rebuilt: {self.options.method} "
                               f"({status_mode(self.options)})")

    # ------------------------------------------------------------ callbacks
    def _backlog(self) -> int:
        """Queued frames at which the intake pauses: two batches (fresh frames, no more)."""
        return min(self.queue.maxlen, 2 * int(self.p["batch_size"]))

    def _on_telemetry(self, msg: ResourceTelemetry) -> None:
        if not self.serving or not self.refusals.admit("ResourceTelemetry", check_telemetry,
                                                       msg, self.bounds):
            return
        self.telemetry.on_reading(*telemetry_pis(msg.compute_expansion, msg.memory_expansion))

    def _on_plan(self, msg: LayerPlan) -> None:
        method = self.method
        if not self.serving or not isinstance(method, TakesPlan):
            return
        try:
            plausibility.check_plan(msg, self.bounds)
            plan = check_plan(msg, self.model_name, self.unit_names, method.trainable)
        except ValueError as exc:  # the last good plan (or inline) goes on serving
            self.refusals.refuse("LayerPlan", f"plan {msg.plan_id}: {exc}")
            self._diag_now("planning", WARN, f"plan {msg.plan_id} ignored: {exc}")
            return
        was_stale = self._inline_fallback
        self.gate.on_plan((int(msg.plan_id), plan))
        if was_stale:
            self._inline_fallback = False
            self._diag_now("planning", OK, f"plans resumed on layer_plan (plan {msg.plan_id})")

    # ------------------------------------------------------------ worker
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._apply_pending()
                self.domain.between_batches()  # a requested bank save, never during a step
                frames = self.queue.take(int(self.p["batch_size"]),
                                         float(self.p["batch_timeout_s"]))
                if frames:
                    with self._batch_lock:
                        if self.serving:
                            self._process(frames)
                        else:  # taken as the node deactivated: dropped, counted
                            self.queue.count_lost(len(frames))
            except Exception as exc:  # the node keeps running; the error is reported
                self.counters.step_errors += 1
                self.counters.last_error = f"{type(exc).__name__}: {exc}"
                self.get_logger().error(f"batch failed: {self.counters.last_error}")
                self._diag_now("adaptation", ERROR, self.counters.last_error)
                if self.accepts_plans and self.p["plan_source"] == "topic":
                    self.gate.on_importance_sent()  # no plan answers a failed batch: stale

    def _prepare(self, raw: bytes) -> ReadyFrame | None:
        """One serialized frame -> its header and model input (on a converter thread);
        None when it is refused (counted, never batched; the reason is one short line)."""
        try:
            return ReadyFrame(*frame_tensor(raw, self.p["input"], self.limits, self.pre))
        except ValueError as exc:
            self._count_rejection(exc)
        except Exception as exc:  # a decoder's own error (cv2.error): refused all the same
            self._count_rejection(ValueError(f"frame not converted ({type(exc).__name__}: "
                                             f"{exc_line(exc)})"))
        return None

    def _count_rejection(self, exc: ValueError) -> None:
        """Count a refused frame; log why at most once a second and publish it on
        /diagnostics for the first 5 of each second (a flood of bad frames costs no more
        than their parse; the 1 Hz input status carries the count and the last reason)."""
        c, reason = self.counters, one_line(exc)
        with self._rejection_lock:
            c.rejected += 1
            c.too_large += isinstance(exc, FrameTooLarge)
            c.last_rejection, count = reason, c.rejected
            publish = self._rejection_diags.allow()
        self.get_logger().warning(f"frame rejected ({count} so far): {reason}",
                                  throttle_duration_sec=1.0)
        if publish:
            self._diag_now("input", ERROR, f"frame rejected: {reason}")

    def _choose_plan(self) -> tuple[int, Plan | None]:
        """(plan_id, plan) for the next batch; (0, None) means plan inline."""
        if not self.accepts_plans or self.p["plan_source"] != "topic":
            return 0, None
        current = self.gate.current()
        if current is None and self.gate.stale() and not self._inline_fallback:
            self._inline_fallback = True
            self._diag_now("planning", WARN, planning_message(self))
        return current if current is not None else (0, None)

    def _step(self, x: torch.Tensor, plan: Plan | None) -> StepResult:
        if plan is None:
            self.telemetry.apply(self.method)
            if isinstance(self.method, DeadlineTunable):
                self.method.set_speed(self.speed.speed())
                self.method.set_lateness(self.queue.late_ms())
            return self.method.step(x)
        return self.method.step(x, plan=plan)

    def _process(self, frames: list[ReadyFrame]) -> None:
        x = torch.cat([f.x for f in frames]).to(self.device)
        chosen = self._choose_plan()
        plan_id, plan = chosen
        try:
            res = self._step(x, plan)
        except Exception as exc:
            if plan is None:
                raise
            self.gate.discard(chosen)  # this batch and the next ones: inline
            self._diag_now("planning", WARN, f"plan {plan_id} failed ({type(exc).__name__}: "
                           f"{exc}): planning inline until the next plan")
            plan_id, plan = 0, None
            res = self._step(x, None)
        self._note_no_room(res)
        self.counters.count_batch(from_topic=plan_id != 0)
        logits = res.logits.float()
        reason = self.guard.check(bool(torch.isfinite(logits).all()), float(res.mean_entropy))
        publish_batch(self, frames, logits, res, plan_id, bool(reason))
        self.domain.on_batch(res)
        if reason:
            self.method.reset()
            self.get_logger().warning(f"divergence guard: {reason}; source weights restored")
            self._diag_now("adaptation", WARN, f"reset: {reason}")

    def _note_no_room(self, res: StepResult) -> None:
        no_room = res.planning.no_room if res.planning is not None else ""
        if no_room and not self._no_room:
            self._no_room = no_room
            self._diag_now("planning", WARN, planning_message(self))
        self._no_room = no_room

    # ------------------------------------------------------------ publishing
    def _publish_diagnostics(self) -> None:
        self.diag.publish(perception_statuses(self))
        self.fleet.publish()  # the fleet report of a Resizable method

    def _diag_now(self, which: str, level: int, message: str) -> None:
        """Publish one status right away (rejections, fallbacks, resets)."""
        st = next(s for s in perception_statuses(self) if s.name.endswith(which))
        st.level, st.message = level, message
        self.diag.publish([st])


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: `perception_node --ros-args -p model_card:=...`."""
    from tta_ros.bringup import node_main

    return node_main(PerceptionNode, argv)


if __name__ == "__main__":
    sys.exit(main())
