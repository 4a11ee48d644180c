"""`tta` subcommands that need ROS 2 (discovered by tta_core.cli)."""
