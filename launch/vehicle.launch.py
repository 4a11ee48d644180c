"""ros2 launch tta_ros vehicle.launch.py [namespace:=car1] [image_topic:=...] [method:=...]
[sigma:=...] [task:=segmentation] [model_card:=...] [use_sim_time:=true] [log_level:=debug]
[autostart:=false] [rviz:=true] [config:=...]

Starts the same three nodes as `python -m tta_ros.bringup`, each in its own process, as
managed (lifecycle) nodes that start unconfigured, and tta_ros.nodes.lifecycle_manager
beside them: with `autostart` (default true) it configures and then activates them in
order (resource_monitor, scheduler, perception); `autostart:=false` leaves them
unconfigured, serving nothing, until `ros2 service call /lifecycle_manager/startup
std_srvs/srv/Trigger` or `ros2 lifecycle set /perception configure` (and so on). Each
node gets a dict of parameters from tta_ros.launch_params.launch_nodes, the plain function
bringup uses too (node_parameters): the params file's `/**` and the node's own section (and
a `/ns/node` section for this namespace), then the launch arguments. Not the params file
path: launch_ros would write the overrides under `/**`, where the node's own YAML section
beats them, and a pushed namespace would drop the bare `perception:` sections.
`method` / `sigma` apply only when given (empty: the YAML value stands); sigma goes to
perception (its method option method.sigma) and scheduler alike. `task:=segmentation`
serves the shipped segmentation card (checkpoints/lraspp_mobilenet_v3_large_scenes.json)
with method tent, unless `model_card` / `method` say otherwise: perception then publishes
`segmentation` (mono8 class ids) and `segmentation_overlay` (rgb8) instead of
`predictions`; `model_card` sets the card of perception and scheduler. `namespace` (relative
ones go under a PushRosNamespace of an including file) puts the nodes and all their topics
under it. `rviz:=true` also starts RViz with config/tta.rviz, remapped to the namespace's
topics (RViz shows the camera, the segmentation mask and overlay, and the layer markers).
Importing this file has no side effects: launch imports happen inside the functions.
"""

import os

PACKAGE = "tta_ros"
# name, default ('' = from the package share folder), description
ARGUMENTS = (
    ("config", "", "ROS 2 params file of the three nodes (default: the shipped vehicle.yaml)"),
    ("namespace", "", "namespace of the nodes and their topics, e.g. car1 (empty: none)"),
    ("image_topic", "image", "camera topic (sensor_msgs/Image), relative to the namespace"),
    ("method", "", "TTA method (empty: the params file's)"),
    ("sigma", "", "latency budget fraction: perception's method.sigma and the scheduler's "
     "sigma (empty: the params file's)"),
    ("task", "", "segmentation: the shipped segmentation card with method tent (unless "
     "model_card / method are given); empty or classification: the params file's card"),
    ("model_card", "", "model card of perception and scheduler (empty: the params file's "
     "or the task's)"),
    ("use_sim_time", "false", "use /clock time (true when replaying a bag with --clock)"),
    ("log_level", "info", "log level of the nodes (debug, info, warn, error, fatal)"),
    ("autostart", "true", "bring the nodes to active (lifecycle manager); false: leave them "
     "unconfigured, serving nothing"),
    ("rviz", "false", "also start RViz with config/tta.rviz"),
)


def _nodes(context):
    from launch.substitutions import LaunchConfiguration
    from launch_ros.actions import Node

    from tta_ros.launch_params import launch_nodes

    args = {name: LaunchConfiguration(name).perform(context) for name, _, _ in ARGUMENTS}
    args["rviz_config"] = LaunchConfiguration("rviz_config").perform(context)
    pushed = context.launch_configurations.get("ros_namespace", None)
    return [Node(**kwargs) for kwargs in launch_nodes(args, pushed)]


def generate_launch_description():
    from ament_index_python.packages import get_package_share_directory
    from launch.actions import DeclareLaunchArgument, OpaqueFunction

    from launch import LaunchDescription

    share = get_package_share_directory(PACKAGE)
    defaults = {"config": os.path.join(share, "config", "vehicle.yaml")}
    return LaunchDescription([
        *(DeclareLaunchArgument(name, default_value=defaults.get(name, default),
                                description=description)
          for name, default, description in ARGUMENTS),
        DeclareLaunchArgument("rviz_config",
                              default_value=os.path.join(share, "config", "tta.rviz"),
                              description="RViz config used when rviz:=true"),
        OpaqueFunction(function=_nodes),
    ])
