"""Install tta_ros (ROS 2 ament_python package) together with tta_core and tta_kernels.

Works both with `colcon build` in a ROS 2 workspace and with `pip install -e .` in a venv.
"""

import os
from glob import glob

from setuptools import find_packages, setup

PACKAGE = "tta_ros"

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
    package_data={"tta_core": ["py.typed"]},
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.launch.py")),
        (f"share/{PACKAGE}/config", glob("config/*.yaml") + glob("config/*.rviz")),
        (f"share/{PACKAGE}/checkpoints", glob("checkpoints/*.pt") + glob("checkpoints/*.json")),
        *[(f"share/{PACKAGE}/{d}", [f for f in glob(f"{d}/*") if os.path.isfile(f)])
          for d in sorted(glob("bags/*")) if os.path.isdir(d)],
    ],
    install_requires=["setuptools"],
    zip_safe=False,
    entry_points={
        "console_scripts": [
            "tta = tta_core.cli:main",
            "perception_node = tta_ros.nodes.perception:main",
            "resource_monitor_node = tta_ros.nodes.resource_monitor:main",
            "scheduler_node = tta_ros.nodes.scheduler:main",
            "bringup = tta_ros.bringup:main",
        ],
        # `tta` subcommands: each entry names a command module (tta_core.cli docstring)
        "tta.commands": [
            "bench = tta_core.cli.commands.bench",
            "calibrate = tta_core.cli.commands.calibrate",
            "doctor = tta_core.cli.commands.doctor",
            "make-bag = tta_core.cli.commands.make_bag",
            "predictor-bench = tta_core.cli.commands.predictor_bench",
            "profile = tta_core.cli.commands.profile",
            "train-source = tta_core.cli.commands.train_source",
            "demo = tta_ros.commands.demo",
            "replay = tta_ros.commands.replay",
        ],
    },
)
