"""Where the package's shipped files are: the source checkout or the installed share folder.

No rclpy here: `tta` commands import it to fill in their defaults before ROS is set up.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = "tta_ros"
REPO_ROOT = Path(__file__).resolve().parent.parent  # a source checkout; site-packages if not


def share_dir(package: str = PACKAGE) -> Path | None:
    """The package's ament share directory (colcon install), or None when not installed."""
    try:
        from ament_index_python.packages import PackageNotFoundError, get_package_share_directory
    except ImportError:
        return None
    try:
        return Path(get_package_share_directory(package))
    except (PackageNotFoundError, ValueError):
        return None


def package_file(relative: str) -> Path:
    """A file the package ships (config/vehicle.yaml, bags/...): the source checkout's copy
    when running from one, else the installed share folder's (a non-symlink colcon install
    has no repository next to site-packages), else the checkout path (for the error)."""
    in_checkout = REPO_ROOT / relative
    share = share_dir()
    if not in_checkout.exists() and share is not None and (share / relative).exists():
        return share / relative
    return in_checkout
