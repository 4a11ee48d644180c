"""tta_ros.spinning.SpinThread over real rclpy: stopping waits for the callback that runs,
then shuts the executor down; the spin thread never dies on a destroyed guard condition."""

from __future__ import annotations

import threading

import pytest

rclpy = pytest.importorskip("rclpy")
from helpers import wait_for  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402

from tta_ros.spinning import SpinThread  # noqa: E402


def _spun(ctx, name: str, callback) -> tuple:
    """A node whose 10 ms timer runs `callback`, spun by a SpinThread."""
    node = rclpy.create_node(name, context=ctx)
    node.create_timer(0.01, callback)
    ex = SingleThreadedExecutor(context=ctx)
    ex.add_node(node)
    return node, SpinThread(ex)


def test_stop_waits_for_the_running_callback_then_shuts_down(ros_context, monkeypatch) -> None:
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    entered, release, order = threading.Event(), threading.Event(), []

    def slow() -> None:  # the first call blocks until the test releases it
        if not entered.is_set():
            entered.set()
            assert release.wait(60.0)
            order.append("callback done")

    node, spin = _spun(ros_context, "spin_probe", slow)
    try:
        assert entered.wait(30.0)
        stopper = threading.Thread(target=lambda: order.append(("stopped", spin.stop())))
        stopper.start()
        assert wait_for(spin._stop.is_set, 10.0)  # stop() called under the running callback
        assert stopper.is_alive()  # ... and waits for it
        release.set()
        stopper.join(60.0)
        assert order == ["callback done", ("stopped", True)]
        assert not spin.thread.is_alive()
    finally:
        release.set()
        spin.stop()
        node.destroy_node()
    assert errors == []


def test_stop_with_a_timeout_reports_a_callback_still_running(ros_context) -> None:
    entered, release = threading.Event(), threading.Event()

    def hung() -> None:
        entered.set()
        release.wait(60.0)

    node, spin = _spun(ros_context, "spin_probe_hung", hung)
    try:
        assert entered.wait(30.0)
        assert spin.stop(timeout_s=0.05) is False  # the callback holds it: executor left up
    finally:
        release.set()
        assert spin.stop() is True
        node.destroy_node()


def test_spin_thread_refuses_a_bad_poll(ros_context) -> None:
    ex = SingleThreadedExecutor(context=ros_context)
    with pytest.raises(ValueError, match="poll_s must be > 0, got 0"):
        SpinThread(ex, poll_s=0)
    ex.shutdown()
