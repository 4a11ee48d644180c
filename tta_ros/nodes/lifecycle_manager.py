"""lifecycle_manager node: brings the managed tta nodes up and down through their standard
lifecycle services (`<node>/change_state`, `<node>/get_state`), as Nav2's lifecycle manager.

`ros2 launch tta_ros vehicle.launch.py` starts the three nodes unconfigured (`--managed`)
and this node beside them; with `autostart` (the launch argument, default true) it
configures every node in `node_names` order (resource_monitor, scheduler, perception),
then activates them in the same order. A node whose configure fails (a bad model card)
stays unconfigured and logs why in one line; the manager stops there, names the node and
the transition on /diagnostics (ERROR) and leaves the others as they are.

Services (std_srvs/Trigger; each answers once every node is where it should be, or names
the first that is not):
- `~/startup`: configure and activate every node (a node already there is skipped);
- `~/pause`: deactivate them, in reverse order (nothing served; models stay loaded);
- `~/resume`: activate them again;
- `~/reset`: deactivate and clean them up, in reverse order (models and device memory
  freed; `~/startup` loads them again);
- `~/shutdown`: shut every node down, in reverse order (finalized: they end with their
  process).

The transitions run on a thread of the manager's own, through a client node spun by an
executor of its own, so the node's executor never waits on a response; composed in one
process with the nodes it manages, give the manager an executor of its own (its Trigger
callbacks wait for the transitions, which the managed nodes' executor serves).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import rclpy
from diagnostic_msgs.msg import DiagnosticStatus
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rclpy.client import Client
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter
from std_srvs.srv import Trigger

from tta_ros.diagnostics import ERROR, HARDWARE_ID, OK, DiagnosticsPublisher, status
from tta_ros.launch_params import NODES
from tta_ros.ros_params import ParamSpec, declare_checked, report_unknown, validate
from tta_ros.spinning import SpinThread

PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("node_names", [name for name, _ in NODES], "the managed nodes, in bring-up "
              "order (relative names: in this node's namespace)", read_only=True),
    ParamSpec("autostart", True, "configure and activate every node at start (false: wait "
              "for ~/startup or `ros2 lifecycle set`)", read_only=True),
    ParamSpec("service_timeout_s", 60.0, "how long to wait for a node's lifecycle services "
              "(its process starting)", 0.1, 3600.0, read_only=True),
    ParamSpec("transition_timeout_s", 300.0, "the longest a transition may take (perception's "
              "configure loads and warms up the model)", 0.1, 3600.0, read_only=True),
    HARDWARE_ID,
)

#: shutdown's transition id from each state
SHUTDOWN_FROM = {"unconfigured": Transition.TRANSITION_UNCONFIGURED_SHUTDOWN,
                 "inactive": Transition.TRANSITION_INACTIVE_SHUTDOWN,
                 "active": Transition.TRANSITION_ACTIVE_SHUTDOWN}
#: transition -> (its id from each state it starts from, its goal state)
TRANSITIONS: dict[str, tuple[dict[str, int], str]] = {
    "configure": ({"unconfigured": Transition.TRANSITION_CONFIGURE}, "inactive"),
    "activate": ({"inactive": Transition.TRANSITION_ACTIVATE}, "active"),
    "deactivate": ({"active": Transition.TRANSITION_DEACTIVATE}, "inactive"),
    "cleanup": ({"inactive": Transition.TRANSITION_CLEANUP}, "unconfigured"),
    "shutdown": (SHUTDOWN_FROM, "finalized"),
}
#: the states a transition has nothing left to do in
DONE = {"configure": ("inactive", "active"), "activate": ("active",),
        "deactivate": ("inactive", "unconfigured"), "cleanup": ("unconfigured",),
        "shutdown": ("finalized",)}
#: command -> its transitions, each over the nodes in order (True) or in reverse (False)
COMMANDS: dict[str, tuple[tuple[str, bool], ...]] = {
    "startup": (("configure", True), ("activate", True)),
    "pause": (("deactivate", False),),
    "resume": (("activate", True),),
    "reset": (("deactivate", False), ("cleanup", False)),
    "shutdown": (("shutdown", False),),
}


@dataclass
class _Request:
    command: str
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""


class LifecycleManagerNode(Node):
    """Drives the managed nodes' transitions (module docstring)."""

    def __init__(self, node_name: str = "lifecycle_manager", *,
                 context: Context | None = None,
                 parameter_overrides: Sequence[Parameter] | None = None,
                 cli_args: Sequence[str] | None = None) -> None:
        super().__init__(node_name, context=context, parameter_overrides=parameter_overrides,
                         cli_args=list(cli_args) if cli_args else None,
                         automatically_declare_parameters_from_overrides=True)  # start_values
        self.p = declare_checked(self, PARAMS)
        report_unknown(self)
        self.add_on_set_parameters_callback(lambda ps: validate(PARAMS, ps))
        self.names = [n.strip("/") for n in self.p["node_names"] if n.strip("/")]
        self.states = dict.fromkeys(self.names, "unknown")  # as last seen
        self.error = ""  # the failure of the last command ('' when it succeeded)
        self.last_command = ""
        self.diag = DiagnosticsPublisher(self)
        # the clients on a node and executor of their own (module docstring: why)
        client_node = rclpy.create_node(f"{node_name}_clients", context=self.context,
                                        namespace=self.get_namespace(),
                                        use_global_arguments=False,
                                        start_parameter_services=False)
        self._client_node = client_node
        self._change: dict[str, Client] = {
            n: client_node.create_client(ChangeState, f"{n}/change_state") for n in self.names}
        self._get: dict[str, Client] = {
            n: client_node.create_client(GetState, f"{n}/get_state") for n in self.names}
        executor = SingleThreadedExecutor(context=self.context)
        executor.add_node(client_node)
        self._spin = SpinThread(executor, name="lifecycle-clients")
        self._requests: queue.Queue[_Request] = queue.Queue()
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._run, name="lifecycle-manager",
                                        daemon=True)
        self._worker.start()
        for command in COMMANDS:
            self.create_service(Trigger, f"~/{command}",
                                lambda _req, resp, c=command: self._serve(c, resp))
        self.create_timer(1.0, self._publish_diagnostics)
        if self.p["autostart"]:
            self.request("startup")

    # ------------------------------------------------------------ commands
    def request(self, command: str) -> _Request:
        """Queue `command` (COMMANDS) for the manager's thread; its request, `done` once
        it ran (`error`: '' on success)."""
        if command not in COMMANDS:
            raise ValueError(f"unknown command {command!r}; known: {sorted(COMMANDS)}")
        req = _Request(command)
        self._requests.put(req)
        return req

    def _serve(self, command: str, response: Trigger.Response) -> Trigger.Response:
        req = self.request(command)
        limit = self.p["transition_timeout_s"] * len(self.names) * len(COMMANDS[command]) \
            + self.p["service_timeout_s"]
        if not req.done.wait(limit):
            response.success, response.message = False, f"{command}: not done in {limit:g} s"
            return response
        response.success = not req.error
        response.message = req.error or f"{command}: {self._summary()}"
        return response

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                req = self._requests.get(timeout=0.1)
            except queue.Empty:
                continue
            req.error = self._execute(req.command)
            req.done.set()

    def _execute(self, command: str) -> str:
        """Every transition of `command` over the nodes; '' or the first failure."""
        self.last_command = command
        for transition, forward in COMMANDS[command]:
            for name in (self.names if forward else self.names[::-1]):
                if self._stop.is_set():
                    return f"{command}: the manager stopped"
                if error := self._transition(name, transition):
                    self.error = f"{command}: {error}"
                    self.get_logger().error(self.error)
                    self._publish_diagnostics()
                    return self.error
        self.error = ""
        self.get_logger().info(f"{command}: {self._summary()}")
        self._publish_diagnostics()
        return ""

    def _transition(self, name: str, transition: str) -> str:
        """Take `name` through `transition` unless it is done already; '' or why not."""
        state = self._state(name)
        if state is None:
            return (f"{name}: no lifecycle services ({self._get[name].srv_name}) within "
                    f"{self.p['service_timeout_s']:g} s")
        if state in DONE[transition]:
            return ""
        ids, goal = TRANSITIONS[transition]
        if state not in ids:
            return f"{name} is {state}: it cannot {transition}"
        tid = ids[state]
        resp = self._call(self._change[name], ChangeState.Request(transition=Transition(id=tid)))
        if resp is None:
            return (f"{name}: {transition} not answered within "
                    f"{self.p['transition_timeout_s']:g} s")
        if not resp.success:
            self._state(name)
            return f"{name}: {transition} failed (the node's log says why)"
        self.states[name] = goal
        return ""

    def _state(self, name: str) -> str | None:
        """The node's current state label (None: no answer), remembered."""
        client = self._get[name]
        if not client.wait_for_service(timeout_sec=self.p["service_timeout_s"]):
            return None
        resp = self._call(client, GetState.Request())
        if resp is None:
            return None
        self.states[name] = resp.current_state.label
        return self.states[name]

    def _call(self, client: Client, request: object) -> object | None:
        """`request` on `client` (spun on the clients' executor); its response, or None
        when none came within transition_timeout_s."""
        answered = threading.Event()
        future = client.call_async(request)
        future.add_done_callback(lambda _f: answered.set())
        if not answered.wait(self.p["transition_timeout_s"]):
            future.cancel()
            return None
        return future.result()

    # ------------------------------------------------------------ reporting
    def _summary(self) -> str:
        return ", ".join(f"{n} {s}" for n, s in self.states.items())

    def lifecycle_status(self) -> DiagnosticStatus:
        """`lifecycle`: ERROR naming the failed transition, else OK with each node's state."""
        return status("lifecycle", ERROR if self.error else OK,
                      self.error or self._summary() or "no nodes to manage",
                      {"command": self.last_command or "-", **self.states})

    def _publish_diagnostics(self) -> None:
        self.diag.publish([self.lifecycle_status()])

    def destroy_node(self) -> None:
        """Stop the manager's thread and its clients' executor, then destroy both nodes
        (the managed nodes stay as they are)."""
        self._stop.set()
        self._worker.join(timeout=5.0)
        self._spin.stop(timeout_s=5.0)
        self._client_node.destroy_node()
        super().destroy_node()


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: `lifecycle_manager --ros-args -p autostart:=true`."""
    from tta_ros.bringup import node_main

    return node_main(LifecycleManagerNode, argv, prog="lifecycle_manager")


if __name__ == "__main__":
    sys.exit(main())
