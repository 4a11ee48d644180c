"""The nodes' parameters, per node and namespace: one plain function for launch and bringup.

`ros2 launch` and `python -m tta_ros.bringup` both call `node_parameters` and hand each node
a *dict* (never the params file itself), because passing the file to launch_ros loses in two
ways: rcl applies a node's own section over `/**`, so launch overrides written under `/**`
lose to the YAML; and under a namespace, rcl reads a bare `perception:` key as
`/perception`, so the node's section is dropped. Here the merge is explicit:

    `/**`  <  `/ns/**` (namespace prefix)  <  `name`, `/name`, `/**/name` (this node, in
    whatever namespace it runs)  <  `/ns/name` (only in /ns)  <  overrides (launch arguments,
    `--set`)

so one file serves every vehicle/camera and may still carry per-namespace sections.
launch_ros writes a dict under the node's fully qualified name, so nothing is dropped.

Plain Python (yaml and tta_core.errors only): the launch file imports it without rclpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tta_core.errors import InputError

PACKAGE = "tta_ros"
# (node name, console script); tta_ros.bringup.NODES adds the node classes
NODES: tuple[tuple[str, str], ...] = (
    ("resource_monitor", "resource_monitor_node"),
    ("scheduler", "scheduler_node"),
    ("perception", "perception_node"),
)
# (node name, console script) of the lifecycle manager the launch file starts beside them:
# it configures and activates the NODES, which start unconfigured (`--managed`)
MANAGER = ("lifecycle_manager", "lifecycle_manager")
# the nodes a `sigma` argument configures, and the parameter it sets on each (perception:
# an option of its method, tta_ros.nodes.method_params)
SIGMA_PARAMS = {"perception": "method.sigma", "scheduler": "sigma"}
TASKS = ("classification", "segmentation")
#: what `task:=segmentation` serves: the shipped segmentation card (perception and the
#: scheduler load it) with a method that segments, unless `model_card` / `method` are given
SEGMENTATION_CARD = "checkpoints/lraspp_mobilenet_v3_large_scenes.json"
SEGMENTATION_METHOD = "tent"
CARD_NODES = ("perception", "scheduler")  # the nodes that load the model card
TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off")


def parse_bool(text: str | bool) -> bool:
    """A launch argument's 'true'/'false' (also 1/0, yes/no, on/off) as a bool."""
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in TRUE or low in FALSE:
        return low in TRUE
    raise ValueError(f"{text!r} is not a boolean (true/false)")


def join_namespace(*parts: str | None) -> str:
    """Namespaces joined the ROS way ('' for the root): a part starting with '/' is
    absolute and restarts the path; ('/fleet', 'car1') -> '/fleet/car1'."""
    out = ""
    for part in parts:
        if not part:
            continue
        part = part.strip()
        out = ("" if part.startswith("/") else out) + "/" + part.strip("/")
    return "" if out.strip("/") == "" else "/" + out.strip("/")


def _read_sections(config_path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(key, ros__parameters) of every section, in file order."""
    try:
        with Path(config_path).open() as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        raise InputError(f"params file {config_path} is not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"params file {config_path} is not a mapping")
    out = []
    for key, section in data.items():
        params = section.get("ros__parameters") if isinstance(section, dict) else None
        if not isinstance(params, dict):
            raise ValueError(f"section {key!r} of {config_path} has no ros__parameters mapping")
        out.append((str(key), params))
    return out


def section_rank(key: str, node: str, namespace: str) -> int | None:
    """How specific the params-file `key` is for `node` in `namespace` (higher wins), or None
    when it does not apply. Raises ValueError for a key naming an unknown node."""
    path = "/" + key.strip().strip("/")
    if path == "/**":
        return 0
    if path.endswith("/**"):
        prefix = path[:-3]
        return 1 if namespace == prefix or namespace.startswith(prefix + "/") else None
    ns, _, name = path.rpartition("/")
    if name not in {n for n, _ in NODES}:
        raise ValueError(f"section {key!r} names unknown node {name!r}; "
                         f"known: {sorted(n for n, _ in NODES)}")
    if name != node:
        return None
    if ns in ("", "/**"):
        return 2
    return 3 if ns == namespace else None


def node_parameters(config_path: str | Path, namespace: str = "",
                    overrides: Mapping[str, Mapping[str, Any]] | None = None,
                    ) -> dict[str, dict[str, Any]]:
    """{node name: parameters} for the three nodes in `namespace`: the params file's sections
    merged from least to most specific (module docstring), then `overrides[node]`.
    InputError naming a parameter without a value (`profile:` left empty)."""
    namespace = join_namespace(namespace)
    sections = _read_sections(config_path)
    known = [n for n, _ in NODES]
    unknown = sorted(set(overrides or {}) - set(known))
    if unknown:
        raise ValueError(f"override for unknown node(s) {unknown}; known: {sorted(known)}")
    out: dict[str, dict[str, Any]] = {}
    for name in known:
        ranked = [(rank, i, params) for i, (key, params) in enumerate(sections)
                  if (rank := section_rank(key, name, namespace)) is not None]
        merged: dict[str, Any] = {}
        for _, _, params in sorted(ranked, key=lambda r: (r[0], r[1])):
            merged.update(params)
        merged.update((overrides or {}).get(name, {}))
        empty = sorted(k for k, v in merged.items() if v is None)
        if empty:  # rclpy would refuse it without naming it (no parameter type is None)
            raise InputError(f"parameter {empty[0]!r} of {name} has no value (an empty "
                             "entry in the params file): give one or leave it out")
        out[name] = merged
    return out


def launch_overrides(method: str = "", sigma: str = "", use_sim_time: str = "",
                     task: str = "", model_card: str = "") -> dict[str, dict[str, Any]]:
    """Per-node overrides from launch-argument strings ('' means not given): `method` goes
    to perception, `sigma` to perception (method.sigma: a method without sigma ignores it)
    and scheduler, `use_sim_time` to every node, `model_card` to perception and scheduler;
    `task` segmentation sets SEGMENTATION_CARD and SEGMENTATION_METHOD where `model_card` /
    `method` are not given (classification: the params file's card)."""
    out: dict[str, dict[str, Any]] = {name: {} for name, _ in NODES}
    if task and task not in TASKS:
        raise ValueError(f"task {task!r}: choose from {', '.join(TASKS)}")
    if task == "segmentation":
        model_card = model_card or SEGMENTATION_CARD
        method = method or SEGMENTATION_METHOD
    for name in CARD_NODES if model_card else ():
        out[name]["model_card"] = model_card
    if method:
        out["perception"]["method"] = method
    if sigma:
        for name, param in SIGMA_PARAMS.items():
            out[name][param] = float(sigma)
    if use_sim_time:
        for vals in out.values():
            vals["use_sim_time"] = parse_bool(use_sim_time)
    return {k: v for k, v in out.items() if v}


def launch_nodes(args: Mapping[str, str], pushed_namespace: str | None = None,
                 ) -> list[dict[str, Any]]:
    """The keyword arguments of each launch_ros Node that vehicle.launch.py starts, from the
    launch arguments' values (`args`: config, namespace, image_topic, method, sigma,
    use_sim_time, task, model_card, log_level, autostart, rviz, rviz_config) under an outer
    pushed
    namespace: the three nodes, started unconfigured (`--managed`), then the lifecycle
    manager that brings them to active when `autostart` (default true)."""
    ns = join_namespace(pushed_namespace, args.get("namespace", ""))
    params = node_parameters(args["config"], ns, launch_overrides(
        args.get("method", ""), args.get("sigma", ""), args.get("use_sim_time", ""),
        args.get("task", ""), args.get("model_card", "")))
    log = ["--ros-args", "--log-level", args["log_level"]] if args.get("log_level") else []
    image = args.get("image_topic") or "image"
    nodes = [{"package": PACKAGE, "executable": exe, "name": name, "namespace": ns or None,
              "output": "screen", "parameters": [params[name]],
              "arguments": ["--managed", *log],
              "remappings": [("image", image)] if name == "perception" else []}
             for name, exe in NODES]
    manager = {"node_names": [name for name, _ in NODES],
               "autostart": parse_bool(args.get("autostart", "true"))}
    if args.get("use_sim_time"):
        manager["use_sim_time"] = parse_bool(args["use_sim_time"])
    nodes.append({"package": PACKAGE, "executable": MANAGER[1], "name": MANAGER[0],
                  "namespace": ns or None, "output": "screen", "parameters": [manager],
                  "arguments": list(log), "remappings": []})
    if parse_bool(args.get("rviz", "false")):
        nodes.append(rviz_node(args["rviz_config"], ns, image))
    return nodes


def rviz_node(rviz_config: str, namespace: str, image_topic: str) -> dict[str, Any]:
    """RViz with `rviz_config` (absolute topics /layer_markers, /segmentation,
    /segmentation_overlay and /image), remapped to the namespace's marker, segmentation
    and camera topics."""
    remaps = []
    if namespace:
        remaps += [(f"/{t}", f"{namespace}/{t}") for t in ("layer_markers", "segmentation",
                                                           "segmentation_overlay")]
    image = image_topic if image_topic.startswith("/") else join_namespace(namespace,
                                                                           image_topic)
    if image != "/image":
        remaps.append(("/image", image))
    return {"package": "rviz2", "executable": "rviz2", "name": "rviz2",
            "namespace": namespace or None, "output": "screen",
            "arguments": ["-d", rviz_config], "remappings": remaps}
