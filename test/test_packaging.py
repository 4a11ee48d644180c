"""ROS 2 package metadata is valid for colcon/rosdep and declares the real dependencies."""

from __future__ import annotations

import ast
import re
from importlib import metadata
from pathlib import Path

from catkin_pkg.package import parse_package

ROOT = Path(__file__).resolve().parents[1]


def _deps(pkg) -> set[str]:
    return {d.name for d in pkg.exec_depends + pkg.build_depends + pkg.buildtool_depends}


def test_tta_ros_manifest_declares_runtime_dependencies():
    pkg = parse_package(str(ROOT / "package.xml"))
    pkg.validate()
    assert pkg.name == "tta_ros"
    assert pkg.get_build_type() == "ament_python"
    needed = {"rclpy", "sensor_msgs", "diagnostic_msgs", "visualization_msgs", "std_msgs",
              "tta_msgs", "python3-torch", "python3-torchvision", "python3-numpy",
              "python3-psutil", "launch", "launch_ros"}
    assert needed <= _deps(pkg), needed - _deps(pkg)
    assert all("@" in m.email and "." in m.email.split("@")[1] for m in pkg.maintainers)


def test_tta_msgs_manifest_is_an_interface_package():
    pkg = parse_package(str(ROOT / "msg" / "package.xml"))
    pkg.validate()
    assert pkg.name == "tta_msgs"
    assert pkg.get_build_type() == "ament_cmake"
    assert {"rosidl_default_generators", "ament_cmake"} <= _deps(pkg)
    assert "rosidl_default_runtime" in {d.name for d in pkg.exec_depends}
    assert "rosidl_interface_packages" in {g.name for g in pkg.member_of_groups}


def test_cmake_generates_every_msg_file():
    cmake = (ROOT / "msg" / "CMakeLists.txt").read_text()
    listed = set(re.findall(r'"msg/(\w+)\.msg"', cmake))
    on_disk = {p.stem for p in (ROOT / "msg" / "msg").glob("*.msg")}
    assert listed == on_disk == {"LayerImportance", "LayerPlan", "ResourceTelemetry",
                                 "AdaptationStatus", "ClassPrediction"}


def test_setup_py_installs_all_three_python_packages_and_ament_resources():
    tree = ast.parse((ROOT / "setup.py").read_text())
    text = ast.unparse(tree)
    for needle in ("tta_core", "tta_ros", "tta_kernels", "'kernels'",
                   "share/ament_index/resource_index/packages", "tta = tta_core.cli:main"):
        assert needle in text, needle
    assert (ROOT / "resource" / "tta_ros").exists()
    assert metadata.version("tta_ros") == parse_package(str(ROOT / "package.xml")).version
    import tta_kernels

    assert Path(tta_kernels.__file__).parent == ROOT / "kernels"


def test_colcon_style_install_layout(tmp_path):
    """What `colcon build` (ament_python: setup.py install) lays out for `ros2 launch/run`."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build", "--build-base", str(tmp_path / "b"),
         "install", "--prefix", str(tmp_path),
         "--single-version-externally-managed", "--record", str(tmp_path / "rec.txt")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    share = tmp_path / "share" / "tta_ros"
    for rel in ("package.xml", "launch/vehicle.launch.py", "config/vehicle.yaml",
                "config/tta.rviz", "checkpoints/small_resnet_signs32.json",
                "checkpoints/small_resnet_signs32.pt"):
        assert (share / rel).is_file(), rel
    assert (tmp_path / "share/ament_index/resource_index/packages/tta_ros").is_file()
    for exe in ("perception_node", "resource_monitor_node", "scheduler_node", "tta"):
        assert (tmp_path / "lib" / "tta_ros" / exe).is_file(), exe
