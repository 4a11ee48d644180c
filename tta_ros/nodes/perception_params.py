"""The perception node's parameters at run time: declared, checked, handed to the worker.

`param_specs` are the node's own parameters. `PerceptionParams` (made with the node:
parameters exist before configure) declares them and the selected method's `method.<field>` ones
(tta_ros.nodes.method_params.MethodOptions, start values from the params file or -p:
tta_ros.ros_params.start_values), and holds the current MethodOptions. A change is
checked (`check`, the on-set callback): the node's own values in range, a valid odometry
topic, then the method side: a new `method` must build with its start values and come
alone, method.* values must be valid for the method's config, runnable on the node's
device (`method.precision`) and takeable by the running method's setters. An accepted
change (`accept`, the post-set callback) declares a new method's parameters (after
undeclaring the old ones) and is kept for the worker, which takes the changes between
batches (`take`) and asks which option fields changed and whether they need a rebuild
(`split`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rcl_interfaces.msg import SetParametersResult
from rclpy.node import Node
from rclpy.parameter import Parameter

from tta_core.api import TTAMethodLike
from tta_core.registry import available_methods
from tta_ros.convert import FRAME_INPUTS
from tta_ros.diagnostics import HARDWARE_ID
from tta_ros.nodes.deadline_wiring import ODOMETRY_PARAMS, resolve_topic
from tta_ros.nodes.fleet_wiring import PERCEPTION_FLEET_PARAMS
from tta_ros.nodes.method_params import (
    PREFIX,
    MethodOptions,
    check_live,
    check_precision_param,
    report_given,
)
from tta_ros.nodes.plausibility import PLAUSIBILITY_PARAMS
from tta_ros.ros_params import ParamSpec, check_initial, declare_all, start_values, validate, values

FEED_TIMEOUT = "feed_timeout_s"


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
        ParamSpec("segmentation_size", "input", "segmentation cards: the size of the masks "
                  "and overlays published, the model input's or the frame's (nearest "
                  "neighbour)", choices=("input", "frame"), read_only=True),
        ParamSpec("publish_overlay", True, "segmentation cards: publish segmentation_overlay "
                  "(rgb8, the class colours blended on the frame)", read_only=True),
        ParamSpec("overlay_alpha", 0.5, "segmentation cards: share of the class colour in "
                  "the overlay", 0.0, 1.0, read_only=True),
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


class PerceptionParams:
    """The perception node's parameters and method options; see the module docstring."""

    def __init__(self, node: Node, specs: Sequence[ParamSpec]) -> None:
        """Declare `specs` on `node` (start values checked), then the method's options."""
        self.node, self.specs = node, tuple(specs)
        self.declaring = False  # method.* parameters being declared (callbacks skip them)
        self.device: Any = None  # the node's torch device once configured (fp16: CUDA only)
        self.pending_lock = threading.Lock()  # held while changes are handed to the worker
        self._pending: dict[str, Any] = {}
        declare_all(node, self.specs)
        start = values(node, self.specs)
        check_initial(self.specs, start)
        self.options = self.declare_method(start["method"])

    def read(self) -> dict[str, Any]:
        """Every current value of the node's own parameters; the changes kept for the
        worker are dropped (configure reads every value)."""
        with self.pending_lock:
            self._pending = {}
        return values(self.node, self.specs)

    # ------------------------------------------------------------ method options
    def declare_method(self, name: str) -> MethodOptions:
        """Declare method `name`'s method.* parameters with their start values (given at
        start, else the config's defaults); ValueError naming a bad one. Then name the
        given values the node cannot take (method_params.report_given)."""
        opts = MethodOptions(name, start_values(self.node))
        # before configure the device is None: fp16 is refused when the method is built
        if reason := opts.check(opts.values) or check_precision_param(
                name, opts.get("precision"), self.device):
            raise ValueError(reason)
        self.declaring = True
        try:
            for pname, prm in opts.params.items():
                value = opts.values[pname]
                if value == []:  # no type to infer from: declare it typed, then set it
                    self.node.declare_parameter(pname, prm.ros_type, prm.descriptor(),
                                                ignore_override=True)
                    self.node.set_parameters([Parameter(pname, prm.ros_type, [])])
                else:
                    self.node.declare_parameter(pname, value, prm.descriptor(),
                                                ignore_override=True)
        finally:
            self.declaring = False
        report_given(self.node, opts)
        return opts

    # ------------------------------------------------------------ changes
    def check(self, params: Sequence[Parameter], method: TTAMethodLike | None
              ) -> SetParametersResult:
        """on_set_parameters: the node's own values in range, a valid odometry topic, then
        the method side (`check_method`) against the running `method`."""
        res = validate(self.specs, params)
        if not res.successful or self.declaring:
            return res
        new = {p.name: p.value for p in params}
        try:
            if "odometry_topic" in new:
                resolve_topic(self.node, new["odometry_topic"])
        except ValueError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        reason = self.check_method(new, method)
        return SetParametersResult(successful=not reason, reason=reason)

    def check_method(self, new: Mapping[str, Any], method: TTAMethodLike | None) -> str:
        """'' or why not: a new method must build with its start values (and come alone);
        method.* values must be changeable now, valid for the method's config and takeable
        by the running `method`'s setters."""
        name = new.get("method", self.options.method)
        changes = {k: v for k, v in new.items() if k.startswith(PREFIX)}
        if name != self.options.method:
            if changes:
                return (f"method={name!r}: set method alone (its method.* parameters are "
                        f"declared anew with it), then its options")
            opts = MethodOptions(name, start_values(self.node))
            return opts.check(opts.values) or check_precision_param(
                name, opts.get("precision"), self.device)
        if not changes:
            return ""
        params = self.options.params
        return self.options.check(changes) or check_precision_param(
            name, changes.get(PREFIX + "precision"), self.device) or check_live(
            method, {k[len(PREFIX):]: params[k].config_value(v) for k, v in changes.items()})

    def accept(self, params: Sequence[Parameter], keep: bool) -> dict[str, Any]:
        """post_set_parameters: accepted changes by name ({} while declaring); a new
        method's parameters declared here (the old ones undeclared); `keep`: kept for the
        worker too (a configured node)."""
        if self.declaring:
            return {}
        new = {p.name: p.value for p in params}
        if new.get("method", self.options.method) != self.options.method:
            for name in self.options.params:
                self.node.undeclare_parameter(name)
            self.options = self.declare_method(new["method"])
        self.options.values.update({k: v for k, v in new.items() if k in self.options.params})
        if keep:
            with self.pending_lock:
                self._pending.update(new)
        return new

    def take(self) -> dict[str, Any]:
        """The changes accepted since the last call (the worker, between batches)."""
        with self.pending_lock:
            changes, self._pending = self._pending, {}
        return changes

    def split(self, changes: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """The changed method options of `changes` (config field -> config value), and
        whether the method must be rebuilt for them: a new method, or an option its
        setters never take (`runtime=False`)."""
        changed = [self.options.params[k] for k in changes if k in self.options.params]
        fields = {p.info.name: p.config_value(changes[p.name]) for p in changed}
        return fields, "method" in changes or not all(p.info.runtime for p in changed)
