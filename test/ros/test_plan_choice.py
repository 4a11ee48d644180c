"""The perception node's plan choice (tta_ros.nodes.plan_choice) without a node: which plan
a batch follows, stale plans, refused plans and what the planning status says."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("rclpy")
from diagnostic_msgs.msg import DiagnosticStatus
from tta_msgs.msg import LayerPlan

from tta_ros.nodes.deadline_wiring import BatchDeadline
from tta_ros.nodes.method_params import MethodOptions
from tta_ros.nodes.plan_choice import PlanChoice
from tta_ros.nodes.plausibility import Bounds, Refusals

NAMES = ["u0", "u1", "u2"]
WARN, OK = DiagnosticStatus.WARN, DiagnosticStatus.OK


class _Planned:
    """What PlanChoice needs of a TakesPlan method."""

    unit_names = NAMES
    trainable = np.array([False, True, True])

    def step(self, x, plan=None):  # pragma: no cover - never stepped here
        raise AssertionError


def _plan(plan_id: int, update: list[bool], model: str = "m") -> LayerPlan:
    first = update.index(True) if any(update) else len(update)
    return LayerPlan(plan_id=plan_id, model_name=model, unit_names=NAMES, update=update,
                     first_updated_index=first, sigma=0.5, budget_ms=5.0)


def _choice(source: str = "topic") -> tuple[PlanChoice, list[tuple[int, str]]]:
    said: list[tuple[int, str]] = []
    choice = PlanChoice(0.5, source, "m", Bounds(), Refusals(lambda _line: None),
                        lambda level, text: said.append((level, text)))
    choice.accepts = True
    return choice, said


def _result(no_room: str = "") -> SimpleNamespace:
    return SimpleNamespace(planning=SimpleNamespace(no_room=no_room))


def test_plans_apply_go_stale_and_resume() -> None:
    choice, said = _choice()
    opts = MethodOptions("adashadow")
    assert choice.choose(opts) == (0, None)  # no plan yet: inline, nothing stale
    choice.take(_plan(7, [False, True, False]), _Planned(), NAMES)
    plan_id, plan = choice.choose(opts)
    assert plan_id == 7 and list(plan.update) == [False, True, False]
    choice.gate.on_importance_sent(now=0.0)  # unanswered for longer than 0.5 s
    assert choice.choose(opts) == (0, None) and choice.fallback
    assert said[-1][0] == WARN and "planning inline" in said[-1][1]
    assert choice.status(opts, {}).level == WARN
    choice.take(_plan(8, [False, False, True]), _Planned(), NAMES)
    assert not choice.fallback and said[-1] == (OK, "plans resumed on layer_plan (plan 8)")
    assert choice.choose(opts)[0] == 8 and choice.status(opts, {}).level == OK


def test_a_plan_for_untrainable_units_is_refused_and_the_last_one_serves() -> None:
    choice, said = _choice()
    choice.take(_plan(1, [False, True, False]), _Planned(), NAMES)
    choice.take(_plan(2, [True, False, False]), _Planned(), NAMES)  # u0 is not trainable
    assert choice.refusals.counts == {"LayerPlan": 1}
    assert said[-1][0] == WARN and said[-1][1].startswith("plan 2 ignored:")
    assert choice.choose(MethodOptions("adashadow"))[0] == 1
    choice.take(_plan(3, [False, True, False], model="other"), _Planned(), NAMES)
    assert choice.refusals.counts == {"LayerPlan": 2}


def test_inline_source_and_plan_free_methods_plan_inline() -> None:
    opts = MethodOptions("adashadow")
    inline, _ = _choice("inline")
    inline.take(_plan(1, [False, True, False]), _Planned(), NAMES)
    assert inline.choose(opts) == (0, None)
    assert inline.message(opts) == "planning inline (plan_source: inline)"
    tent, _ = _choice()
    tent.accepts = False
    assert tent.choose(opts) == (0, None)
    assert tent.message(MethodOptions("tent")) == "method tent plans nothing"


def test_no_room_is_announced_once_and_batches_are_counted_by_source() -> None:
    choice, said = _choice("inline")
    opts = MethodOptions("adashadow")
    for _ in range(2):
        choice.after_step(_result("the forward alone takes the budget"), opts, False)
    assert len(said) == 1 and said[0][0] == WARN
    assert said[0][1].startswith(f"sigma={opts.get('sigma'):g}: the forward alone")
    choice.after_step(_result(), opts, True)
    assert choice.status(opts, {}).level == OK
    assert (choice.topic_batches, choice.inline_batches) == (1, 2)


def test_batch_deadline_follows_the_method_and_the_speed() -> None:
    from tta_core.runtime.deadline import DeadlineConfig

    speed = SimpleNamespace(value=None, speed=lambda: speed.value,
                            describe=lambda: "no odometry")
    deadline = BatchDeadline(speed, lambda: 3.0)
    assert math.isnan(deadline.batch_ms(SimpleNamespace(), 4))  # no deadline settings
    fixed = SimpleNamespace(config=DeadlineConfig("fixed", deadline_ms=10.0,
                                                  deadline_per="frame"))
    assert deadline.batch_ms(fixed, 4) == pytest.approx(40.0)
    assert deadline.status_values("fixed") == {}
    assert deadline.status_values("speed") == {"speed": "no odometry"}
    speed.value = 7.5
    assert deadline.status_values("speed") == {"speed": "7.5 m/s"}
