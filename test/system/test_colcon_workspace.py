"""The repository in a real colcon workspace, as README's "In a real ROS 2 workspace" does it.

colcon (from PyPI, over the ROS 2 wheels of the venv) builds the checkout copied into
`ws/src/tta` with a plain `colcon build` (no --paths: discovery must find both packages),
`colcon test` runs pytest in it (a representative part: COLCON_TESTS), and the normal
(non-symlink) install then serves `tta` on PATH, `tta demo`, `tta replay <installed
sample bag>` and `bringup` without --config from a directory outside the checkout. The
make-setup copy of tta_msgs is taken off every search path first, so what runs is what this
workspace built.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.ros]

SETUP_PREFIX = ROOT / "build" / "install"  # make setup's tta_msgs: hidden from the workspace
SKIP = (".git", ".venv", "build", "install", "log", "runs", "__pycache__", "*.egg-info")


def _copy_checkout(dst: Path) -> None:
    """The files git would clone (tracked + new, not ignored), links kept as links."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=False)
    if listed.returncode != 0:  # not a git checkout: copy the tree without build products
        shutil.copytree(ROOT, dst, symlinks=True, ignore=shutil.ignore_patterns(*SKIP))
        return
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src, out = ROOT / rel, dst / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree, not yet in the index
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)


def _without_setup_prefix(value: str) -> str:
    return os.pathsep.join(p for p in value.split(os.pathsep)
                           if p and not p.startswith(str(SETUP_PREFIX)))


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("AMENT_PREFIX_PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "CMAKE_PREFIX_PATH",
                "COLCON_PREFIX_PATH"):
        env[key] = _without_setup_prefix(env.get(key, ""))
    env["AMENT_PREFIX_PATH"] = env["AMENT_PREFIX_PATH"] or sys.prefix  # the ROS 2 wheels
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["ROS_DOMAIN_ID"] = str(100 + os.getpid() % 100)  # no crosstalk with other tests
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _bash(command: str, cwd: Path, env: dict[str, str], ws: Path, timeout: float = 300
          ) -> subprocess.CompletedProcess[str]:
    """`command` in bash with the workspace's install sourced (as a user's shell would be)."""
    script = f"source {ws / 'install' / 'setup.bash'} && {command}"
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A colcon workspace holding the checkout, built by a plain `colcon build`."""
    if shutil.which("colcon", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("colcon is not installed in the venv (requirements/python.txt has it)")
    ws = tmp_path_factory.mktemp("ws")
    _copy_checkout(ws / "src" / "tta")
    env = _environment()
    venv = sys.prefix
    proc = subprocess.run(
        ["colcon", "build", "--event-handlers", "console_cohesion+", "--cmake-args",
         f"-DCMAKE_PREFIX_PATH={venv}", f"-DPython3_EXECUTABLE={sys.executable}",
         "-DBUILD_TESTING=OFF", "-Wno-dev"],
        cwd=ws, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Summary: 2 packages finished" in proc.stdout, proc.stdout[-2000:]
    return ws, env


def test_plain_colcon_build_finds_and_installs_both_packages(workspace) -> None:
    ws, env = workspace
    listed = subprocess.run(["colcon", "list", "--names-only"], cwd=ws, env=env,
                            capture_output=True, text=True, check=True)
    assert listed.stdout.split() == ["tta_msgs", "tta_ros"]
    proc = _bash("python -c 'import tta_msgs.msg, tta_ros.paths as p; "
                 "print(tta_msgs.msg.__file__); print(p.package_file(\"config/vehicle.yaml\"))'",
                 ws, env, ws)
    assert proc.returncode == 0, proc.stderr[-2000:]
    msgs, config = proc.stdout.split()
    assert msgs.startswith(str(ws / "install" / "tta_msgs"))
    assert config == str(ws / "install/tta_ros/share/tta_ros/config/vehicle.yaml")


# What `colcon test` runs here: the whole suite takes ~22 min on 2 cores, past the default
# suite's budget, so one file of each tier plus the doctor tests, which failed only under
# colcon (its PYTHONPATH holds one install folder per package).
COLCON_TESTS = (
    "test/unit/test_bag.py",
    "test/ros/test_messages.py",
    "test/system/test_cli.py::test_doctor_passes_in_the_project_environment",
    "test/system/test_cli.py::test_doctor_fails_and_names_the_fix_when_tta_msgs_is_hidden",
    "test/system/test_cli.py::test_doctor_reports_a_missing_module_as_a_row_not_a_crash",
)


def test_colcon_test_runs_the_pytest_suite(workspace) -> None:
    """README's `colcon test` over a representative part of the suite (COLCON_TESTS):
    every listed test ran there and none failed."""
    ws, env = workspace
    proc = subprocess.run(
        ["colcon", "test", "--packages-select", "tta_ros", "--pytest-args", *COLCON_TESTS],
        cwd=ws, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    suite = ET.parse(ws / "build" / "tta_ros" / "pytest.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    assert int(suite.get("failures", 0)) == 0 and int(suite.get("errors", 0)) == 0
    assert int(suite.get("skipped", 0)) == 0
    ran = {(case.get("classname", "").split(".")[-1], case.get("name"))
           for case in suite.iter("testcase")}
    files = {Path(t.partition("::")[0]).stem for t in COLCON_TESTS}
    assert {f for f, _ in ran} == files, ran  # pytest ran each file (unittest finds none)
    assert {(Path(f).stem, name) for f, _, name in (t.partition("::") for t in COLCON_TESTS)
            if name} <= ran, ran


def test_installed_commands_work_outside_the_checkout(workspace, tmp_path) -> None:
    """`tta` on PATH; demo, replay of the installed sample bag and bringup without --config
    find the installed share files (no repository next to site-packages)."""
    ws, env = workspace
    share = ws / "install" / "tta_ros" / "share" / "tta_ros"
    which = _bash("command -v tta", tmp_path, env, ws)
    assert which.stdout.strip() == str(ws / "install" / "tta_ros" / "bin" / "tta")
    demo = _bash("tta demo --methods source --max-frames 16 --out demo", tmp_path, env, ws)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert (tmp_path / "demo" / "report.md").is_file()
    replay = _bash(f"tta replay {share / 'bags' / 'signs32_sample'} --max-frames 16 "
                   "--out replay", tmp_path, env, ws)
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
    assert (tmp_path / "replay" / "report.json").is_file()
    _bringup_serves_then_stops(ws, env, tmp_path)


def _bringup_serves_then_stops(ws: Path, env: dict[str, str], cwd: Path) -> None:
    """The installed `bringup` (no --config) starts the three nodes; SIGINT stops it, exit 0."""
    exe = ws / "install" / "tta_ros" / "lib" / "tta_ros" / "bringup"
    script = f"source {ws / 'install' / 'setup.bash'} && exec {exe}"
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ready: set[str] = set()
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    while len(ready) < 3 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        ready |= {n for n in ("perception", "scheduler", "resource_monitor")
                  if f"[{n}]: ready" in line}
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    assert ready == {"perception", "scheduler", "resource_monitor"}, rest[-2000:]
    assert proc.returncode == 0, rest[-2000:]
