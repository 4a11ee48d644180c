"""One plan contract between the scheduler and perception, over real rclpy + DDS.

Every kind of LayerPlan the scheduler produces — a normal plan (units updated), an empty
one (no unit fits a budget > 0), a forward miss (the forward alone over the deadline) and a
zero budget (a deadline the forward's time and scatter margin fill: budget_ms = sigma = 0)
— goes from a real SchedulerNode over DDS to a real PerceptionNode, whose checks
(plausibility.check_plan, then convert.check_plan) must take every one: 0 refused. Then
both nodes run at a fixed deadline below the forward's time on a stream of frames: no plan
is refused and, once the first plan was followed, no batch falls back to inline planning
(a refused zero-budget plan used to leave perception without a plan until the topic went
stale).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

rclpy = pytest.importorskip("rclpy")
from helpers import CARD, wait_for  # noqa: E402
from helpers.ros import Rig, image_msg  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from tta_msgs.msg import AdaptationStatus, LayerImportance, LayerPlan  # noqa: E402

from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.perception import PerceptionNode  # noqa: E402
from tta_ros.nodes.scheduler import SchedulerNode  # noqa: E402

FORWARD_MS = 5.0
MISS_FORWARD_MS = 20.0  # against a 5 ms deadline: the forward alone misses it
RELIABLE = QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE)


class _Link:
    """A scheduler and a perception node, and a probe standing in for perception's
    importance and status (perception gets no frames, so it sends neither itself): every
    plan goes scheduler -> DDS -> perception's plan callback, and to the probe."""

    def __init__(self, ctx) -> None:
        # deadline_from '': the test sets the scheduler's own sigma and deadline directly
        self.sched = activate(SchedulerNode(context=ctx, parameter_overrides=[
            Parameter("model_card", value=str(CARD)), Parameter("sigma", value=0.33),
            Parameter("deadline_from", value="")]))
        self.per = activate(PerceptionNode(context=ctx, parameter_overrides=[
            Parameter(k, value=v) for k, v in {
                "model_card": str(CARD), "batch_size": 4, "num_threads": 1,
                "plan_source": "topic", "feed_timeout_s": 60.0}.items()]))
        self.probe = rclpy.create_node("fake_perception", context=ctx)
        self.plans: list[LayerPlan] = []
        self.probe.create_subscription(LayerPlan, "layer_plan", self.plans.append, RELIABLE)
        self.pub_imp = self.probe.create_publisher(LayerImportance, "layer_importance",
                                                   RELIABLE)
        self.pub_status = self.probe.create_publisher(AdaptationStatus, "adaptation_status",
                                                      RELIABLE)
        self.ex = SingleThreadedExecutor(context=ctx)
        for nd in (self.sched, self.per, self.probe):
            self.ex.add_node(nd)
        self.batch = 0

    def spin_until(self, done: Callable[[], bool], act: Callable[[], None] | None = None,
                   timeout: float = 20.0) -> bool:
        end = time.monotonic() + timeout
        while not done() and time.monotonic() < end:
            if act is not None:
                act()
            self.ex.spin_once(timeout_sec=0.05)
        return done()

    def plan(self, forward_ms: float) -> LayerPlan:
        """The scheduler's plan for one importance message of perception's units, once
        perception has taken (or refused) it."""
        self.batch += 1
        imp = LayerImportance(batch_id=self.batch, model_name=self.per.model_name,
                              unit_names=list(self.per.unit_names),
                              importance=[1.0] * len(self.per.unit_names),
                              forward_ms=forward_ms, batch_size=4)
        seen = self.per.refusals.total

        def answered() -> bool:
            mine = [p for p in self.plans if p.based_on_batch_id == imp.batch_id]
            gate = self.per.planning.gate.plan
            return bool(mine) and (self.per.refusals.total > seen or (
                gate is not None and gate[0] == mine[0].plan_id))

        def send() -> None:
            if self.pub_imp.get_subscription_count() > 0:
                self.pub_imp.publish(imp)
        assert self.spin_until(answered, send), f"no plan for batch {imp.batch_id}"
        return next(p for p in self.plans if p.based_on_batch_id == imp.batch_id)

    def scatter(self, plan: LayerPlan, total_ms: float) -> None:
        """Perception's status for `plan`: the batch took `total_ms` (the scheduler learns
        its deadline margin from what the batches took against their plans)."""
        self.pub_status.publish(AdaptationStatus(
            plan_id=plan.plan_id, forward_ms=MISS_FORWARD_MS, total_ms=total_ms,
            mode="sequential", adapted=False, budget_ms=plan.budget_ms))
        self.spin_until(lambda: False, timeout=0.2)

    def set(self, **params: object) -> None:
        res = self.sched.set_parameters([Parameter(k, value=v) for k, v in params.items()])
        assert all(r.successful for r in res), res

    def close(self) -> None:
        self.ex.shutdown()
        for nd in (self.per, self.sched, self.probe):
            nd.destroy_node()


def test_every_kind_of_plan_the_scheduler_makes_passes_perception_checks(ros_context):
    link = _Link(ros_context)
    kinds: dict[str, LayerPlan] = {}
    try:
        kinds["normal"] = link.plan(FORWARD_MS)
        link.set(sigma=0.02)
        kinds["empty"] = link.plan(FORWARD_MS)
        refused_sigma = link.sched.set_parameters([Parameter("sigma", value=0.0)])[0]
        link.set(sigma=0.33, deadline_mode="fixed", deadline_ms=5.0)
        kinds["forward miss"] = link.plan(MISS_FORWARD_MS)
        for _ in range(4):  # batches far over their plans: a margin as long as the deadline
            link.scatter(link.plan(MISS_FORWARD_MS), total_ms=4 * MISS_FORWARD_MS)
        kinds["zero budget"] = link.plan(MISS_FORWARD_MS)
        refused = dict(link.per.refusals.counts)
        followed = link.per.planning.gate.plan
    finally:
        link.close()
    normal, empty = kinds["normal"], kinds["empty"]
    assert any(normal.update) and normal.sigma == pytest.approx(0.33)
    assert not any(empty.update) and 0 < empty.sigma < 0.33 and empty.budget_ms > 0
    zero = kinds["zero budget"]
    assert zero.sigma == 0.0 and zero.budget_ms == 0.0 and not any(zero.update)
    assert zero.first_updated_index == len(zero.unit_names)
    miss = kinds["forward miss"]
    assert not any(miss.update) and miss.budget_ms == pytest.approx(5.0) and 0 < miss.sigma
    assert refused == {}, refused  # every kind taken: none refused
    assert followed is not None and followed[0] == zero.plan_id
    assert not followed[1].update.any()  # a zero budget serves only
    # sigma*T has no zero budget: sigma = 0 would plan nothing ever, refused as a parameter
    assert not refused_sigma.successful and "sigma=0.0 outside (0, 1]" in refused_sigma.reason


def test_a_deadline_below_the_forward_plans_nothing_inline_after_a_refusal(ros_context):
    """Both nodes at a fixed deadline no forward meets (plans of a zero budget once the
    scheduler has learnt the batches' scatter): perception refuses no plan and, after it
    followed the first one, plans no batch inline."""
    deadline = {"deadline_mode": "fixed", "deadline_ms": 0.05}
    rig = Rig(ros_context, perception={
        "feed_timeout_s": 2.0, **{f"method.{k}": v for k, v in deadline.items()}},
        scheduler=deadline)
    try:
        for i in range(300):
            rig.pub.publish(image_msg(2000 + i))
            time.sleep(0.015)
            if i > 120 and any(p.sigma == 0.0 for p in rig.msgs("plan")) and len(
                    rig.msgs("status")) > 60:
                break
        assert wait_for(lambda: rig.perception.queue.received > 0
                        and len(rig.perception.queue) == 0, 20.0)
        time.sleep(0.3)  # the last batch's status
        statuses = rig.msgs("status")
        plans = rig.msgs("plan")
        refused = dict(rig.perception.refusals.counts)
        per = rig.perception
        errors = (per.counters.step_errors, per.counters.last_error)
    finally:
        rig.close()
    assert any(p.sigma == 0.0 and p.budget_ms == 0.0 for p in plans), \
        [(p.sigma, p.budget_ms) for p in plans[-5:]]
    assert refused.get("LayerPlan", 0) == 0, (refused, per.refusals.last)
    first = next(i for i, s in enumerate(statuses) if s.plan_id != 0)
    inline_after = [s.batch_id for s in statuses[first:] if s.plan_id == 0]
    assert inline_after == [], f"{len(inline_after)} of {len(statuses) - first} batches " \
        "planned inline after the first plan was followed"
    assert not any(s.adapted for s in statuses[first:])  # nothing fits: served only
    assert errors == (0, ""), errors  # a zero-budget plan steps like any other
