"""Shared fixtures: an isolated rclpy context per test (its own ROS domain), so ROS tests
run over real DDS without hearing each other or other processes on the machine.

Tiers: every test file lives in test/unit, test/ros or test/system, and gets that marker
(`pytest -m unit`); a test marked `cuda` is skipped where torch sees no CUDA device;
shared helpers are the `helpers` package (pytest.ini: pythonpath = test)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

TIERS = ("unit", "ros", "system")
HERE = Path(__file__).parent


def _tier(path: Path) -> str | None:
    """The tier of a test file: its top folder under test/ ("" if not a tier), None when
    outside test/ (paths through a symlinked test/, as in ros_package, included)."""
    for base in {HERE, HERE.resolve()}:
        for p in {path, path.resolve()}:
            if base in p.parents:
                top = p.relative_to(base).parts[0]
                return top if top in TIERS else ""
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier; a test file in test/ but outside the tiers is an error."""
    for item in items:
        tier = _tier(item.path)
        if tier == "":
            raise pytest.UsageError(f"{item.path}: test files go in test/unit, test/ros or "
                                    "test/system")
        if tier:
            item.add_marker(tier)
        if item.get_closest_marker("cuda") and not _cuda_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def _cuda_available() -> bool:
    """Whether torch sees a CUDA device (torch imported only when a `cuda` test is collected)."""
    import torch

    return torch.cuda.is_available()


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
