"""The test tiers stay what `make test-fast` assumes: test files only in test/unit, test/ros
and test/system; no test module imports another (shared code lives in test/helpers); the
unit tier and the rclpy-free helpers import nothing of ROS."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

TEST = ROOT / "test"
TIERS = ("unit", "ros", "system")
ROS_MODULES = ("rclpy", "tta_msgs", "tta_ros", "sensor_msgs", "diagnostic_msgs",
               "visualization_msgs", "std_msgs", "builtin_interfaces", "helpers.ros")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _is_under(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def test_every_test_file_is_in_a_tier() -> None:
    stray = [p.relative_to(TEST) for p in TEST.rglob("test_*.py")
             if p.relative_to(TEST).parts[0] not in TIERS]
    assert not stray, f"move these into test/unit, test/ros or test/system: {stray}"


def test_no_test_module_imports_another() -> None:
    bad = {str(p.relative_to(TEST)): sorted(m for m in _imports(p) if m.startswith("test_"))
           for p in TEST.rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}, "import shared code from test/helpers"


def test_unit_tier_and_plain_helpers_import_nothing_of_ros() -> None:
    files = [*(TEST / "unit").rglob("*.py"), TEST / "helpers" / "__init__.py",
             TEST / "helpers" / "models.py"]
    assert len(files) > 10
    bad = {str(p.relative_to(TEST)): sorted(m for m in _imports(p) if _is_under(m, ROS_MODULES))
           for p in files}
    assert not {k: v for k, v in bad.items() if v}, "these belong in test/ros"


def test_the_import_scan_sees_function_level_ros_imports(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_x():\n    from helpers.ros import Rig\n    import test_other\n")
    got = _imports(probe)
    assert _is_under("helpers.ros.Rig", ROS_MODULES) and "helpers.ros" in got
    assert "test_other" in got
