"""Every tta_msgs message survives a publish/subscribe round trip over real rclpy + DDS."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")  # present after `make setup`; CI always has it
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from tta_msgs.msg import (  # noqa: E402
    AdaptationStatus,
    ClassPrediction,
    LayerImportance,
    LayerPlan,
    ResourceTelemetry,
)

NAN = float("nan")
NAMES = ["conv1", "layer1.0.bn1", "fc", "größe-ünït"]


def _header(msg, sec: int) -> None:
    msg.header.stamp.sec = sec
    msg.header.stamp.nanosec = 123_456_789
    msg.header.frame_id = "camera_front"


def _filled() -> list:
    imp = LayerImportance(batch_id=2**40 + 7, model_name="resnet18", unit_names=NAMES,
                          importance=[0.0, 1.5, NAN, 3.25], forward_ms=12.5, batch_size=4)
    _header(imp, 1)
    plan = LayerPlan(plan_id=9, based_on_batch_id=2**40 + 7, model_name="resnet18",
                     unit_names=NAMES, update=[True, False, True, False],
                     importance=[0.5, NAN, 0.25, 0.0], predicted_unit_ms=[1.0, 2.0, 3.0, 4.0],
                     first_updated_index=0, sigma=0.33, budget_ms=40.0,
                     predicted_total_ms=38.5, solve_ms=0.75)
    _header(plan, 2)
    tel = ResourceTelemetry(source="psutil+sysfs", cpu_percent=55.5,
                            cpu_percent_per_core=[10.0, 100.0, NAN], gpu_percent=NAN,
                            cpu_temp_c=61.0, gpu_temp_c=NAN, cpu_freq_mhz=1420.0,
                            cpu_freq_max_mhz=2035.0, gpu_freq_mhz=NAN, gpu_freq_max_mhz=NAN,
                            competing_processes=3, cache_hit_rate=0.7, mem_used_mb=2048.0,
                            mem_total_mb=7800.0, gpu_mem_used_mb=NAN, power_w=NAN,
                            compute_expansion=1.8, memory_expansion=1.1)
    _header(tel, 3)
    status = AdaptationStatus(batch_id=5, method="adashadow", mode="sequential", adapted=True,
                              units_updated=7, plan_id=9, forward_ms=10.0, plan_ms=0.5,
                              backward_ms=20.0, reforward_ms=4.0, total_ms=34.5,
                              predicted_total_ms=33.0, budget_ms=40.0, loss=0.123,
                              mean_entropy=NAN, peak_memory_mb=512.0, frames_dropped=11,
                              reset=True, domain="fog")
    _header(status, 4)
    pred = ClassPrediction(batch_id=5, label=-1, confidence=0.875, class_name="stop ✋",
                           scores=[0.1, 0.875, NAN, 0.025])
    _header(pred, 5)
    return [imp, plan, tel, status, pred]


def _assert_same(sent, got) -> None:
    assert type(sent) is type(got)
    for field, _ in sent.get_fields_and_field_types().items():
        a, b = getattr(sent, field), getattr(got, field)
        if field == "header":
            assert (b.stamp.sec, b.stamp.nanosec, b.frame_id) == (
                a.stamp.sec, a.stamp.nanosec, a.frame_id), field
        elif isinstance(a, float):
            expect = float(np.float32(a))
            assert (math.isnan(expect) and math.isnan(b)) or b == expect, (field, a, b)
        elif isinstance(a, str) or np.ndim(a) == 0:
            assert b == a, (field, a, b)
        elif np.asarray(a).dtype.kind == "f":
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a, dtype=np.float32),
                                          err_msg=field)
        else:
            assert list(b) == list(a), (field, a, b)


def test_every_message_round_trips_over_real_rclpy(ros_context):
    sent = _filled()
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    pub_node = rclpy.create_node("tta_msgs_pub", context=ros_context)
    sub_node = rclpy.create_node("tta_msgs_sub", context=ros_context)
    received: dict[str, object] = {}
    pubs = []
    for msg in sent:
        topic = f"roundtrip/{type(msg).__name__}"
        sub_node.create_subscription(type(msg), topic,
                                     lambda m, k=topic: received.setdefault(k, m), qos)
        pubs.append((pub_node.create_publisher(type(msg), topic, qos), msg, topic))
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(pub_node)
    executor.add_node(sub_node)
    deadline = time.monotonic() + 20.0
    while len(received) < len(sent) and time.monotonic() < deadline:
        for pub, msg, topic in pubs:
            if topic not in received and pub.get_subscription_count() > 0:
                pub.publish(msg)
        executor.spin_once(timeout_sec=0.05)
    executor.shutdown()
    missing = [t for _, _, t in pubs if t not in received]
    assert not missing, f"never received: {missing}"
    for _, msg, topic in pubs:
        _assert_same(msg, received[topic])
    assert received["roundtrip/LayerPlan"].update == [True, False, True, False]
    assert received["roundtrip/ClassPrediction"].class_name == "stop ✋"


def test_message_fields_match_design_contract():
    """Field names and types are the DESIGN §7 contract; a silent rename breaks users."""
    expect = {
        LayerImportance: "header batch_id model_name unit_names importance forward_ms batch_size",
        LayerPlan: "header plan_id based_on_batch_id model_name unit_names update importance "
                   "predicted_unit_ms first_updated_index sigma budget_ms predicted_total_ms "
                   "solve_ms",
        ResourceTelemetry: "header source cpu_percent cpu_percent_per_core gpu_percent "
                           "cpu_temp_c gpu_temp_c cpu_freq_mhz cpu_freq_max_mhz gpu_freq_mhz "
                           "gpu_freq_max_mhz competing_processes cache_hit_rate mem_used_mb "
                           "mem_total_mb gpu_mem_used_mb power_w compute_expansion "
                           "memory_expansion",
        AdaptationStatus: "header batch_id method mode adapted units_updated plan_id forward_ms "
                          "plan_ms backward_ms reforward_ms total_ms predicted_total_ms "
                          "budget_ms deadline_ms loss mean_entropy peak_memory_mb "
                          "frames_dropped reset domain",
        ClassPrediction: "header batch_id label confidence class_name scores",
    }
    for cls, names in expect.items():
        assert list(cls.get_fields_and_field_types()) == names.split(), cls.__name__
    types = LayerPlan.get_fields_and_field_types()
    assert types["update"] == "sequence<boolean>"
    assert types["predicted_unit_ms"] == "sequence<float>"
    assert ResourceTelemetry.get_fields_and_field_types()["competing_processes"] == "uint32"
