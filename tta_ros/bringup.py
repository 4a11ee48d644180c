"""Run perception, resource_monitor and scheduler in one process (SingleThreadedExecutor).

    python -m tta_ros.bringup --config config/vehicle.yaml [--namespace /car1]
        [--image-topic /camera/image_raw] [--method tent] [--sigma 0.5]
        [--set perception.batch_size=4 --set perception.method.lr=0.01 ...]
        [--autostart false] [--ros-args --log-level debug ...]

Parameters come from a standard ROS 2 params file (`node_name: ros__parameters: {...}`),
merged per node and namespace by tta_ros.launch_params.node_parameters (`/**`, then the
node's own section, then `/ns/node`, then the overrides): the same function and so the same
values launch/vehicle.launch.py hands to the same three nodes. `build_nodes` is the
testable core.

The nodes are managed (lifecycle) nodes (tta_ros.lifecycle): bringup configures and
activates each in turn (monitor, scheduler, perception) in process, so a bad model card is
still one line and exit 1; `--autostart false` leaves them unconfigured, serving nothing,
for `ros2 lifecycle set /perception configure` and so on. Under `ros2 launch` a lifecycle
manager node does the same (tta_ros.nodes.lifecycle_manager, the `autostart` argument).

One SingleThreadedExecutor serves all callbacks: they are short (the perception worker
thread does the heavy work), and rclpy's MultiThreadedExecutor costs 3-4x more per frame
(its spin loop competes with the worker for the GIL: benchmarks/ros/bench_ros_overhead.py).

Shutdown order (`run_nodes`, `spin`): rclpy is initialised without its signal handlers,
which shut the context down the moment SIGINT/SIGTERM arrives, under a perception worker
that is still publishing. Our handlers only stop the spin loop; then every node is
destroyed (perception stops and joins its worker first) and only then is the context shut
down; then the process ends without the interpreter's teardown of torch & co (`exit_now`),
exit status 0. A signal during start-up ends it at once. Start-up errors (bad model card,
params file, parameter) are one line on stderr (TTA_DEBUG=1: the traceback).
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NoReturn

import rclpy
import yaml
from rclpy.context import Context
from rclpy.exceptions import ParameterException
from rclpy.executors import (
    Executor,
    ExternalShutdownException,
    SingleThreadedExecutor,
)
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.signals import SignalHandlerOptions

from tta_core.errors import one_line_errors
from tta_core.runtime.malloc_tuning import keep_freed_memory
from tta_ros import launch_params
from tta_ros.launch_params import (
    join_namespace,
    launch_overrides,
    node_parameters,
    parse_bool,
)
from tta_ros.lifecycle import ManagedNode, activate
from tta_ros.paths import package_file
from tta_ros.ros_params import resolve_paths

CLASSES = {"resource_monitor": "tta_ros.nodes.resource_monitor:ResourceMonitorNode",
           "scheduler": "tta_ros.nodes.scheduler:SchedulerNode",
           "perception": "tta_ros.nodes.perception:PerceptionNode"}
# (node name, console script, module:class): the names/scripts the launch file starts
NODES: tuple[tuple[str, str, str], ...] = tuple(
    (name, script, CLASSES[name]) for name, script in launch_params.NODES)
ROOT = Path(__file__).resolve().parent.parent
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SPIN_POLL_S = 0.1  # how soon the spin loop sees a stop request


def load_params(config_path: str | Path, namespace: str = "") -> dict[str, dict[str, Any]]:
    """Params file -> {node_name: {param: value}} in `namespace` (tta_ros.launch_params)."""
    return node_parameters(config_path, namespace)


def _import(spec: str) -> type:
    module, cls = spec.split(":")
    mod = __import__(module, fromlist=[cls])
    return getattr(mod, cls)


def node_cli_args(name: str, namespace: str = "", image_topic: str | None = None,
                  ) -> list[str] | None:
    """Node-local ROS arguments: the namespace, and perception's image remap."""
    rules = [f"__ns:={namespace}"] if namespace else []
    if image_topic and name == "perception":
        rules.append(f"image:={image_topic}")
    return ["--ros-args", *(a for r in rules for a in ("-r", r))] if rules else None


def build_nodes(config_path: str | Path,
                overrides: Mapping[str, Mapping[str, Any]] | None = None,
                context: Context | None = None, image_topic: str | None = None,
                base: Path = ROOT, namespace: str = "",
                own_options_only: bool = False, autostart: bool = True) -> list[Node]:
    """The three nodes in `namespace` with the parameters `node_parameters` gives (the
    params file's sections for that namespace, then `overrides[node][param]`);
    `own_options_only`: without the method.* values perception's method has no option for
    (a params file written for another method, which the node would name at WARN). Each
    node is brought to active in turn (`autostart`; tta_ros.lifecycle.activate: a failed
    configure raises its own error) or left unconfigured (`ros2 lifecycle set` drives it)."""
    namespace = join_namespace(namespace)
    params = node_parameters(config_path, namespace, overrides)
    if own_options_only:
        params["perception"] = perception_own_options(params["perception"])
    nodes: list[Node] = []
    try:
        for name, _, spec in NODES:
            p = resolve_paths(params[name], base)
            nodes.append(_import(spec)(
                name, context=context, cli_args=node_cli_args(name, namespace, image_topic),
                parameter_overrides=[Parameter(k, value=v) for k, v in p.items()]))
            if autostart:
                activate(nodes[-1])
    except Exception:
        for n in nodes:
            n.destroy_node()
        raise
    return nodes


def perception_own_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """perception's `params` without the method.* values its method (`method`, else the
    node's default) has no option for."""
    from tta_ros.nodes.method_params import own_options
    from tta_ros.nodes.perception import param_specs

    default = next(s.default for s in param_specs() if s.name == "method")
    return own_options(params, params.get("method", default))


def parse_set(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """['perception.method.sigma=0.2'] -> {'perception': {'method.sigma': 0.2}} (values
    parsed as YAML; the node name ends at the first dot)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        node, dot, param = key.partition(".")
        if not sep or not dot:
            raise ValueError(f"--set {item!r}: expected node.param=value")
        out.setdefault(node, {})[param] = yaml.safe_load(raw)
    return out


@contextmanager
def stop_on_signals(stop: threading.Event,
                    interrupt: threading.Event | None = None) -> Iterator[None]:
    """SIGINT/SIGTERM set `stop` while inside (previous handlers restored on exit), and
    raise KeyboardInterrupt while `interrupt` is set (start-up: stop at once, not after a
    model load of seconds); off the main thread, where Python cannot install handlers,
    nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(*_: object) -> None:
        stop.set()
        if interrupt is not None and interrupt.is_set():
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def spin(nodes: Sequence[Node], executor: Executor,
         stop: threading.Event | None = None) -> None:
    """Spin `nodes` on `executor` until SIGINT/SIGTERM (or `stop`), then destroy them and,
    only after that, shut rclpy down (the module docstring says why in this order)."""
    stop = stop if stop is not None else threading.Event()
    for n in nodes:
        executor.add_node(n)
        subs = sorted({s.topic_name for s in n.subscriptions} - {"/parameter_events"})
        pubs = sorted({p.topic_name for p in n.publishers} - {"/parameter_events", "/rosout"})
        state = getattr(n, "lifecycle_state", "")
        n.get_logger().info(f"ready: {state + ', ' if state else ''}subscribes "
                            f"{subs or '-'}, publishes {pubs or '-'}")
    try:
        with stop_on_signals(stop):
            while not stop.is_set() and executor.context.ok():
                executor.spin_once(timeout_sec=SPIN_POLL_S)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        for n in nodes:
            n.destroy_node()  # perception: stops and joins its publishing worker
        rclpy.try_shutdown()


def run_nodes(prog: str, build: Callable[[], Sequence[Node]],
              ros_args: Sequence[str] | None = None) -> NoReturn:
    """Init rclpy (ROS args `ros_args`, none of rclpy's signal handlers), build the nodes
    (bad input: one line on stderr naming it, exit 1), spin them until SIGINT/SIGTERM, then
    leave the process at once (`exit_now`, exit status 0); a signal during start-up ends
    it too, without waiting for the build."""
    keep_freed_memory()  # no page faults on every batch's activations (runtime.malloc_tuning)
    stop, starting = threading.Event(), threading.Event()
    starting.set()
    with stop_on_signals(stop, interrupt=starting):
        try:
            rclpy.init(args=list(ros_args) if ros_args is not None else None,
                       signal_handler_options=SignalHandlerOptions.NO)
            with one_line_errors(prog, extra=(ParameterException,)):
                nodes = build()
            starting.clear()
        except KeyboardInterrupt:
            rclpy.try_shutdown()  # also destroys a half-built node the context tracks
            exit_now(0)
        except BaseException:
            rclpy.try_shutdown()
            raise
        spin(nodes, SingleThreadedExecutor(), stop)
    exit_now(0)


def exit_now(status: int) -> NoReturn:
    """End the process after the nodes and rclpy have shut down: atexit handlers run and
    the std streams are flushed, but the interpreter's teardown of torch and the other
    extension modules (1-3 s of finalization on a small CPU) is skipped, so Ctrl-C is
    answered in well under a second (benchmarks/ros/bench_shutdown.py)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    os._exit(status)


def node_main(node_cls: Callable[[], Node], argv: Sequence[str] | None = None,
              prog: str = "") -> int:
    """Console entry point of one node: init rclpy with `argv` (ROS args), bring a managed
    node to active (a bad model card: one line, exit 1), spin it. `--managed` (before
    `--ros-args`) leaves it unconfigured for a lifecycle manager (vehicle.launch.py starts
    the nodes so) or `ros2 lifecycle set`."""
    from rclpy.utilities import remove_ros_args

    name = getattr(node_cls, "__name__", "")
    prog = prog or next((script for _, script, spec in NODES if spec.endswith(f":{name}")),
                        name)
    argv = list(argv if argv is not None else sys.argv)
    ap = argparse.ArgumentParser(prog=prog, description=f"The {name} ROS 2 managed node.")
    ap.add_argument("--managed", action="store_true", help="start unconfigured: a lifecycle "
                    "manager or `ros2 lifecycle set` brings it up (default: active at once)")
    args, _ = ap.parse_known_args(remove_ros_args(argv)[1:])  # others: ignored, as rclpy does

    def build() -> list[Node]:
        node = node_cls()
        return [activate(node) if isinstance(node, ManagedNode) and not args.managed
                else node]
    return run_nodes(prog, build, argv)


def ros_args_namespace(argv: Sequence[str]) -> str:
    """The namespace a `--ros-args -r __ns:=NS` (or `--remap`) in `argv` sets, else ''."""
    ns, in_ros = "", False
    for i, arg in enumerate(argv):
        if arg == "--ros-args":
            in_ros = True
        elif arg == "--":
            in_ros = False
        elif in_ros and arg in ("-r", "--remap") and i + 1 < len(argv) \
                and argv[i + 1].startswith("__ns:="):
            ns = argv[i + 1].partition(":=")[2]
    return ns


def invoked_as(argv0: str) -> str:
    """How the user started bringup, for usage and error lines: the installed console
    script (`ros2 run tta_ros bringup`, argv[0] .../lib/tta_ros/bringup), else the module
    (`python -m tta_ros.bringup`, argv[0] .../tta_ros/bringup.py)."""
    return "ros2 run tta_ros bringup" if Path(argv0).name == "bringup" \
        else "python -m tta_ros.bringup"


def _parser(prog: str = "python -m tta_ros.bringup") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(package_file("config/vehicle.yaml")),
                    help="node parameters (default: the shipped config/vehicle.yaml, in the "
                    "checkout or the installed share folder)")
    ap.add_argument("--namespace", default="", help="namespace of the three nodes and "
                    "their topics (default: a `--ros-args -r __ns:=...`, else none)")
    ap.add_argument("--image-topic", default=None, help="remap the perception input")
    ap.add_argument("--method", default="", help="perception's TTA method (as method:=)")
    ap.add_argument("--sigma", default="", help="perception's method.sigma and the "
                    "scheduler's sigma")
    ap.add_argument("--task", default="", choices=("", "classification", "segmentation"),
                    help="segmentation: the shipped segmentation card with method tent "
                    "(as task:=)")
    ap.add_argument("--model-card", default="", help="perception's and the scheduler's "
                    "model card (as model_card:=)")
    ap.add_argument("--use-sim-time", default="", metavar="BOOL",
                    help="use_sim_time of every node (as use_sim_time:=)")
    ap.add_argument("--autostart", default="true", metavar="BOOL",
                    help="bring the nodes to active (default); false leaves them "
                    "unconfigured, serving nothing, for `ros2 lifecycle set` (as autostart:=)")
    ap.add_argument("--set", action="append", default=[], metavar="NODE.PARAM=VALUE")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Spin the three nodes until Ctrl-C. ROS arguments after `--ros-args` (remaps,
    `--log-level`, ...) go to rclpy; `-r __ns:=NS` there also picks NS's params sections."""
    from rclpy.utilities import remove_ros_args

    ap = _parser(invoked_as(sys.argv[0]))
    full = [ap.prog, *(sys.argv[1:] if argv is None else argv)]
    args = ap.parse_args(remove_ros_args(full)[1:])
    namespace = args.namespace or ros_args_namespace(full)
    with one_line_errors(ap.prog):
        overrides = launch_overrides(args.method, args.sigma, args.use_sim_time,
                                     args.task, args.model_card)
        for node, vals in parse_set(args.set).items():
            overrides.setdefault(node, {}).update(vals)
        autostart = parse_bool(args.autostart)
    return run_nodes(ap.prog, lambda: build_nodes(args.config, overrides,
                                                  image_topic=args.image_topic,
                                                  namespace=namespace, autostart=autostart),
                     ros_args=full)


if __name__ == "__main__":
    sys.exit(main())
