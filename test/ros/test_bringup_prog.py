"""bringup names itself as it was started: `ros2 run tta_ros bringup` for the console
script colcon installs (argv[0] .../lib/tta_ros/bringup), `python -m tta_ros.bringup` for
the module, in --help and in its one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("rclpy")
from tta_ros.bringup import invoked_as

SCRIPT = "import sys\nfrom tta_ros.bringup import main\nsys.exit(main())\n"  # as setuptools


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_invoked_as() -> None:
    assert invoked_as("/ws/install/tta_ros/lib/tta_ros/bringup") == "ros2 run tta_ros bringup"
    assert invoked_as("/ws/src/tta_ros/bringup.py") == "python -m tta_ros.bringup"


def test_help_and_errors_name_the_console_script(tmp_path) -> None:
    script = tmp_path / "lib" / "tta_ros" / "bringup"
    script.parent.mkdir(parents=True)
    script.write_text(SCRIPT)
    out = _run([sys.executable, str(script), "--help"])
    assert out.returncode == 0 and out.stdout.startswith("usage: ros2 run tta_ros bringup ")
    bad = _run([sys.executable, str(script), "--set", "nodot"])
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].startswith("ros2 run tta_ros bringup: error: ")
    mod = _run([sys.executable, "-m", "tta_ros.bringup", "--help"])
    assert mod.returncode == 0 and mod.stdout.startswith("usage: python -m tta_ros.bringup ")
