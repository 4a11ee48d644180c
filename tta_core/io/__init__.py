"""I/O: sensor_msgs/Image conversion and rosbag2 files (no rclpy)."""
