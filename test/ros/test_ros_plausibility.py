"""Plausibility bounds over real rclpy + DDS (the bringup rig: resource monitor, scheduler,
perception): forged messages with implausible numbers (the issue's sigma = 3e38,
forward_ms = 99999, batch_size = 4e9; telemetry, status and odometry too) are refused,
each counted and named in /diagnostics, nothing is planned from them, and every camera
frame sent after each is answered. The real messages the nodes exchange meanwhile
(telemetry, statuses, importance) are all accepted: the refusal counts are exactly the
forged ones."""

from __future__ import annotations

import pytest

rclpy = pytest.importorskip("rclpy")
from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from helpers import wait_for  # noqa: E402
from helpers.ros import Rig, image_msg  # noqa: E402
from nav_msgs.msg import Odometry  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from tta_msgs.msg import (  # noqa: E402
    AdaptationStatus,
    LayerImportance,
    LayerPlan,
    ResourceTelemetry,
)

FORGED_BATCH = 777_777


def _values(st: DiagnosticStatus) -> dict[str, str]:
    return {kv.key: kv.value for kv in st.values}


def test_forged_numbers_refused_counted_and_service_goes_on(ros_context) -> None:
    rig = Rig(ros_context, perception={"batch_size": 4, "batch_timeout_s": 0.05})
    try:
        rel = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        pubs = {t: rig.probe.create_publisher(t, topic, rel) for t, topic in (
            (LayerPlan, "layer_plan"), (LayerImportance, "layer_importance"),
            (AdaptationStatus, "adaptation_status"), (ResourceTelemetry, "telemetry"),
            (Odometry, "odom"))}
        assert wait_for(lambda: all(p.get_subscription_count() > 0 for p in pubs.values()),
                        5.0)
        rig.send([image_msg(1000 + i) for i in range(8)])
        assert wait_for(lambda: len(rig.msgs("pred")) >= 8, 20.0)
        per, sched = rig.perception, rig.scheduler
        names, model, n = per.unit_names, per.model_name, len(per.unit_names)
        plan = LayerPlan(plan_id=990, model_name=model, unit_names=names, update=[False] * n,
                         first_updated_index=n, sigma=3e38, budget_ms=5.0)
        imp = {"model_name": model, "unit_names": names, "importance": [1.0] * n,
               "batch_id": FORGED_BATCH}
        odom = Odometry()
        odom.twist.twist.linear.x = 1e6
        forged = [  # (message, node that refuses it, kind, text its diagnostics show)
            (plan, per, "LayerPlan", "sigma = 3e+38 outside [0, 1]"),
            (LayerImportance(**imp, forward_ms=99999.0, batch_size=4),
             sched, "LayerImportance", "forward_ms = 99999.0 outside (0, 10000]"),
            (LayerImportance(**imp, forward_ms=5.0, batch_size=4_000_000_000),
             sched, "LayerImportance", "batch_size = 4000000000 outside [1, 256]"),
            (AdaptationStatus(forward_ms=5.0, total_ms=3e38), sched, "AdaptationStatus",
             "total_ms = 3e+38 outside [0, 10000]"),
            (ResourceTelemetry(compute_expansion=1e9), None, "ResourceTelemetry",
             "compute_expansion = 1e+09 outside [0, 100]"),
            (odom, None, "odometry", "speed = 1e+06 outside [0, 150]"),
        ]
        for k, (msg, node, kind, text) in enumerate(forged):
            pubs[type(msg)].publish(msg)
            for nd in (node,) if node is not None else (per, sched):
                assert wait_for(lambda nd=nd, t=text: t in nd.refusals.last, 5.0), \
                    (nd.refusals.last, text)
            seen = len(rig.msgs("pred"))
            rig.send([image_msg(1100 + k)])
            assert wait_for(lambda s=seen: len(rig.msgs("pred")) > s, 5.0), kind
        assert per.refusals.counts == {"LayerPlan": 1, "ResourceTelemetry": 1, "odometry": 1}
        assert sched.refusals.counts == {"LayerImportance": 2, "AdaptationStatus": 1,
                                         "ResourceTelemetry": 1, "odometry": 1}
        assert not [p for p in rig.msgs("plan") if p.based_on_batch_id == FORGED_BATCH]
        assert per.counters.step_errors == 0
        assert per.speed.speed() is None or per.speed.speed() < 150  # the forged one ignored
        assert wait_for(lambda: any(
            _values(s).get("messages_refused") == "3"
            for s in rig.statuses("perception: input")), 5.0)
        assert wait_for(lambda: any(
            _values(s).get("messages_refused") == "5"
            and "odometry: speed = 1e+06" in _values(s).get("last_message_refused", "")
            for s in rig.statuses("scheduler: planning")), 5.0)
        assert any("sigma = 3e+38" in s.message and s.level == DiagnosticStatus.WARN
                   for s in rig.statuses("perception: planning"))
    finally:
        rig.close()
