"""tta_ros: the rclpy nodes and ROS glue of tta. Holds no algorithm: that is tta_core."""
