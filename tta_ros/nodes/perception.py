"""perception node: camera images -> TTA method (tta_core) -> predictions + status.

Frames are taken on an intake thread and converted to the model's input on converter
threads (tta_ros.nodes.intake; decoded and reduced by tta_ros.convert.frame_tensor) before
they enter a bounded keep-latest FrameQueue (drops counted), so one costly frame delays
no batch; one worker thread batches the ready tensors, runs the method's step and
publishes `predictions` (one ClassPrediction per image, header = image header; a
segmentation card: `segmentation` masks and `segmentation_overlay` images instead,
tta_ros.nodes.segmentation_output), `adaptation_status` and `layer_importance` (once per
batch). With `plan_source: topic` the
latest LayerPlan applies to the next batch; when plans go stale (PlanGate) it plans inline
and says so on /diagnostics (WARN), and goes back to the topic as soon as plans resume.
A divergence guard calls method.reset() (source weights) and sets status.reset.

A managed (lifecycle) node (tta_ros.lifecycle): built, it declares its parameters; configure
loads the source model, builds and warms up the method (profile, domain bank, fleet
calibration), creates its collaborators, subscriptions and the worker (idle); activate
opens the image intake; deactivate closes it, finishes the batch under way and drops the
queued frames (counted) while the method keeps its adapted state (activation serves on
from it); cleanup stops the worker, saves the bank and frees the method, the source model
and the collaborators.

This module is the wiring: the lifecycle transitions, the subscriptions and the worker
loop, which call the collaborators that own their state:
- PerceptionParams (tta_ros.nodes.perception_params; made with the node): declares the
  parameters, checks each change, keeps the accepted ones for the worker;
- PlanChoice (tta_ros.nodes.plan_choice): the plan of each batch, stale plans, the
  planning status;
- BatchDeadline (tta_ros.nodes.deadline_wiring): the speed feed, a batch's deadline and
  what a deadline-aware method is told before it plans inline;
- PerceptionOutput (tta_ros.nodes.perception_output): the publishers (predictions,
  adaptation_status, layer_importance, /diagnostics), the counters, the input and
  adaptation statuses;
- FrameIntake, FrameQueue, DivergenceGuard, TelemetryFeed (tta_ros.nodes.intake,
  perception_support), DomainWiring, PerceptionFleet (domain_wiring, fleet_wiring).

Parameters (tta_ros.nodes.perception_params): the node's own (`param_specs`: input,
batching, queue, input checks, device, threads, plans, feed timeout, divergence guard,
odometry, fleet calibration, hardware_id, the `method` name) and, for the selected method,
one `method.<field>` per field of its config (tta_ros.nodes.method_params: type, range,
choices and help from the config's options; input_shape and arch come from the model
card). A change is validated in one on-set callback (ranges, choices, and the method's own
config validation) and applied by a post-set callback: the method's setters take lr,
sigma, the deadline options and keep between batches, any other option rebuilds the
method between batches; a new `method` undeclares the old method.* parameters and
declares the new method's.

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
import sys
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.context import Context
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from tta_msgs.msg import LayerPlan, ResourceTelemetry

from tta_core.adashadow.planning import Plan, telemetry_pis
from tta_core.api import StepResult, TakesPlan, TTAMethodLike
from tta_core.errors import one_line as exc_line
from tta_core.eval.seg_bench import check_methods
from tta_core.io.image_msg import FrameLimits, Preprocess, decode_budget
from tta_core.model.source import load_source
from tta_core.runtime.device import check_device
from tta_ros import ros_params
from tta_ros.convert import FRAME_INPUTS, frame_input, frame_topic
from tta_ros.diagnostics import ERROR, WARN
from tta_ros.lifecycle import ManagedNode
from tta_ros.nodes.deadline_wiring import BatchDeadline, SpeedFeed
from tta_ros.nodes.domain_wiring import DomainWiring
from tta_ros.nodes.fleet_wiring import PerceptionFleet
from tta_ros.nodes.intake import FrameIntake
from tta_ros.nodes.method_params import PREFIX, apply_live
from tta_ros.nodes.perception_output import Counters, PerceptionOutput, status_mode
from tta_ros.nodes.perception_params import FEED_TIMEOUT, PerceptionParams, param_specs
from tta_ros.nodes.perception_support import (
    DivergenceGuard,
    FrameQueue,
    TelemetryFeed,
    build_warm,
    unit_names,
)
from tta_ros.nodes.plan_choice import PlanChoice
from tta_ros.nodes.plausibility import Bounds, Refusals, check_speed, check_telemetry
from tta_ros.nodes.segmentation_output import SegmentationOutput


class ReadyFrame(NamedTuple):
    """A frame converted on an intake thread: its header, its 1x3xHxW model input, its
    (height, width) and, for frame-size segmentation overlays, its decoded pixels."""

    header: Any
    x: torch.Tensor
    hw: tuple[int, int] = (0, 0)
    pix: Any = None


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
        super().__init__(node_name, context=context, parameter_overrides=parameter_overrides,
                         cli_args=list(cli_args) if cli_args else None,
                         automatically_declare_parameters_from_overrides=True)  # start_values
        self.params = PerceptionParams(self, param_specs())
        self.p = self.params.read()
        self.add_on_set_parameters_callback(lambda ps: self.params.check(ps, self.method))
        self.add_post_set_parameters_callback(self._after_set_parameters)

    # ------------------------------------------------------------ lifecycle
    def _configure(self) -> None:
        """Read the parameters, load the source model and build the method (its artifacts:
        profile, bank, calibration), create the collaborators (planning, deadline,
        outputs), the subscriptions, the diagnostics timer and the worker thread (idle
        until activated)."""
        self.p = self.params.read()  # every value is read here
        self._load_source()
        self.bounds = Bounds.from_params(self.p)  # plausibility of plans, telemetry, speed
        self.refusals = Refusals(self.get_logger().warning)
        self.planning = PlanChoice(self.p[FEED_TIMEOUT], self.p["plan_source"],
                                   self.model_name, self.bounds, self.refusals,
                                   lambda level, text: self._diag_now("planning", level, text))
        self.domain = DomainWiring(self)  # domain reports, bank saves
        self.fleet = PerceptionFleet(self, self.p["fleet_calibration"],  # fleet mode
                                     self.fleet_settings)
        self._build_method()
        self.queue = FrameQueue(self.p["queue_size"])
        self.guard = DivergenceGuard(self.card.num_classes, self.p["reset_entropy_ratio"],
                                     self.p["reset_patience"])
        self.telemetry = TelemetryFeed(self.p[FEED_TIMEOUT])
        self.speed = SpeedFeed(self, self.p["odometry_topic"], self.p["odometry_type"],
                               self.p[FEED_TIMEOUT],
                               lambda: self.get_clock().now().nanoseconds * 1e-9)
        self.speed.admit = lambda v: self.refusals.admit("odometry", check_speed, v,
                                                         self.bounds)
        self.deadline = BatchDeadline(self.speed, self.queue.late_ms)
        self.output = PerceptionOutput(self, self.card, self.device, self.queue,
                                       self.refusals, self.guard, self.fleet,
                                       self._segmentation_output())
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
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
        self.planning.restart()  # no plan made before deactivation
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
        method, the source model and the collaborators (ManagedNode hands their memory
        back). Also after a configure that failed half way."""
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
        for name in ("domain", "fleet", "queue", "planning", "telemetry", "speed",
                     "deadline", "output"):
            setattr(self, name, None)  # what may hold the method or its tensors

    # ------------------------------------------------------------ set-up
    def _load_source(self) -> None:
        """Device, threads, the source model (loaded once: every (re)built method adapts
        a copy of it), its preprocessing and the frame limits."""
        self.device = self.params.device = check_device(self.p["device"])
        if self.p["num_threads"] > 0:
            torch.set_num_threads(self.p["num_threads"])
        if not self.p["model_card"]:
            raise ValueError("parameter model_card is empty: the perception node needs one")
        self.source_model, self.card = load_source(
            ros_params.resolve_data_path(self.p["model_card"]))
        self.pre = Preprocess.from_card(self.card)
        self.limits = FrameLimits(tuple(self.p["float_range"]), self.p["max_pixels"],
                                  self.p["max_aspect"], self.p["max_decode_bytes"]
                                  or decode_budget(self.pre.side))
        self.model_name = self.card.name or self.card.arch
        self.segmenting = self.card.task == "segmentation"
        self.keep_pixels = self.segmenting and self.p["segmentation_size"] == "frame" \
            and self.p["publish_overlay"]

    def _segmentation_output(self) -> SegmentationOutput | None:
        """A segmentation card's mask and overlay publishers (None: a classifier)."""
        if not self.segmenting:
            return None
        return SegmentationOutput(self, self.card, self.pre, self.p["segmentation_size"],
                                  self.p["overlay_alpha"], self.p["publish_overlay"])

    def _build_method(self) -> None:
        """Build the configured method on a fresh copy of the source model; the old one
        (its bank saved) is closed once the new one is built."""
        opts, sample = self.params.options, (3, *self.pre.hw)
        if self.segmenting:
            check_methods((opts.method,))  # InputError naming why it cannot segment
        fill = {"input_shape": sample, "arch": self.card.arch}
        config = {**opts.config(), **{k: v for k, v in fill.items() if k in opts.filled}}
        model = copy.deepcopy(self.source_model).to(self.device)
        if self.method is not None:
            self.domain.save("method rebuilt")  # the rebuilt method loads it
        with self.domain.loading():  # a bad bank file: one line, from domain.attach
            method = build_warm(opts.method, config, model, int(self.p["batch_size"]),
                                sample)
        if self.method is not None:
            self.method.close()
        self.method = method
        self.planning.accepts = isinstance(method, TakesPlan)
        self.domain.attach(method, opts.get("bank_path") or "")
        self.fleet.attach(method)
        self.unit_names = unit_names(method, self.source_model, sample, self.card.arch,
                                     self.get_logger().info)

    def fleet_settings(self) -> dict[str, Any]:
        """The batch size and the method's options (keep, camera_hz, deadline_*)."""
        return {**self.params.options.config(), "batch_size": int(self.p["batch_size"])}

    # ------------------------------------------------------------ parameters
    def _after_set_parameters(self, params: Sequence[Parameter]) -> None:
        """Accepted changes: a new method's parameters declared (PerceptionParams.accept);
        the rest applied by the worker between batches (the odometry subscription: here)."""
        new = self.params.accept(params, keep=self.configured)
        if new and self.configured:  # unconfigured: configure reads every value
            self.speed.on_params(new, FEED_TIMEOUT)

    def _apply_pending(self) -> None:
        """Apply parameter changes between batches (worker thread): the method's setters
        where it has them, else a rebuild."""
        changes = self.params.take()
        if not changes:
            return
        self.p.update({k: v for k, v in changes.items() if k in self.p})
        fields, rebuild = self.params.split(changes)
        if rebuild or (fields and self._apply_live(fields)):
            self._rebuild()
        if "queue_size" in changes:
            self.queue.resize(self.p["queue_size"])
        self.planning.source = self.p["plan_source"]
        self.planning.gate.timeout_s = self.telemetry.timeout_s = float(self.p[FEED_TIMEOUT])
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
        opts = self.params.options
        try:
            self._build_method()
        except Exception as exc:  # a bad profile file, a model the method cannot adapt
            self.output.build_error = (f"method {opts.method} not rebuilt "
                                       f"({exc_line(exc)}): still running {self.method.name}")
            self.get_logger().error(self.output.build_error)
            self._diag_now("adaptation", ERROR, self.output.build_error)
            return
        self.output.build_error = ""
        self.get_logger().info(f"method rebuilt: {opts.method} ({status_mode(opts)})")

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
        if self.serving:
            self.planning.take(msg, self.method, self.unit_names)

    def _prepare(self, raw: bytes) -> ReadyFrame | None:
        """One serialized frame -> its header and model input (on a converter thread);
        None when it is refused (counted, never batched; the reason is one short line)."""
        try:
            return ReadyFrame(*frame_input(raw, self.p["input"], self.limits, self.pre,
                                           self.keep_pixels))
        except ValueError as exc:
            self.output.count_rejection(exc)
        except Exception as exc:  # a decoder's own error (cv2.error): refused all the same
            self.output.count_rejection(ValueError(
                f"frame not converted ({type(exc).__name__}: {exc_line(exc)})"))
        return None

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
                self._diag_now("adaptation", ERROR, self.output.count_error(exc))
                self.planning.importance_sent()  # no plan answers a failed batch: stale

    def _step(self, x: torch.Tensor, plan: Plan | None) -> StepResult:
        if plan is None:
            self.telemetry.apply(self.method)
            self.deadline.brief(self.method)
            return self.method.step(x)
        return self.method.step(x, plan=plan)

    def _process(self, frames: list[ReadyFrame]) -> None:
        x = torch.cat([f.x for f in frames]).to(self.device)
        opts = self.params.options
        chosen = self.planning.choose(opts)
        plan_id, plan = chosen
        try:
            res = self._step(x, plan)
        except Exception as exc:
            if plan is None:
                raise
            self.planning.failed(chosen, exc)  # this batch and the next ones: inline
            plan_id, plan = 0, None
            res = self._step(x, None)
        self.planning.after_step(res, opts, from_topic=plan_id != 0)
        logits = res.logits.float()
        reason = self.guard.check(bool(torch.isfinite(logits).all()), float(res.mean_entropy))
        if self.output.publish_batch(
                [f.header for f in frames], logits, res, self.method,
                unit_names=self.unit_names, scores=self.p["publish_scores"],
                mode=status_mode(opts), plan_id=plan_id, reset=bool(reason),
                deadline_ms=self.deadline.batch_ms(self.method, len(frames)), x=x,
                sizes=[f.hw for f in frames], pixels=[f.pix for f in frames]):
            self.planning.importance_sent()
        self.domain.on_batch(res)
        if reason:
            self.method.reset()
            self.get_logger().warning(f"divergence guard: {reason}; source weights restored")
            self._diag_now("adaptation", WARN, f"reset: {reason}")

    # ------------------------------------------------------------ diagnostics
    @property
    def counters(self) -> Counters:
        """What the node counted (frames refused, batches, failed steps): its output's."""
        return self.output.counters

    def statuses(self) -> list[DiagnosticStatus]:
        """The node's statuses for /diagnostics: input, planning, adaptation, domain,
        fleet."""
        opts = self.params.options
        planning = self.planning.status(opts, self.deadline.status_values(
            opts.get("deadline_mode")))
        return self.output.statuses(opts, planning,
                                    [*self.domain.statuses(), *self.fleet.statuses()])

    def _publish_diagnostics(self) -> None:
        self.output.publish(self.statuses())
        self.fleet.publish()  # the fleet report of a Resizable method

    def _diag_now(self, which: str, level: int, message: str) -> None:
        """Publish one status right away (rejections, fallbacks, resets)."""
        st = next(s for s in self.statuses() if s.name.endswith(which))
        self.output.publish_now(st, level, message)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: `perception_node --ros-args -p model_card:=...`."""
    from tta_ros.bringup import node_main

    return node_main(PerceptionNode, argv)


if __name__ == "__main__":
    sys.exit(main())
