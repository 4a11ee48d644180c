"""Environment checks behind `tta doctor`: is everything tta needs importable, and if
not, what exactly fixes it.

ROS 2 pieces are probed in a child interpreter, so tta_core itself never imports rclpy
and a broken ROS install cannot crash the check.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass

SETUP_FIX = "run `make setup`, then `source build/env.sh`"
PIP_FIX = "pip install -r requirements/base.txt -c requirements/constraints.txt"


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table."""

    name: str
    ok: bool
    required: bool
    detail: str
    fix: str = ""


def _module_version(name: str) -> tuple[bool, str]:
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # any import failure is a finding, not a crash
        return False, f"{type(exc).__name__}: {exc}"
    return True, str(getattr(mod, "__version__", "installed"))


def _python_checks() -> list[Check]:
    checks = []
    for name, required, fix in (
        ("torch", True, PIP_FIX),
        ("torchvision", True, PIP_FIX),
        ("numpy", True, SETUP_FIX),
        ("psutil", True, SETUP_FIX),
        ("imagecorruptions", True, "pip install imagecorruptions-imaug"),
        ("rosbags", True, "pip install rosbags"),
        ("safetensors", True, "pip install safetensors"),
        ("tta_kernels", True, SETUP_FIX + " (workspace: colcon build, source "
         "install/setup.bash)"),
    ):
        ok, detail = _module_version(name)
        checks.append(Check(name, ok, required, detail, "" if ok else fix))
    return checks


def _cuda_check() -> Check:
    try:
        import torch
    except Exception:
        return Check("cuda", False, False, "torch missing", "install torch first")
    if torch.cuda.is_available():
        return Check("cuda", True, False, torch.cuda.get_device_name(0))
    return Check("cuda", True, False, "not available: running on CPU (fine; GPU optional)")


def _jtop_check() -> Check:
    ok, detail = _module_version("jtop")
    if ok:
        return Check("jtop", True, False, detail)
    on_jetson = os.path.exists("/etc/nv_tegra_release")
    fix = "pip install jetson-stats (and run the jtop service)" if on_jetson else ""
    where = "Jetson without jtop" if on_jetson else "not installed (only used on a Jetson)"
    return Check("jtop", not on_jetson, False, where, fix)


_ROS_PROBE = r"""
import json, os
out = {}
try:
    import rclpy
    out["rclpy"] = [True, getattr(rclpy, "__file__", "")]
    try:
        from rclpy.utilities import get_rmw_implementation_identifier
        out["rmw"] = [True, get_rmw_implementation_identifier()]
    except Exception as exc:
        out["rmw"] = [False, f"{type(exc).__name__}: {exc}"]
except Exception as exc:
    out["rclpy"] = [False, f"{type(exc).__name__}: {exc}"]
    out["rmw"] = [False, "rclpy missing"]
try:
    from tta_msgs.msg import LayerPlan, LayerImportance, ResourceTelemetry
    from tta_msgs.msg import AdaptationStatus, ClassPrediction
    LayerPlan(update=[True])
    import tta_msgs
    out["tta_msgs"] = [True, os.path.dirname(tta_msgs.__file__)]
except Exception as exc:
    out["tta_msgs"] = [False, f"{type(exc).__name__}: {exc}"]
print("@@" + json.dumps(out))
"""


def _ros_checks(timeout_s: float = 60.0) -> list[Check]:
    fixes = {
        "rclpy": "pip install 'ros-rclpy[fastrtps]' (see requirements/base.txt), " + SETUP_FIX,
        "rmw": "pip install ros-rmw-fastrtps-cpp; export RMW_IMPLEMENTATION=rmw_fastrtps_cpp",
        "tta_msgs": "build msg/: " + SETUP_FIX + " (or colcon build in a ROS 2 workspace)",
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _ROS_PROBE], capture_output=True, text=True,
            timeout=timeout_s, env=os.environ.copy(),
        )
        line = next((s for s in proc.stdout.splitlines() if s.startswith("@@")), None)
        if line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"probe exited {proc.returncode}: {tail[0]}")
        found = json.loads(line[2:])
    except Exception as exc:
        found = {k: [False, f"probe failed: {exc}"] for k in fixes}
    return [
        Check(k, bool(found[k][0]), True, str(found[k][1]), "" if found[k][0] else fixes[k])
        for k in ("rclpy", "rmw", "tta_msgs")
    ]


def run_checks() -> list[Check]:
    """Every check, required ones first."""
    py = Check("python", sys.version_info >= (3, 10), True, sys.version.split()[0],
               "" if sys.version_info >= (3, 10) else "use Python >= 3.10")
    return [py, *_python_checks(), _cuda_check(), *_ros_checks(), _jtop_check()]


def healthy(checks: list[Check]) -> bool:
    """True when every required check passed."""
    return all(c.ok for c in checks if c.required)
