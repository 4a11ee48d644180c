"""Managed (lifecycle) nodes: the state machine the three tta nodes share, and bringing one
up in-process.

The nodes are rclpy `LifecycleNode`s (ROS 2 managed nodes, as Nav2's), driven through the
standard `<node>/change_state` and `<node>/get_state` services (`ros2 lifecycle set
/perception configure`), by tta_ros.nodes.lifecycle_manager under `ros2 launch`, or in
process by `activate` (tta_ros.bringup, the tests, `tta demo`):

    unconfigured --configure--> inactive --activate--> active
    active --deactivate--> inactive --cleanup--> unconfigured;   shutdown from any state

- constructor: the node's parameters are declared (so `ros2 param` works on an
  unconfigured node) with their callbacks; nothing else is created, nothing is loaded.
- configure (`_configure`): the parameter values are read and checked, models and files
  loaded, publishers, subscriptions, timers and services created. Every entity created
  here is recorded and destroyed again by cleanup; timers created here run only while the
  node is active. A configure that raises fails the transition (the node stays
  unconfigured): its error is logged in one line and kept in `transition_error`.
- activate (`_activate`): lifecycle publishers enabled, timers started, then the node
  starts serving (`serving` is True from here).
- deactivate (`_deactivate`): the node stops serving first (`serving` False, timers
  stopped), then its lifecycle publishers are disabled; what configure loaded stays.
- cleanup (`_cleanup`): what configure loaded is freed (models, device memory), then the
  recorded entities are destroyed; the node can be configured again.
- shutdown: deactivate and cleanup as far as the state needs; destroy_node does the same.

Subscription callbacks check `serving` where a message would make the node publish or
learn; the perception node takes no frames at all while inactive (no image subscription).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.lifecycle.publisher import LifecyclePublisher

from tta_core.errors import one_line
from tta_core.runtime.device import release_memory

SUCCESS = TransitionCallbackReturn.SUCCESS
FAILURE = TransitionCallbackReturn.FAILURE
#: the kinds of node entity configure records (Node properties; destroy_<kind>)
_KINDS = ("publishers", "subscriptions", "timers", "services", "clients")


class TransitionFailed(RuntimeError):
    """A transition a caller asked for did not succeed (and raised nothing to re-raise)."""


def _entities(node: LifecycleNode) -> dict[str, list[Any]]:
    """The node's entities by kind (public Node properties)."""
    return {kind: list(getattr(node, kind)) for kind in _KINDS}


class ManagedNode(LifecycleNode):
    """A LifecycleNode whose subclasses fill in `_configure`, `_activate`, `_deactivate`
    and `_cleanup` (module docstring: what each transition does around them)."""

    def __init__(self, node_name: str, **kwargs: Any) -> None:
        self.transition_error: BaseException | None = None  # of the last failed transition
        self.log_transition_errors = True  # activate() raises them instead
        self.serving = False  # active, and serving
        self.finalized = False
        self._owned: dict[str, list[Any]] | None = None  # configure's entities; None: not
        super().__init__(node_name, **kwargs)

    # ------------------------------------------------------------ subclass hooks
    def _configure(self) -> None:
        """Read the parameters, load, create publishers / subscriptions / timers."""

    def _activate(self) -> None:
        """Start serving (publishers are enabled and `serving` is True already)."""

    def _deactivate(self) -> None:
        """Stop serving (`serving` is False already; publishers still enabled)."""

    def _cleanup(self) -> None:
        """Free what `_configure` loaded (its entities are destroyed afterwards)."""

    # ------------------------------------------------------------ state
    @property
    def configured(self) -> bool:
        """Inactive or active."""
        return self._owned is not None

    @property
    def lifecycle_state(self) -> str:
        """unconfigured, inactive, active or finalized (the label get_state reports)."""
        if self.finalized:
            return "finalized"
        return "active" if self.serving else "inactive" if self.configured else "unconfigured"

    # ------------------------------------------------------------ transitions
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        before = {kind: set(map(id, items)) for kind, items in _entities(self).items()}
        self.transition_error = None
        try:
            self._configure()
        except Exception as exc:  # a bad model card, file or parameter: stay unconfigured
            self._owned = self._new_entities(before)
            self._failed("configure", exc)
            self._release(self._cleanup)
            return FAILURE
        self._owned = self._new_entities(before)
        for timer in self._owned["timers"]:
            timer.cancel()  # run only while active
        return super().on_configure(state)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        ret = super().on_activate(state)  # lifecycle publishers enabled
        if ret != SUCCESS:
            return ret
        self.transition_error = None
        self.serving = True
        try:
            self._activate()
        except Exception as exc:
            self._failed("activate", exc)
            self._stop_serving()
            super().on_deactivate(state)
            return FAILURE
        for timer in self._owned["timers"] if self._owned else ():
            timer.reset()
        return SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_serving()
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release(self._cleanup)
        return super().on_cleanup(state)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._shut_down()
        return super().on_shutdown(state)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """A transition raised past its hook: free everything, back to unconfigured."""
        self._shut_down(finalize=False)
        return SUCCESS

    def destroy_node(self) -> None:
        """Stop serving and free what configure loaded (any state), then destroy the node
        and its state machine."""
        try:
            self._shut_down()
        finally:
            super().destroy_node()
            # rclpy's LifecycleNode leaves its state machine, which holds the rcl node, to
            # the garbage collector: the node (and its /rosout logger, which rcl keys by
            # name) would live on and, once collected, unregister the logger of a newer
            # node of the same name
            self._state_machine.destroy_when_not_in_use()

    # ------------------------------------------------------------ helpers
    def _new_entities(self, before: dict[str, set[int]]) -> dict[str, list[Any]]:
        return {kind: [e for e in items if id(e) not in before[kind]]
                for kind, items in _entities(self).items()}

    def _failed(self, transition: str, exc: BaseException) -> None:
        self.transition_error = exc
        if self.log_transition_errors:
            self.get_logger().error(f"{transition} failed: {one_line(exc)}")

    def _stop_serving(self) -> None:
        if not self.serving:
            return
        self.serving = False
        for timer in self._owned["timers"] if self._owned else ():
            timer.cancel()
        self._deactivate()

    def _release(self, free: Callable[[], None]) -> None:
        """`free()`, destroy the entities configure created (their callbacks may hold what
        it loaded), then hand the memory back (release_memory: frozen cycles collected,
        CUDA's cache on the node's `device`, the heap's free pages)."""
        owned, self._owned = self._owned, None
        try:
            free()
        finally:
            self._destroy(owned or {})
            owned = None
            release_memory(getattr(self, "device", None))

    def _destroy(self, owned: dict[str, list[Any]]) -> None:
        for kind, items in owned.items():
            for entity in items:
                if kind == "publishers" and isinstance(entity, LifecyclePublisher):
                    self.destroy_lifecycle_publisher(entity)
                else:
                    getattr(self, f"destroy_{kind[:-1]}")(entity)

    def _shut_down(self, finalize: bool = True) -> None:
        """Deactivate and clean up as far as the state needs (shutdown, destroy_node)."""
        if self.finalized:
            return
        try:
            if self.serving:
                self._stop_serving()
                super().on_deactivate(LifecycleState("active", 3))
            if self.configured:
                self._release(self._cleanup)
        finally:
            self.finalized = finalize


def _trigger(node: ManagedNode, transition: str) -> ManagedNode:
    """Take `transition` (configure, activate) in process; a failure raises the error of
    the hook (not logged by the node) or TransitionFailed."""
    node.log_transition_errors = False
    try:
        ret = getattr(node, f"trigger_{transition}")()
    finally:
        node.log_transition_errors = True
    if ret != SUCCESS:
        raise node.transition_error or TransitionFailed(
            f"{node.get_name()}: {transition} failed from state {node.lifecycle_state}")
    return node


def configure(node: ManagedNode) -> ManagedNode:
    """Configure `node` in process; a failed configure raises its own error (a bad model
    card: the ValueError naming it), not logged by the node."""
    return _trigger(node, "configure")


def activate(node: ManagedNode) -> ManagedNode:
    """Bring `node` to active in process (configure first when unconfigured), as the
    nodes were before they were managed; the error of a failed transition is raised."""
    if not node.configured:
        configure(node)
    return node if node.serving else _trigger(node, "activate")
