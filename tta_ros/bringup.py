"""Run perception, resource_monitor and scheduler in one process (SingleThreadedExecutor).

    python -m tta_ros.bringup --config config/vehicle.yaml [--image-topic /camera/image_raw]
        [--set perception.sigma=0.2 ...]

Parameters come from a standard ROS 2 params file (`node_name: ros__parameters: {...}`;
a `/**` section applies to every node, the node's own section wins), exactly what
launch/vehicle.launch.py hands to the same three nodes. `build_nodes` is the testable core.

One SingleThreadedExecutor serves all callbacks: they are short (the perception worker
thread does the heavy work), and rclpy's MultiThreadedExecutor costs 3-4x more per frame
(its spin loop competes with the worker for the GIL: benchmarks/bench_ros_overhead.py).

Shutdown order (`run_nodes`, `spin`): rclpy is initialised without its signal handlers,
which shut the context down the moment SIGINT/SIGTERM arrives, under a perception worker
that is still publishing. Our handlers only stop the spin loop; then every node is
destroyed (perception stops and joins its worker first) and only then is the context shut
down; exit status 0. Start-up errors (bad model card, params file, parameter) are one line
on stderr (TTA_DEBUG=1: the traceback).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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

from tta_core.errors import InputError, one_line_errors
from tta_core.runtime.malloc_tuning import keep_freed_memory
from tta_ros.ros_params import resolve_paths

# (node name, console script, module:class): the launch file lists the same names/scripts
NODES: tuple[tuple[str, str, str], ...] = (
    ("resource_monitor", "resource_monitor_node",
     "tta_ros.nodes.resource_monitor:ResourceMonitorNode"),
    ("scheduler", "scheduler_node", "tta_ros.nodes.scheduler:SchedulerNode"),
    ("perception", "perception_node", "tta_ros.nodes.perception:PerceptionNode"),
)
ROOT = Path(__file__).resolve().parent.parent
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SPIN_POLL_S = 0.1  # how soon the spin loop sees a stop request


def load_params(config_path: str | Path) -> dict[str, dict[str, Any]]:
    """Params file -> {node_name: {param: value}} with `/**` merged under each node."""
    try:
        with Path(config_path).open() as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        raise InputError(f"params file {config_path} is not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"params file {config_path} is not a mapping")
    common: dict[str, Any] = {}
    per_node: dict[str, dict[str, Any]] = {}
    for key, section in data.items():
        params = (section or {}).get("ros__parameters")
        if not isinstance(params, dict):
            raise ValueError(f"section {key!r} of {config_path} has no ros__parameters mapping")
        name = str(key).lstrip("/")
        if name == "**":
            common.update(params)
        else:
            per_node[name] = params
    known = {n for n, _, _ in NODES}
    unknown = sorted(set(per_node) - known)
    if unknown:
        raise ValueError(f"params file {config_path} names unknown node(s) {unknown}; "
                         f"known: {sorted(known)}")
    return {n: {**common, **per_node.get(n, {})} for n in known}


def _import(spec: str) -> type:
    module, cls = spec.split(":")
    mod = __import__(module, fromlist=[cls])
    return getattr(mod, cls)


def build_nodes(config_path: str | Path,
                overrides: Mapping[str, Mapping[str, Any]] | None = None,
                context: Context | None = None, image_topic: str | None = None,
                base: Path = ROOT) -> list[Node]:
    """The three nodes with parameters from the YAML, then `overrides[node][param]`."""
    params = load_params(config_path)
    for node, vals in (overrides or {}).items():
        if node not in params:
            raise ValueError(f"override for unknown node {node!r}")
        params[node].update(vals)
    nodes: list[Node] = []
    try:
        for name, _, spec in NODES:
            p = resolve_paths(params[name], base)
            cli = ["--ros-args", "-r", f"image:={image_topic}"] if (
                image_topic and name == "perception") else None
            nodes.append(_import(spec)(
                name, context=context, cli_args=cli,
                parameter_overrides=[Parameter(k, value=v) for k, v in p.items()]))
    except Exception:
        for n in nodes:
            n.destroy_node()
        raise
    return nodes


def parse_set(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """['perception.sigma=0.2'] -> {'perception': {'sigma': 0.2}} (values parsed as YAML)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        node, dot, param = key.partition(".")
        if not sep or not dot:
            raise ValueError(f"--set {item!r}: expected node.param=value")
        out.setdefault(node, {})[param] = yaml.safe_load(raw)
    return out


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT/SIGTERM set `stop` while inside (previous handlers restored on exit); off
    the main thread, where Python cannot install handlers, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
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
        n.get_logger().info(f"ready: subscribes {subs or '-'}, publishes {pubs or '-'}")
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
              ros_args: Sequence[str] | None = None) -> int:
    """Init rclpy (ROS args `ros_args`, none of rclpy's signal handlers), build the nodes
    (bad input: one line on stderr naming it, exit 1), spin them until SIGINT/SIGTERM."""
    keep_freed_memory()  # no page faults on every batch's activations (runtime.malloc_tuning)
    stop = threading.Event()
    with stop_on_signals(stop):  # a signal during start-up stops the nodes once built
        rclpy.init(args=list(ros_args) if ros_args is not None else None,
                   signal_handler_options=SignalHandlerOptions.NO)
        try:
            with one_line_errors(prog, extra=(ParameterException,)):
                nodes = build()
        except BaseException:
            rclpy.try_shutdown()  # also destroys a half-built node the context tracks
            raise
        spin(nodes, SingleThreadedExecutor(), stop)
    return 0


def node_main(node_cls: Callable[[], Node], argv: Sequence[str] | None = None) -> int:
    """Console entry point of one node: init rclpy with `argv` (ROS args), spin it."""
    name = getattr(node_cls, "__name__", "")
    prog = next((script for _, script, spec in NODES if spec.endswith(f":{name}")), name)
    return run_nodes(prog, lambda: [node_cls()], argv if argv is not None else sys.argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Spin the three nodes until Ctrl-C."""
    ap = argparse.ArgumentParser(prog="python -m tta_ros.bringup", description=__doc__)
    ap.add_argument("--config", default=str(ROOT / "config" / "vehicle.yaml"))
    ap.add_argument("--image-topic", default=None, help="remap the perception input")
    ap.add_argument("--set", action="append", default=[], metavar="NODE.PARAM=VALUE")
    args = ap.parse_args(argv)
    with one_line_errors(ap.prog):
        overrides = parse_set(args.set)
    return run_nodes(ap.prog, lambda: build_nodes(args.config, overrides,
                                                  image_topic=args.image_topic))


if __name__ == "__main__":
    sys.exit(main())
