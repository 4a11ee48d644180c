"""launch/vehicle.launch.py and tta_ros.bringup start the same nodes with the same YAML.

`launch`/`launch_ros` are not installable here, so the launch file is read with `ast`
(and imported: it must have no import-time side effects); bringup runs over real rclpy.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import yaml

from tta_ros import bringup

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch" / "vehicle.launch.py"
CONFIG = ROOT / "config" / "vehicle.yaml"
CARD = ROOT / "checkpoints" / "small_resnet_signs32.json"  # shipped with the repo


def _tree() -> ast.Module:
    return ast.parse(LAUNCH.read_text())


def _assign(name: str):
    for node in _tree().body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not assigned in {LAUNCH}")


def _calls(func: str) -> list[ast.Call]:
    return [n for n in ast.walk(_tree()) if isinstance(n, ast.Call)
            and getattr(n.func, "id", getattr(n.func, "attr", None)) == func]


def test_launch_lists_the_bringup_nodes() -> None:
    assert _assign("NODES") == tuple((n, exe) for n, exe, _ in bringup.NODES)
    assert _assign("PACKAGE") == "tta_ros"


def test_launch_node_action_uses_params_file_and_names() -> None:
    (call,) = _calls("Node")
    kw = {k.arg: k.value for k in call.keywords}
    assert ast.unparse(kw["package"]) == "PACKAGE"
    assert ast.unparse(kw["executable"]) == "executable"
    assert ast.unparse(kw["name"]) == "name"
    assert ast.unparse(kw["parameters"]) == "[config, extra] if extra else [config]"
    assert "image" in ast.unparse(kw["remappings"])
    args = {ast.literal_eval(c.args[0]) for c in _calls("DeclareLaunchArgument")}
    assert args == {"config", "image_topic", "method", "sigma"}
    text = LAUNCH.read_text()
    assert '"config",' in text and '"vehicle.yaml"' in text  # default: the shipped YAML


def test_launch_imports_without_side_effects_and_overrides_like_bringup() -> None:
    spec = importlib.util.spec_from_file_location("vehicle_launch", LAUNCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # launch / launch_ros are imported lazily
    assert mod.node_overrides("perception", "", "") == {}
    assert mod.node_overrides("perception", "tent", "0.2") == {"method": "tent", "sigma": 0.2}
    assert mod.node_overrides("scheduler", "tent", "0.2") == {"sigma": 0.2}
    assert mod.node_overrides("resource_monitor", "tent", "0.2") == {}
    # every node the launch file configures by sigma declares a sigma parameter
    params = bringup.load_params(CONFIG)
    assert all("sigma" in params[n] for n in mod.SIGMA_NODES)


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
    nodes = bringup.build_nodes(path, {"perception": {"sigma": 0.25}}, context=ros_context)
    try:
        assert [n.get_name() for n in nodes] == [n for n, _, _ in bringup.NODES]
        expected = bringup.load_params(path)
        expected["perception"]["sigma"] = 0.25
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
