"""/diagnostics conventions over real rclpy + DDS (issue #33, item 7).

A source the machine does not have (no GPU, no thermal zone, no LLC counters, no
calibration) is OK with a message saying so; STALE is only for a source that existed and
stopped updating (what diagnostic aggregators read it as). Statuses speak of the active
deadline mode only, and AdaptationStatus.deadline_ms carries the batch's deadline.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

rclpy = pytest.importorskip("rclpy")
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from geometry_msgs.msg import TwistStamped  # noqa: E402
from helpers import CARD, wait_for  # noqa: E402
from helpers.ros import image_msg  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from tta_msgs.msg import AdaptationStatus  # noqa: E402

from tta_core.runtime.deadline import DeadlineConfig, batch_deadline_ms  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402

OK, STALE = DiagnosticStatus.OK, DiagnosticStatus.STALE
NO_SOURCES = [Parameter("enable_perf", value=False), Parameter("enable_nvml", value=False),
              Parameter("enable_jtop", value=False), Parameter("rate_hz", value=20.0),
              Parameter("diagnostics_rate_hz", value=10.0),
              Parameter("cpu_warn_percent", value=100.0),  # a busy test machine is no WARN
              Parameter("mem_warn_percent", value=100.0)]


class _Spun:
    """Nodes plus a probe on one executor thread; the probe records /diagnostics
    statuses by subsystem (name after ': ')."""

    def __init__(self, ros_context, *nodes) -> None:
        self.probe = rclpy.create_node("diag_probe", context=ros_context)
        self.latest: dict[str, DiagnosticStatus] = {}
        self.seen: list[DiagnosticStatus] = []
        self.probe.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag,
                                       QoSProfile(depth=50,
                                                  reliability=ReliabilityPolicy.RELIABLE))
        self.nodes = [*nodes, self.probe]
        self.ex = SingleThreadedExecutor(context=ros_context)
        for n in self.nodes:
            self.ex.add_node(n)
        self.spin = SpinThread(self.ex)

    def _on_diag(self, arr: DiagnosticArray) -> None:
        for st in arr.status:
            self.latest[st.name.partition(": ")[2]] = st
            self.seen.append(st)

    def close(self) -> None:
        self.spin.stop()  # after the running callback: no callback on a destroyed node
        for n in self.nodes:
            n.destroy_node()


def _monitor(ros_context, sysfs: Path):
    from tta_ros.nodes.resource_monitor import ResourceMonitorNode

    return activate(ResourceMonitorNode(context=ros_context, parameter_overrides=[
        *NO_SOURCES, Parameter("sysfs_root", value=str(sysfs))]))


def test_monitor_without_gpu_thermal_llc_or_calibration_reports_ok(ros_context,
                                                                    tmp_path) -> None:
    """An empty sysfs tree, no NVML/jtop/perf, no calibration: every status OK, the
    absent sources named in the messages, nothing STALE."""
    spun = _Spun(ros_context, _monitor(ros_context, tmp_path))
    try:
        want = {"cpu", "memory", "thermal", "gpu", "cache", "sources", "expansion"}
        assert wait_for(lambda: want <= set(spun.latest), 10.0), sorted(spun.latest)
        got = {k: (spun.latest[k].level, spun.latest[k].message) for k in want}
        assert got["thermal"] == (OK, "no thermal zone")
        assert got["gpu"] == (OK, "no GPU source")
        assert got["cache"] == (OK, "no LLC counters")
        assert got["expansion"] == (OK, "no calibration: pi1/pi2 not computed")
        assert got["cpu"][0] == OK and got["cpu"][1].startswith("load ")
        assert got["memory"][0] == OK and got["memory"][1].endswith("% used")
        assert not [s.name for s in spun.seen if s.level == STALE]
    finally:
        spun.close()


def test_a_thermal_zone_that_stops_updating_turns_stale(ros_context, tmp_path) -> None:
    """A CPU thermal zone read at 45 C (OK), then its file goes away: STALE, saying so."""
    zone = tmp_path / "class" / "thermal" / "thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("x86_pkg_temp\n")
    (zone / "temp").write_text("45000\n")
    spun = _Spun(ros_context, _monitor(ros_context, tmp_path))
    try:
        def thermal() -> tuple[int, str] | None:
            st = spun.latest.get("thermal")
            return (st.level, st.message) if st else None
        assert wait_for(lambda: thermal() == (OK, "max 45.0 C"), 10.0), thermal()
        (zone / "temp").unlink()  # the sensor stops answering
        assert wait_for(lambda: thermal() == (STALE, "thermal zone stopped updating"),
                        10.0), thermal()
        assert spun.latest["gpu"].level == OK  # never had one: still OK, not STALE
    finally:
        spun.close()


def test_sigma_mode_statuses_say_nothing_of_odometry(ros_context) -> None:
    """sigma*T mode (the shipped default): neither node's planning status speaks of the
    odometry or a speed deadline, though no odometry arrives."""
    from tta_ros.nodes.perception import PerceptionNode
    from tta_ros.nodes.scheduler import SchedulerNode

    sched = activate(SchedulerNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD))]))
    perc = activate(PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("num_threads", value=1)]))
    try:
        statuses = [sched._planning_status(),
                    next(s for s in perc.statuses() if s.name == "planning")]
        for st in statuses:
            text = " ".join([st.message, *(f"{kv.key}={kv.value}" for kv in st.values)])
            assert "odometry" not in text and "speed" not in text, text
            assert st.level == OK, st.message
    finally:
        perc.destroy_node()
        sched.destroy_node()


def test_adaptation_status_carries_the_speed_deadline(ros_context) -> None:
    """Perception planning inline against a speed deadline: each AdaptationStatus's
    deadline_ms is the deadline of its batch at the speed the odometry gave, and follows a
    change of speed (0.2 m per decision: 40 ms at 5 m/s, 10 ms at 20 m/s)."""
    from tta_ros.nodes.perception import PerceptionNode

    node = activate(PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("plan_source", value="inline"),
        Parameter("batch_size", value=2), Parameter("num_threads", value=1),
        Parameter("method.deadline_mode", value="speed"),
        Parameter("method.distance_per_decision_m", value=0.2),
        Parameter("method.min_deadline_ms", value=1.0),
        Parameter("method.max_deadline_ms", value=1000.0),
        Parameter("odometry_type", value="geometry_msgs/TwistStamped"),
        Parameter("feed_timeout_s", value=30.0)]))
    cfg = DeadlineConfig(deadline_mode="speed", distance_per_decision_m=0.2,
                         min_deadline_ms=1.0, max_deadline_ms=1000.0)
    car = rclpy.create_node("fake_car", context=ros_context)
    statuses: list[AdaptationStatus] = []
    car.create_subscription(AdaptationStatus, "adaptation_status", statuses.append,
                            QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE))
    cam = car.create_publisher(Image, "image", qos_profile_sensor_data)
    odom = car.create_publisher(TwistStamped, "odom", 10)
    spun = _Spun(ros_context, node, car)
    frame = 0

    def drive(speed: float) -> list[AdaptationStatus]:
        """Odometry at `speed` until perception has it, then frames until 2 statuses."""
        nonlocal frame
        msg = TwistStamped()
        msg.twist.linear.x = speed
        assert wait_for(lambda: odom.publish(msg) or node.speed.speed() == speed, 10.0)
        n = len(statuses)
        end = time.monotonic() + 30.0
        while len(statuses) < n + 2 and time.monotonic() < end:
            cam.publish(image_msg(3000 + frame, size=32))
            frame += 1
            time.sleep(0.02)
        return statuses[n:]
    try:
        assert wait_for(lambda: cam.get_subscription_count() > 0, 10.0)
        for speed, want in ((5.0, 40.0), (20.0, 10.0)):
            assert batch_deadline_ms(cfg, 2, speed) == pytest.approx(want)
            got = drive(speed)
            assert len(got) >= 2, f"no statuses at {speed} m/s"
            assert [s.deadline_ms for s in got[-1:]] == [pytest.approx(want, rel=1e-6)]
            assert 0.0 <= got[-1].budget_ms <= want  # what was left of it for the update
    finally:
        spun.close()
