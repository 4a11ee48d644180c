"""Helpers shared by the test tiers (importable as `helpers`: pytest.ini has `pythonpath = test`).

This package root and `helpers.models` never import rclpy, so test/unit can use them;
`helpers.ros` (messages, the node rig) is for test/ros only."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]  # the checkout
CONFIG = ROOT / "config" / "vehicle.yaml"
CARD = ROOT / "checkpoints" / "small_resnet_signs32.json"  # the shipped default model card


def wait_for(cond: Callable[[], bool], timeout: float, tick: Callable[[], None] | None = None,
             poll: float = 0.02) -> bool:
    """Poll `cond` (calling `tick` first each round) until true or `timeout` s; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if tick is not None:
            tick()
        if cond():
            return True
        time.sleep(poll)
    return cond()


def fake_image(**fields: object) -> SimpleNamespace:
    """A duck-typed sensor_msgs Image (no ROS): `fields`, little-endian unless they say."""
    return SimpleNamespace(**{"is_bigendian": 0, **fields})
