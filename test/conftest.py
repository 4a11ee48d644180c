"""Shared fixtures: an isolated rclpy context per test (its own ROS domain), so ROS tests
run over real DDS without hearing each other or other processes on the machine."""

from __future__ import annotations

import random

import pytest


@pytest.fixture
def ros_context():
    """A fresh rclpy Context on a random ROS domain id; shut down after the test."""
    import rclpy

    ctx = rclpy.context.Context()
    rclpy.init(context=ctx, domain_id=random.randint(1, 200))
    try:
        yield ctx
    finally:
        ctx.try_shutdown()
