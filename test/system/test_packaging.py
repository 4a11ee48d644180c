"""ROS 2 package metadata is valid for colcon/rosdep and declares the real dependencies; what
setup.py builds (a wheel, a colcon-style install) holds the packages, the ROS share files, the
console scripts and the `tta.commands` entry points."""

from __future__ import annotations

import ast
import configparser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from catkin_pkg.package import parse_package
from helpers import ROOT

PKG = ROOT / "ros_package"  # the ament_python package folder (links to the sources)
# What setup.py reads: copied (links followed), because building writes build/ and
# tta_ros.egg-info/ next to setup.py.
NOT_BUILD_INPUTS = ("test", "msg", "pytest.ini", "build", "*.egg-info", "__pycache__", "*.pyc")
CONSOLE_SCRIPTS = {
    "tta": "tta_core.cli:main",
    "perception_node": "tta_ros.nodes.perception:main",
    "resource_monitor_node": "tta_ros.nodes.resource_monitor:main",
    "scheduler_node": "tta_ros.nodes.scheduler:main",
    "lifecycle_manager": "tta_ros.nodes.lifecycle_manager:main",
    "bringup": "tta_ros.bringup:main",
}
COMMAND_PACKAGES = {"tta_core.cli.commands": ROOT / "tta_core" / "cli" / "commands",
                    "tta_ros.commands": ROOT / "tta_ros" / "commands"}


def _deps(pkg) -> set[str]:
    return {d.name for d in pkg.exec_depends + pkg.build_depends + pkg.buildtool_depends}


def test_tta_ros_manifest_declares_runtime_dependencies():
    pkg = parse_package(str(PKG / "package.xml"))
    pkg.validate()
    assert pkg.name == "tta_ros"
    assert pkg.get_build_type() == "ament_python"
    needed = {"rclpy", "sensor_msgs", "diagnostic_msgs", "visualization_msgs", "std_msgs",
              "std_srvs", "tta_msgs", "python3-torch", "python3-torchvision", "python3-numpy",
              "python3-psutil", "launch", "launch_ros", "lifecycle_msgs"}
    assert needed <= _deps(pkg), needed - _deps(pkg)
    # `rosdep check` stopped at it: ament_python is a build type, not a rosdep key
    assert "ament_python" not in {d.name for d in pkg.buildtool_depends}
    assert all("@" in m.email and "." in m.email.split("@")[1] for m in pkg.maintainers)


# module the code imports -> its rosdep key (keys checked against ros/rosdistro rosdep/*.yaml)
ROSDEP_KEYS = {"torch": "python3-torch", "torchvision": "python3-torchvision",
               "numpy": "python3-numpy", "scipy": "python3-scipy", "cv2": "python3-opencv",
               "psutil": "python3-psutil", "yaml": "python3-yaml", "PIL": "python3-pil",
               "matplotlib": "python3-matplotlib", "tqdm": "python3-tqdm",
               "rich": "python3-rich", "rosbags": "python3-rosbags-pip"}
ROS_PACKAGES = {"rclpy", "rcl_interfaces", "ament_index_python", "launch", "launch_ros",
                "std_msgs", "sensor_msgs", "diagnostic_msgs", "visualization_msgs",
                "geometry_msgs", "builtin_interfaces", "nav_msgs", "std_srvs", "lifecycle_msgs",
                "tta_msgs"}
NO_KEY = {"imagecorruptions", "safetensors", "ray"}  # pip only (requirements/python.txt)
# telemetry sources tried at run time on NVIDIA / Jetson; triton: tta_kernels' CUDA kernels,
# imported on first CUDA use with a fallback (tta_kernels.dispatch)
OPTIONAL = {"pynvml", "jtop", "triton"}
FIRST_PARTY = {"tta_core", "tta_ros", "tta_kernels"}


def _imported_modules() -> set[str]:
    """Top-level names of every module the installed code imports (not stdlib, not ours)."""
    found: set[str] = set()
    for folder in ("tta_core", "tta_ros", "kernels", "launch"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - FIRST_PARTY - {"__future__"}


def test_every_runtime_import_has_its_rosdep_key_declared():
    """rosdep installs what package.xml names: an import without a key fails on a robot."""
    imported = _imported_modules()
    unknown = imported - set(ROSDEP_KEYS) - ROS_PACKAGES - NO_KEY - OPTIONAL
    assert not unknown, f"imports without a rosdep mapping here: {sorted(unknown)}"
    declared = {d.name for d in parse_package(str(PKG / "package.xml")).exec_depends}
    needed = {ROSDEP_KEYS.get(m, m) for m in imported - NO_KEY - OPTIONAL}
    assert needed <= declared, sorted(needed - declared)
    tests = {d.name for d in parse_package(str(PKG / "package.xml")).test_depends}
    assert {"python3-pytest", "python3-pytest-timeout", "python3-hypothesis"} <= tests


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
                                 "AdaptationStatus", "ClassPrediction", "DomainLabel",
                                 "FleetReport"}


def test_repository_root_is_no_package_so_colcon_finds_both() -> None:
    """colcon's crawl stops at the first folder it identifies as a package: a manifest at
    the root would hide msg/ (tta_msgs) from a plain `colcon build`."""
    markers = ("package.xml", "setup.py", "setup.cfg", "pyproject.toml", "CMakeLists.txt",
               "colcon.pkg", "COLCON_IGNORE")
    assert not [m for m in markers if (ROOT / m).exists()]
    for link in ("tta_core", "tta_ros", "kernels", "launch", "config", "checkpoints", "bags"):
        assert (PKG / link).is_symlink() and (PKG / link).resolve() == ROOT / link, link


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package folder with its links followed, in a scratch directory."""
    dst = tmp_path_factory.mktemp("source") / "ros_package"
    shutil.copytree(PKG, dst, ignore=shutil.ignore_patterns(*NOT_BUILD_INPUTS))
    return dst


@dataclass
class Wheel:
    """The names and text files of a built wheel."""

    path: Path
    names: set[str]

    @property
    def dist_info(self) -> str:
        return next(n.split("/")[0] for n in self.names if n.split("/")[0].endswith(".dist-info"))

    @property
    def share(self) -> str:
        """Prefix of the data files (installed under sys.prefix)."""
        return self.dist_info.replace(".dist-info", ".data") + "/data/share/"

    def read(self, name: str) -> bytes:
        with zipfile.ZipFile(self.path) as z:
            return z.read(name)


@pytest.fixture(scope="module")
def wheel(source_copy: Path, tmp_path_factory: pytest.TempPathFactory) -> Wheel:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(out), "."],
        cwd=source_copy, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = out.glob("tta_ros-*.whl")
    with zipfile.ZipFile(path) as z:
        return Wheel(path, set(z.namelist()))


def _sources(package_dir: Path, package: str) -> set[str]:
    return {f"{package}/{p.relative_to(package_dir).as_posix()}"
            for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts}


def test_wheel_holds_all_three_python_packages(wheel: Wheel) -> None:
    assert _sources(ROOT / "tta_core", "tta_core") <= wheel.names
    assert _sources(ROOT / "tta_ros", "tta_ros") <= wheel.names
    assert "tta_core/py.typed" in wheel.names
    kernels = _sources(ROOT / "kernels", "tta_kernels")  # kernels/ installs as tta_kernels
    kernels |= {f"tta_kernels/{p.name}" for p in (ROOT / "kernels").glob("*.c")}  # C sources,
    # built on first use
    assert kernels and kernels <= wheel.names
    for name in kernels:
        assert wheel.read(name) == (ROOT / "kernels" / name.split("/", 1)[1]).read_bytes(), name
    meta = wheel.read(f"{wheel.dist_info}/METADATA").decode()
    version = parse_package(str(PKG / "package.xml")).version
    assert "\nName: tta_ros\n" in meta and f"\nVersion: {version}\n" in meta


def test_installed_metadata_matches_the_manifest() -> None:
    assert metadata.version("tta_ros") == parse_package(str(PKG / "package.xml")).version


def test_wheel_installs_the_ros_share_files(wheel: Wheel) -> None:
    """ament index marker, manifest, launch, config, checkpoints and every sample bag."""
    shipped = {n[len(wheel.share):] for n in wheel.names if n.startswith(wheel.share)}
    ament = {"ament_index/resource_index/packages/tta_ros", "tta_ros/package.xml"}
    in_tree = {f"tta_ros/{p.relative_to(ROOT).as_posix()}" for pattern in (
        "launch/*.launch.py", "config/*.yaml", "config/*.rviz", "checkpoints/*.pt",
        "checkpoints/*.safetensors", "checkpoints/*.json", "bags/*/*")
        for p in ROOT.glob(pattern) if p.is_file()}
    assert shipped == ament | in_tree
    assert {"tta_ros/launch/vehicle.launch.py", "tta_ros/config/vehicle.yaml",
            "tta_ros/config/tta.rviz", "tta_ros/checkpoints/small_resnet_signs32.json",
            "tta_ros/checkpoints/small_resnet_signs32.pt",
            "tta_ros/bags/signs32_sample/metadata.yaml",
            "tta_ros/bags/signs32_sample/signs32_sample.mcap"} <= shipped
    assert (PKG / "resource" / "tta_ros").exists()
    assert not [n for n in wheel.names if "/data/bin/" in n]  # pip writes its own `tta`


def _entry_points(wheel: Wheel) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # names keep their case
    parser.read_string(wheel.read(f"{wheel.dist_info}/entry_points.txt").decode())
    return parser


def test_wheel_declares_the_console_scripts(wheel: Wheel) -> None:
    assert dict(_entry_points(wheel)["console_scripts"]) == CONSOLE_SCRIPTS


def test_wheel_declares_every_tta_command(wheel: Wheel) -> None:
    """Every module of the command packages is a `tta.commands` entry named by its NAME."""
    commands = dict(_entry_points(wheel)["tta.commands"])
    modules = {f"{pkg}.{p.stem}" for pkg, d in COMMAND_PACKAGES.items()
               for p in d.glob("*.py") if not p.stem.startswith("_")}
    assert set(commands.values()) == modules
    for name, value in commands.items():
        mod = metadata.EntryPoint(name, value, "tta.commands").load()
        assert mod.NAME == name, value
    assert {"doctor", "bench", "demo", "replay"} <= set(commands)


def test_colcon_style_install_layout(source_copy: Path, tmp_path: Path) -> None:
    """What `colcon build` (ament_python: setup.py install) lays out for `ros2 launch/run`."""
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build", "--build-base", str(tmp_path / "b"),
         "install", "--prefix", str(tmp_path),
         "--single-version-externally-managed", "--record", str(tmp_path / "rec.txt")],
        cwd=source_copy, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    share = tmp_path / "share" / "tta_ros"
    for rel in ("package.xml", "launch/vehicle.launch.py", "config/vehicle.yaml",
                "config/tta.rviz", "checkpoints/small_resnet_signs32.json",
                "checkpoints/small_resnet_signs32.pt"):
        assert (share / rel).is_file(), rel
    assert (tmp_path / "share/ament_index/resource_index/packages/tta_ros").is_file()
    for exe in ("perception_node", "resource_monitor_node", "scheduler_node",
                "lifecycle_manager", "tta"):
        assert (tmp_path / "lib" / "tta_ros" / exe).is_file(), exe
    on_path = tmp_path / "bin" / "tta"  # colcon puts <prefix>/bin on PATH
    assert on_path.is_file() and os.access(on_path, os.X_OK)
    assert "from tta_core.cli import main" in on_path.read_text()
