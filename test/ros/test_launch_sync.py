"""launch/vehicle.launch.py and tta_ros.bringup start the same nodes with the same YAML.

`launch`/`launch_ros` are not installable here, so the launch file runs against recording
stand-ins of them (it must have no import-time side effects); bringup runs over real rclpy.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types

import pytest
import yaml
from helpers import CARD, CONFIG, ROOT

from tta_core.errors import InputError
from tta_ros import bringup
from tta_ros.launch_params import MANAGER, launch_overrides, node_parameters

LAUNCH = ROOT / "launch" / "vehicle.launch.py"


class _Recorded:
    """A stand-in launch action: keeps its arguments."""

    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs


class _LaunchConfiguration:
    def __init__(self, name: str) -> None:
        self.name = name

    def perform(self, context) -> str:
        return context.launch_configurations[self.name]


def _stub_modules(monkeypatch) -> None:
    """launch / launch_ros / ament_index_python stand-ins (not installable here) recording
    the actions the launch file builds."""
    mods = {name: types.ModuleType(name) for name in (
        "launch", "launch.actions", "launch.substitutions", "launch_ros",
        "launch_ros.actions", "ament_index_python", "ament_index_python.packages")}
    mods["launch"].LaunchDescription = lambda entities: list(entities)
    mods["launch.actions"].DeclareLaunchArgument = type("DeclareLaunchArgument", (_Recorded,), {})
    mods["launch.actions"].OpaqueFunction = type("OpaqueFunction", (_Recorded,), {})
    mods["launch.substitutions"].LaunchConfiguration = _LaunchConfiguration
    mods["launch_ros.actions"].Node = type("Node", (_Recorded,), {})
    mods["ament_index_python.packages"].get_package_share_directory = lambda _: str(ROOT)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def launch_nodes(monkeypatch, pushed: str | None = None, **args: str) -> dict[str, dict]:
    """Run vehicle.launch.py as `ros2 launch` would (stub launch modules): the kwargs of
    each Node it starts, by node name, for launch arguments `args`."""
    _stub_modules(monkeypatch)
    spec = importlib.util.spec_from_file_location("vehicle_launch", LAUNCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    entities = mod.generate_launch_description()
    declared = {e.args[0]: e.kwargs["default_value"] for e in entities
                if type(e).__name__ == "DeclareLaunchArgument"}
    unknown = set(args) - set(declared)
    assert not unknown, f"not launch arguments: {unknown}"
    configs = {**declared, **args}
    if pushed is not None:
        configs["ros_namespace"] = pushed
    context = types.SimpleNamespace(launch_configurations=configs)
    (opaque,) = [e for e in entities if type(e).__name__ == "OpaqueFunction"]
    return {n.kwargs["name"]: n.kwargs for n in opaque.kwargs["function"](context)}


def test_launch_imports_without_side_effects() -> None:
    spec = importlib.util.spec_from_file_location("vehicle_launch", LAUNCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # launch / launch_ros are imported lazily
    assert mod.PACKAGE == "tta_ros"
    names = {name for name, _, _ in mod.ARGUMENTS}
    assert names == {"config", "namespace", "image_topic", "method", "sigma", "use_sim_time",
                     "log_level", "autostart", "rviz", "task", "model_card"}


def test_launch_starts_the_bringup_nodes_with_the_shipped_yaml(monkeypatch) -> None:
    """The three nodes as bringup builds them, started unconfigured (`--managed`), and the
    lifecycle manager that brings them to active in bringup's order (autostart)."""
    nodes = launch_nodes(monkeypatch)
    manager = nodes.pop(MANAGER[0])
    assert [(n["name"], n["executable"]) for n in nodes.values()] == [
        (n, exe) for n, exe, _ in bringup.NODES]
    assert all(n["package"] == "tta_ros" and n["namespace"] is None for n in nodes.values())
    # the default config is the shipped YAML: parameters as bringup loads them
    assert {k: n["parameters"] for k, n in nodes.items()} == {
        k: [{**v, "use_sim_time": False}] for k, v in bringup.load_params(CONFIG).items()}
    assert nodes["perception"]["remappings"] == [("image", "image")]
    assert all(n["arguments"] == ["--managed", "--ros-args", "--log-level", "info"]
               for n in nodes.values())
    assert (manager["package"], manager["executable"]) == ("tta_ros", MANAGER[1])
    assert manager["parameters"] == [{"node_names": [n for n, _, _ in bringup.NODES],
                                      "autostart": True, "use_sim_time": False}]
    assert manager["arguments"] == ["--ros-args", "--log-level", "info"]


@pytest.mark.parametrize(("value", "autostart"), [("true", True), ("false", False)])
def test_launch_autostart_goes_to_the_lifecycle_manager(monkeypatch, value, autostart) -> None:
    nodes = launch_nodes(monkeypatch, autostart=value, namespace="car1")
    (params,) = nodes[MANAGER[0]]["parameters"]
    assert params["autostart"] is autostart and nodes[MANAGER[0]]["namespace"] == "/car1"
    assert all(n["arguments"][0] == "--managed" for name, n in nodes.items()
               if name != MANAGER[0])


def test_launch_overrides_win_over_the_nodes_own_yaml_sections(monkeypatch) -> None:
    """sigma:= / method:= used to lose to the node's section (launch_ros put them under /**).
    """
    nodes = launch_nodes(monkeypatch, sigma="0.5", method="tent", use_sim_time="true",
                         image_topic="/cam/front", log_level="debug")
    (per,) = nodes["perception"]["parameters"]
    (sched,) = nodes["scheduler"]["parameters"]
    (mon,) = nodes["resource_monitor"]["parameters"]
    assert (per["method.sigma"], per["method"], sched["sigma"]) == (0.5, "tent", 0.5)
    assert "sigma" not in mon and "method" not in sched and "sigma" not in per
    assert per["use_sim_time"] and sched["use_sim_time"] and mon["use_sim_time"]
    assert per["batch_size"] == 8 and mon["frame_id"] == "base_link"  # YAML kept
    assert nodes["perception"]["remappings"] == [("image", "/cam/front")]
    assert nodes["scheduler"]["arguments"] == ["--managed", "--ros-args", "--log-level",
                                               "debug"]
    assert "rviz2" not in nodes


@pytest.mark.parametrize("pushed", [None, "/fleet"])
def test_launch_namespace_keeps_yaml_sections_and_overrides(monkeypatch, pushed) -> None:
    """Under a namespace the per-node sections used to be dropped (frame_id '')."""
    nodes = launch_nodes(monkeypatch, pushed, namespace="car1", sigma="0.5", rviz="true")
    ns = "/fleet/car1" if pushed else "/car1"
    assert {n["namespace"] for n in nodes.values()} == {ns}  # the lifecycle manager's too
    (mon,) = nodes["resource_monitor"]["parameters"]
    (per,) = nodes["perception"]["parameters"]
    assert mon["frame_id"] == "base_link" and per["batch_size"] == 8
    assert per["method.sigma"] == 0.5
    rviz = nodes["rviz2"]
    assert rviz["arguments"] == ["-d", str(ROOT / "config" / "tta.rviz")]
    assert sorted(rviz["remappings"]) == [
        ("/image", f"{ns}/image"), ("/layer_markers", f"{ns}/layer_markers"),
        ("/segmentation", f"{ns}/segmentation"),
        ("/segmentation_overlay", f"{ns}/segmentation_overlay")]


@pytest.mark.parametrize(("args", "card", "method"), [
    ({"task": "segmentation"}, "checkpoints/lraspp_mobilenet_v3_large_scenes.json", "tent"),
    ({"task": "segmentation", "method": "cotta"},
     "checkpoints/lraspp_mobilenet_v3_large_scenes.json", "cotta"),
    ({"model_card": "/cards/mine.json"}, "/cards/mine.json", "adashadow"),
    ({}, "checkpoints/small_resnet_signs32.json", "adashadow"),
])
def test_launch_task_and_model_card_reach_perception_and_scheduler(monkeypatch, args, card,
                                                                   method) -> None:
    nodes = launch_nodes(monkeypatch, **args)
    (per,), (sched,) = nodes["perception"]["parameters"], nodes["scheduler"]["parameters"]
    assert per["model_card"] == sched["model_card"] == card and per["method"] == method
    assert launch_overrides(task=args.get("task", ""), model_card=args.get(
        "model_card", ""), method=args.get("method", "")).get("scheduler", {}).get(
        "model_card", card) == card  # bringup's --task / --model-card: the same overrides
    with pytest.raises(ValueError, match="task 'detection'"):
        launch_overrides(task="detection")


def test_launch_uses_the_shared_parameter_function() -> None:
    """The launch file builds its nodes with tta_ros.launch_params.launch_nodes (which
    calls node_parameters, as bringup.build_nodes does), handing it every launch argument."""
    tree = ast.parse(LAUNCH.read_text())
    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               for a in n.names}
    assert ("tta_ros.launch_params", "launch_nodes") in imports
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "launch_nodes"]
    assert len(calls) == 1 and ast.unparse(calls[0].args[0]) == "args"
    assert "parameters=[config" not in LAUNCH.read_text()  # never the params file itself


def test_params_file_sections_match_nodes() -> None:
    data = yaml.safe_load(CONFIG.read_text())
    names = {k.lstrip("/") for k in data} - {"**"}
    assert names == {n for n, _, _ in bringup.NODES}
    with pytest.raises(ValueError, match="unknown node"):
        bringup.build_nodes(CONFIG, {"planner": {"sigma": 0.1}})


def test_bringup_nodes_carry_exactly_the_yaml_parameters(ros_context, tmp_path) -> None:
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["/**"]["ros__parameters"]["model_card"] = str(CARD)
    cfg["resource_monitor"]["ros__parameters"]["rate_hz"] = 7.5  # a non-default value
    path = tmp_path / "vehicle.yaml"
    path.write_text(yaml.safe_dump(cfg))
    nodes = bringup.build_nodes(path, {"perception": {"method.sigma": 0.25}},
                                context=ros_context)
    try:
        assert [n.get_name() for n in nodes] == [n for n, _, _ in bringup.NODES]
        expected = bringup.load_params(path)
        expected["perception"]["method.sigma"] = 0.25
        for node in nodes:
            declared = set(node._parameters) - {"use_sim_time"}
            want = {k: v for k, v in expected[node.get_name()].items() if k in declared}
            got = {k: node.get_parameter(k).value for k in want}
            want = bringup.resolve_paths(want, bringup.ROOT)
            assert got == want, node.get_name()
            # every parameter in the node's own YAML section is one the node declares
            own = cfg[node.get_name()]["ros__parameters"]
            assert set(own) <= declared, set(own) - declared
    finally:
        for n in nodes:
            n.destroy_node()


@pytest.mark.parametrize("namespace", ["", "car1"])
def test_launch_and_bringup_give_each_node_the_same_parameters(monkeypatch, ros_context,
                                                               namespace) -> None:
    """Same launch arguments -> the same per-node parameters in `ros2 launch` and in
    bringup.build_nodes, plain and namespaced: overrides win, YAML sections survive."""
    args = {"namespace": namespace, "sigma": "0.5", "method": "tent", "use_sim_time": "false"}
    launched = launch_nodes(monkeypatch, **args)
    assert set(launched) == {*(n for n, _, _ in bringup.NODES), MANAGER[0]}
    nodes = bringup.build_nodes(CONFIG, launch_overrides(args["method"], args["sigma"],
                                                         args["use_sim_time"]),
                                context=ros_context, namespace=namespace)
    try:
        for node in nodes:
            name = node.get_name()
            assert node.get_namespace() == (f"/{namespace}" if namespace else "/")
            (want,) = launched[name]["parameters"]
            declared = set(node._parameters)
            own = yaml.safe_load(CONFIG.read_text())[name]["ros__parameters"]
            own = {k for k in own if not k.startswith("method.")}  # adashadow's, not tent's
            assert own <= declared and "use_sim_time" in want
            want = bringup.resolve_paths({k: v for k, v in want.items() if k in declared},
                                         bringup.ROOT)
            got = {k: node.get_parameter(k).value for k in want}
            assert got == want, name
        per, sched, mon = (n.get_parameter for n in (nodes[2], nodes[1], nodes[0]))
        assert (per("method").value, sched("sigma").value) == ("tent", 0.5)
        assert not nodes[2].has_parameter("method.sigma")  # tent has no sigma: ignored
        assert nodes[2].has_parameter("method.lr")
        assert per("batch_size").value == 8 and mon("frame_id").value == "base_link"
    finally:
        for n in nodes:
            n.destroy_node()


def test_params_file_sections_follow_the_namespace(tmp_path) -> None:
    """`/**` < `/ns/**` < `node` (any namespace; later of equals wins) < `/ns/node`."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["/car1/**"] = {"ros__parameters": {"frame_id": "car1_base", "bar_spacing": 0.1,
                                           "method.sigma": 0.1}}
    cfg["/car1/perception"] = {"ros__parameters": {"batch_size": 2}}
    cfg["/**/scheduler"] = {"ros__parameters": {"n_t": 7}}
    path = tmp_path / "vehicle.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    plain, car1, car2 = (node_parameters(path, ns) for ns in ("", "/car1", "car2"))
    assert plain["perception"]["batch_size"] == 8 == car2["perception"]["batch_size"]
    assert car1["perception"]["batch_size"] == 2
    assert car1["resource_monitor"]["frame_id"] == "base_link"  # own section beats /car1/**
    assert car1["scheduler"]["bar_spacing"] == 0.3 and car1["perception"]["method.sigma"] == 0.33
    assert car1["scheduler"]["n_t"] == 7 == plain["scheduler"]["n_t"]
    cfg["/car1/planner"] = {"ros__parameters": {"x": 1}}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with pytest.raises(ValueError, match="unknown node 'planner'"):
        node_parameters(path, "/car1")


def test_a_parameter_left_empty_is_named(tmp_path) -> None:
    """`profile:` without a value (YAML null) is no ROS parameter value: refused naming it
    and the node, before rclpy refuses it without a name."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["scheduler"]["ros__parameters"]["profile"] = None
    path = tmp_path / "empty.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(InputError, match=r"parameter 'profile' of scheduler has no value"):
        node_parameters(path)


def test_bringup_command_line_namespace_and_ros_args(monkeypatch) -> None:
    """--namespace / --ros-args -r __ns:= pick the namespace; ROS args go to rclpy."""
    seen = {}

    def fake_run(prog, build, ros_args=None):
        seen["ros_args"] = ros_args
        monkeypatch.setattr(bringup, "build_nodes", lambda *a, **kw: seen.update(kw=kw))
        build()
        return 0

    monkeypatch.setattr(bringup, "run_nodes", fake_run)
    assert bringup.main(["--sigma", "0.5", "--set", "perception.batch_size=2",
                         "--ros-args", "-r", "__ns:=/car2", "--log-level", "debug"]) == 0
    assert seen["kw"]["namespace"] == "/car2"
    assert seen["ros_args"][1:] == ["--sigma", "0.5", "--set", "perception.batch_size=2",
                                    "--ros-args", "-r", "__ns:=/car2", "--log-level", "debug"]
    assert bringup.main(["--namespace", "car1", "--method", "tent"]) == 0
    assert seen["kw"]["namespace"] == "car1"
    assert bringup.node_cli_args("perception", "/car1", "/cam") == [
        "--ros-args", "-r", "__ns:=/car1", "-r", "image:=/cam"]
    assert bringup.node_cli_args("scheduler") is None


def test_rviz_config_shows_markers_and_camera() -> None:
    rviz = yaml.safe_load((ROOT / "config" / "tta.rviz").read_text())
    displays = {d["Class"]: d for d in rviz["Visualization Manager"]["Displays"]}
    assert displays["rviz_default_plugins/MarkerArray"]["Topic"]["Value"] == "/layer_markers"
    assert displays["rviz_default_plugins/Image"]["Topic"]["Value"] == "/image"
    frame = rviz["Visualization Manager"]["Global Options"]["Fixed Frame"]
    sched = bringup.load_params(CONFIG)["scheduler"]
    assert frame == sched["marker_frame_id"]  # markers are drawn in RViz's fixed frame


def test_relative_paths_resolve_in_cwd_repo_then_package_share(tmp_path, monkeypatch) -> None:
    """A colcon install: the YAML's relative model_card only exists under share/tta_ros."""
    from tta_ros.ros_params import resolve_data_path, resolve_paths

    prefix, repo, cwd = tmp_path / "install", tmp_path / "repo", tmp_path / "cwd"
    index = prefix / "share" / "ament_index" / "resource_index" / "packages"
    index.mkdir(parents=True)
    (index / "tta_ros").write_text("")
    rel = "checkpoints/card.json"
    shared = prefix / "share" / "tta_ros" / rel
    shared.parent.mkdir(parents=True)
    shared.write_text("{}")
    for d in (repo, cwd):
        d.mkdir()
    monkeypatch.setenv("AMENT_PREFIX_PATH", str(prefix))
    monkeypatch.chdir(cwd)
    assert resolve_data_path(rel, repo) == str(shared.resolve())
    (repo / "checkpoints").mkdir()
    (repo / rel).write_text("{}")  # the repo (source checkout) wins over the share dir
    assert resolve_data_path(rel, repo) == str((repo / rel).resolve())
    (cwd / "checkpoints").mkdir()
    (cwd / rel).write_text("{}")  # and the working directory over both
    assert resolve_data_path(rel, repo) == str((cwd / rel).resolve())
    assert resolve_data_path("nowhere.json", repo) == str(repo / "nowhere.json")
    assert resolve_data_path("/abs/x.json", repo) == "/abs/x.json"
    assert resolve_paths({"model_card": rel, "profile": "", "sigma": 0.3}, repo) == {
        "model_card": str((cwd / rel).resolve()), "profile": "", "sigma": 0.3}
