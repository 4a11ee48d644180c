"""ros2 launch tta_ros vehicle.launch.py [config:=...] [image_topic:=...] [method:=...]
[sigma:=...]

Starts the same three nodes as `python -m tta_ros.bringup`, each in its own process, with
the same params file (config/vehicle.yaml). `method` / `sigma` are applied only when given
(empty default: the YAML value stands); sigma goes to perception and scheduler alike.
Importing this file has no side effects: launch imports happen inside the functions.
"""

import os

PACKAGE = "tta_ros"
# (node name, console script): the same list as tta_ros.bringup.NODES
NODES = (
    ("resource_monitor", "resource_monitor_node"),
    ("scheduler", "scheduler_node"),
    ("perception", "perception_node"),
)
SIGMA_NODES = ("perception", "scheduler")


def node_overrides(name, method, sigma):
    """Per-node parameter overrides from the launch arguments ('' means not given)."""
    out = {}
    if method and name == "perception":
        out["method"] = method
    if sigma and name in SIGMA_NODES:
        out["sigma"] = float(sigma)
    return out


def _nodes(context):
    from launch.substitutions import LaunchConfiguration
    from launch_ros.actions import Node

    config = LaunchConfiguration("config").perform(context)
    image_topic = LaunchConfiguration("image_topic").perform(context)
    method = LaunchConfiguration("method").perform(context)
    sigma = LaunchConfiguration("sigma").perform(context)
    actions = []
    for name, executable in NODES:
        extra = node_overrides(name, method, sigma)
        actions.append(Node(
            package=PACKAGE,
            executable=executable,
            name=name,
            output="screen",
            parameters=[config, extra] if extra else [config],
            remappings=[("image", image_topic)] if name == "perception" else [],
        ))
    return actions


def generate_launch_description():
    from ament_index_python.packages import get_package_share_directory
    from launch.actions import DeclareLaunchArgument, OpaqueFunction

    from launch import LaunchDescription

    default_config = os.path.join(get_package_share_directory(PACKAGE), "config",
                                  "vehicle.yaml")
    return LaunchDescription([
        DeclareLaunchArgument("config", default_value=default_config,
                              description="ROS 2 params file of the three nodes"),
        DeclareLaunchArgument("image_topic", default_value="image",
                              description="camera topic (sensor_msgs/Image)"),
        DeclareLaunchArgument("method", default_value="",
                              description="TTA method (empty: the params file's)"),
        DeclareLaunchArgument("sigma", default_value="",
                              description="latency budget fraction (empty: the params file's)"),
        OpaqueFunction(function=_nodes),
    ])
