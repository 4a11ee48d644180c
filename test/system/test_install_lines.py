"""README's workspace install lines are complete: every third-party module tta_core, tta_ros,
tta_kernels and the launch file import is installed by `rosdep install` (a key in
ros_package/package.xml) or by README's `pip install` line, and every package the launch
file starts is a declared exec_depend. A module missing from both fails only on a robot."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from catkin_pkg.package import parse_package
from helpers import CONFIG, ROOT

from tta_ros.launch_params import launch_nodes

PACKAGE_XML = ROOT / "ros_package" / "package.xml"
README = ROOT / "README.md"
INSTALL_DOCS = (README, ROOT / "docs" / "how-to" / "ros-workspace.md")  # same install lines
SOURCES = {"tta_core": ROOT / "tta_core", "tta_ros": ROOT / "tta_ros",
           "tta_kernels": ROOT / "kernels", "launch file": ROOT / "launch"}
FIRST_PARTY = {"tta_core", "tta_ros", "tta_kernels", "__future__"}
# import name -> rosdep key where the two differ (ROS 2 packages: the import is the key)
ROSDEP_KEY = {"torch": "python3-torch", "torchvision": "python3-torchvision",
              "numpy": "python3-numpy", "scipy": "python3-scipy", "cv2": "python3-opencv",
              "psutil": "python3-psutil", "yaml": "python3-yaml", "PIL": "python3-pil",
              "matplotlib": "python3-matplotlib", "tqdm": "python3-tqdm",
              "rich": "python3-rich", "rosbags": "python3-rosbags-pip"}
# import name -> pip distribution, for the modules without a rosdep key
PIP_NAME = {"imagecorruptions": "imagecorruptions-imaug", "safetensors": "safetensors",
            "ray": "ray"}
# tried at run time with a fallback where present: NVML / jtop telemetry, triton kernels
OPTIONAL = {"pynvml", "jtop", "triton"}


def third_party_imports() -> dict[str, set[str]]:
    """{top-level module: the files importing it} over SOURCES (stdlib and ours left out)."""
    found: dict[str, set[str]] = {}
    for folder in SOURCES.values():
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def readme_pip_names(doc: Path = README) -> set[str]:
    """Distributions on the `pip install` lines of `doc`'s workspace block (the code
    block that runs `rosdep install`)."""
    blocks = doc.read_text().split("```")[1::2]
    (block,) = [b for b in blocks if "rosdep install" in b]
    names: set[str] = set()
    for line in block.splitlines():
        m = re.match(r"\s*pip install (.*?)(\s+#.*)?$", line)
        if m:
            names |= {w for w in m.group(1).split() if not w.startswith("-")}
    return names


def declared_keys() -> set[str]:
    pkg = parse_package(str(PACKAGE_XML))
    return {d.name for d in [*pkg.exec_depends, *pkg.build_export_depends]}


def test_the_import_scan_sees_the_known_imports() -> None:
    found = third_party_imports()
    assert {"torch", "rclpy", "yaml", "cv2", "safetensors", "imagecorruptions"} <= set(found)
    assert not {"os", "tta_core", "tta_kernels"} & set(found)


def test_every_third_party_import_is_installed_by_the_readme_lines() -> None:
    keys, pip = declared_keys(), readme_pip_names()
    assert pip, "no `pip install` line in README's workspace block"
    missing = {}
    for module, files in sorted(third_party_imports().items()):
        if module in OPTIONAL:
            continue
        if module in PIP_NAME:
            ok = PIP_NAME[module] in pip
            want = f"pip install {PIP_NAME[module]}"
        else:
            ok = ROSDEP_KEY.get(module, module) in keys
            want = f"<exec_depend>{ROSDEP_KEY.get(module, module)}</exec_depend>"
        if not ok:
            missing[module] = f"{want} (imported by {sorted(files)[0]})"
    assert not missing, missing


@pytest.mark.parametrize("doc", INSTALL_DOCS, ids=lambda p: p.name)
def test_the_pip_line_names_only_modules_without_a_key(doc: Path) -> None:
    """The pip line (README, the workspace how-to): exactly the modules rosdep cannot
    install."""
    used = set(third_party_imports())
    assert readme_pip_names(doc) == {PIP_NAME[m] for m in used & set(PIP_NAME)}


def test_every_package_the_launch_file_starts_is_an_exec_depend() -> None:
    args = {"config": str(CONFIG), "namespace": "", "image_topic": "image", "method": "",
            "sigma": "", "use_sim_time": "false", "log_level": "info", "rviz": "true",
            "rviz_config": "tta.rviz"}
    packages = {n["package"] for n in launch_nodes(args)}
    assert "rviz2" in packages
    assert packages - {"tta_ros"} <= declared_keys(), packages - declared_keys()
