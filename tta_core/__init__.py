"""tta_core: responsive test-time adaptation (AdaShadow and baselines) in plain PyTorch.

Never imports rclpy: the ROS glue lives in tta_ros.
"""

__version__ = "0.1.0"
