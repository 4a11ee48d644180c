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


@pytest.fixture
def one_thread():
    """One intra-op torch thread for the test: on a shared 2-core machine OpenMP spinning
    costs 10-100x (memory and SURGEON tests)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
