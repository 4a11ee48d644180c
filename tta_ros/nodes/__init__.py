"""The three rclpy nodes: perception, resource monitor, scheduler."""
