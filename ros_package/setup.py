"""Install tta_ros (ROS 2 ament_python package) together with tta_core and tta_kernels.

This folder is the package colcon finds (the repository root is no package, so colcon's
crawl also reaches msg/, the tta_msgs package); its tta_core, tta_ros, kernels, launch,
config, checkpoints and bags entries are links to the repository's folders. Works with
`colcon build` (plain or --symlink-install) and with `pip install -e ros_package` (make setup).
"""

import os
import sys
from glob import glob

from setuptools import find_packages, setup

PACKAGE = "tta_ros"
# `tta` on PATH in a sourced colcon workspace: setup.cfg sends the console scripts to
# lib/tta_ros (where `ros2 run` looks) and colcon puts <prefix>/bin on PATH, so bin/tta is a
# two-line wrapper. Not in wheels: pip writes its own `tta` console script into <venv>/bin.
WHEEL_COMMANDS = {"bdist_wheel", "editable_wheel", "dist_info"}
TTA_ON_PATH = [] if WHEEL_COMMANDS & set(sys.argv) else [("bin", ["bin/tta"])]

setup(
    name=PACKAGE,
    version="0.1.0",
    description="Responsive test-time adaptation for ROS 2 vehicles (AdaShadow + baselines).",
    license="Apache-2.0",
    maintainer="tta maintainers",
    maintainer_email="maintainers@tta-robotics.org",
    python_requires=">=3.10",
    packages=[*find_packages(include=["tta_core", "tta_core.*", "tta_ros", "tta_ros.*"]),
              "tta_kernels"],
    package_dir={"tta_kernels": "kernels"},
    package_data={"tta_core": ["py.typed"], "tta_kernels": ["daf_cpu.c", "bn_stats.c"]},
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        *TTA_ON_PATH,
        (f"share/{PACKAGE}/launch", glob("launch/*.launch.py")),
        (f"share/{PACKAGE}/config", glob("config/*.yaml") + glob("config/*.rviz")),
        (f"share/{PACKAGE}/checkpoints",
         [f for ext in ("pt", "safetensors", "json") for f in glob(f"checkpoints/*.{ext}")]),
        *[(f"share/{PACKAGE}/{d}", [f for f in glob(f"{d}/*") if os.path.isfile(f)])
          for d in sorted(glob("bags/*")) if os.path.isdir(d)],
    ],
    install_requires=["setuptools"],
    # colcon test picks pytest (not unittest) from the test extra; ament_python convention
    extras_require={"test": ["pytest", "pytest-timeout"]},
    zip_safe=False,
    entry_points={
        "console_scripts": [
            "tta = tta_core.cli:main",
            "perception_node = tta_ros.nodes.perception:main",
            "resource_monitor_node = tta_ros.nodes.resource_monitor:main",
            "scheduler_node = tta_ros.nodes.scheduler:main",
            "lifecycle_manager = tta_ros.nodes.lifecycle_manager:main",
            "bringup = tta_ros.bringup:main",
        ],
        # `tta` subcommands: each entry names a command module (tta_core.cli docstring)
        "tta.commands": [
            "bench = tta_core.cli.commands.bench",
            "calibrate = tta_core.cli.commands.calibrate",
            "doctor = tta_core.cli.commands.doctor",
            "make-bag = tta_core.cli.commands.make_bag",
            "make-benchmark = tta_core.cli.commands.make_benchmark",
            "model-card = tta_core.cli.commands.model_card",
            "predictor-bench = tta_core.cli.commands.predictor_bench",
            "prepare = tta_core.cli.commands.prepare",
            "profile = tta_core.cli.commands.profile",
            "sweep = tta_core.cli.commands.sweep",
            "train-corruption-encoder = tta_core.cli.commands.train_corruption_encoder",
            "train-darda = tta_core.cli.commands.train_darda",
            "train-elastic = tta_core.cli.commands.train_elastic",
            "train-source = tta_core.cli.commands.train_source",
            "demo = tta_ros.commands.demo",
            "replay = tta_ros.commands.replay",
        ],
        # folders where `tta` commands look up shipped files (tta_core.io.shipped)
        "tta.data_roots": ["tta_ros = tta_ros.paths:share_dir"],
    },
)
