"""What the perception node publishes and the counters it reports.

`PerceptionOutput` (made at configure, dropped at cleanup) owns the node's publishers:
`predictions` (one ClassPrediction per image, header = image header; for a segmentation
card `segmentation` and `segmentation_overlay` instead: tta_ros.nodes.segmentation_output),
`adaptation_status`
and `layer_importance` (once per batch, reliable) and /diagnostics; and what it counts
(`Counters`: batches, refused frames, failed steps, the saved activations of the last
batch) and the reason the last method rebuild failed (`build_error`). It publishes a
batch's outputs (`publish_batch`: the predictions as soon as the forward is done, the
AdaptationStatus once a background update has finished), counts refused frames (logged
at most once a second, the first 5 of each second on /diagnostics at once) and failed
batches, and makes the node's `input` and `adaptation` statuses; the others (planning,
domain, fleet) come from their collaborators (`statuses`), with a segmentation card's
`segmentation` status last.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch
from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.qos import QoSProfile, ReliabilityPolicy
from tta_msgs.msg import AdaptationStatus, ClassPrediction, LayerImportance

from tta_core.api import StepResult, TTAMethodLike
from tta_core.io.image_msg import FrameTooLarge, one_line
from tta_core.model.source import ModelCard
from tta_ros.convert import importance_msg, peak_memory_mb, prediction_msgs, status_msg
from tta_ros.diagnostics import ERROR, OK, DiagnosticsPublisher, status
from tta_ros.lifecycle import ManagedNode
from tta_ros.nodes.fleet_wiring import PerceptionFleet
from tta_ros.nodes.method_params import MethodOptions
from tta_ros.nodes.perception_support import DivergenceGuard, FrameQueue
from tta_ros.nodes.plausibility import RateLimit, Refusals
from tta_ros.nodes.segmentation_output import SegmentationOutput


@dataclasses.dataclass
class Counters:
    """What the node reports about its input side and its batches."""

    batches: int = 0
    rejected: int = 0
    too_large: int = 0  # of the rejected: over a size or decode limit, refused undecoded
    last_rejection: str = ""
    step_errors: int = 0
    last_error: str = ""
    saved_mib: float = math.nan  # saved activations of the last batch (memory budget)


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


class PerceptionOutput:
    """The perception node's publishers and counters; see the module docstring."""

    def __init__(self, node: ManagedNode, card: ModelCard, device: torch.device,
                 queue: FrameQueue, refusals: Refusals, guard: DivergenceGuard,
                 fleet: PerceptionFleet, seg: SegmentationOutput | None = None) -> None:
        """`queue`, `refusals`, `guard`: what the input and adaptation statuses report;
        `fleet`: told each batch's confidence (between the predictions and the status);
        `seg`: a segmentation card's publishers (then no `predictions`)."""
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.seg = seg
        self.pub_pred = None if seg else node.create_lifecycle_publisher(
            ClassPrediction, "predictions", 100)
        self.pub_status = node.create_lifecycle_publisher(AdaptationStatus,
                                                          "adaptation_status", reliable)
        self.pub_imp = node.create_lifecycle_publisher(LayerImportance, "layer_importance",
                                                       reliable)
        self.diag = DiagnosticsPublisher(node)
        self.log = node.get_logger()
        self.class_names = list(card.class_names)
        self.model_name = card.name or card.arch
        self.device, self.queue, self.refusals = device, queue, refusals
        self.guard, self.fleet = guard, fleet
        self.counters = Counters()
        self.build_error = ""  # why the last rebuild failed ('' when it did not)
        self._rejection_diags = RateLimit(per_s=5)  # rejections published right away
        self._rejection_lock = threading.Lock()  # frames are refused on converter threads

    # ------------------------------------------------------------ batches
    def publish_batch(self, headers: Sequence[Any], logits: torch.Tensor, res: StepResult,
                      method: TTAMethodLike, *, unit_names: list[str], scores: bool,
                      mode: str, plan_id: int, reset: bool, deadline_ms: float,
                      x: torch.Tensor | None = None, sizes: Sequence[tuple[int, int]] = (),
                      pixels: Sequence[Any] = ()) -> bool:
        """One batch (counted): its predictions now (`scores`: with the softmax; a
        segmentation card: its masks and overlays, from the batch's input `x`, the frames'
        `sizes` and kept `pixels`), then, once a background update has finished, its
        AdaptationStatus and its importance over `unit_names`; True when an importance was
        published."""
        self.counters.batches += 1
        batch_id = self.counters.batches
        if self.seg is not None:
            self.seg.publish(headers, logits, x, sizes, pixels)
        else:
            probs = torch.softmax(logits, dim=1).cpu().numpy()  # numpy: cheap row access
            for pred in prediction_msgs(list(headers), probs, batch_id, self.class_names,
                                        scores):
                self.pub_pred.publish(pred)
        method.finish()  # parallel mode: the status carries this update's backward
        self.fleet.on_batch(res.stats, logits)  # the size's confidence (fleet accuracy proxy)
        self.counters.saved_mib = float(res.stats.get(
            "saved_mib", res.stats.get("saved_bytes", math.nan) / 2**20))  # tent: bytes only
        header = headers[-1]
        self.pub_status.publish(status_msg(
            header, batch_id, res, method=method.name, mode=mode, plan_id=plan_id,
            reset=reset, frames_dropped=int(self.queue.dropped),
            peak_mb=peak_memory_mb(self.device), deadline_ms=deadline_ms))
        imp = importance_msg(header, batch_id, self.model_name, unit_names, res, len(headers))
        if imp is not None:
            self.pub_imp.publish(imp)
        return imp is not None

    def count_error(self, exc: Exception) -> str:
        """A batch that failed: counted and logged; the one line that says why."""
        self.counters.step_errors += 1
        self.counters.last_error = f"{type(exc).__name__}: {exc}"
        self.log.error(f"batch failed: {self.counters.last_error}")
        return self.counters.last_error

    def count_rejection(self, exc: ValueError) -> None:
        """Count a refused frame; log why at most once a second and publish it on
        /diagnostics for the first 5 of each second (a flood of bad frames costs no more
        than their parse; the 1 Hz input status carries the count and the last reason)."""
        c, reason = self.counters, one_line(exc)
        with self._rejection_lock:
            c.rejected += 1
            c.too_large += isinstance(exc, FrameTooLarge)
            c.last_rejection, count = reason, c.rejected
            publish = self._rejection_diags.allow()
        self.log.warning(f"frame rejected ({count} so far): {reason}",
                         throttle_duration_sec=1.0)
        if publish:
            self.publish_now(self.input_status(), ERROR, f"frame rejected: {reason}")

    # ------------------------------------------------------------ diagnostics
    def input_status(self) -> DiagnosticStatus:
        """Frames received, dropped and refused, the queue, the refused side inputs."""
        c, q = self.counters, self.queue
        return status("input", OK, "ok", {
            "received": q.received, "dropped": q.dropped, "rejected": c.rejected,
            "too_large": c.too_large,
            "queue": f"{len(q)}/{q.maxlen}", "last_rejection": c.last_rejection,
            **self.refusals.values()})

    def adaptation_status(self, opts: MethodOptions) -> DiagnosticStatus:
        """The method (`opts`) and how its batches went; ERROR while a rebuild failed."""
        c = self.counters
        return status("adaptation", ERROR if self.build_error else OK,
                      self.build_error or f"{opts.method} ({status_mode(opts)})",
                      {"batches": c.batches, "resets": self.guard.resets,
                       "step_errors": c.step_errors, "last_error": c.last_error,
                       "saved_activation_mib": f"{c.saved_mib:.4g}", **memory_values(opts)})

    def statuses(self, opts: MethodOptions, planning: DiagnosticStatus,
                 others: Sequence[DiagnosticStatus]) -> list[DiagnosticStatus]:
        """The node's statuses for /diagnostics: input, `planning`, adaptation, `others`."""
        seg = [self.seg.status()] if self.seg is not None else []
        return [self.input_status(), planning, self.adaptation_status(opts), *others, *seg]

    def publish(self, statuses: Sequence[DiagnosticStatus]) -> None:
        """Publish `statuses` on /diagnostics (names qualified by the node's)."""
        self.diag.publish(statuses)

    def publish_now(self, st: DiagnosticStatus, level: int, message: str) -> None:
        """Publish `st` right away with `level` and `message` (rejections, fallbacks,
        resets)."""
        st.level, st.message = level, message
        self.diag.publish([st])
