"""Parameter helpers shared by the tta nodes: descriptors with ranges, one spec; data paths.

Each node lists its parameters as `ParamSpec`s; `declare_all` declares them with a
ParameterDescriptor (description + FloatingPointRange/IntegerRange where numeric), so
`ros2 param describe` shows the range and rclpy itself refuses out-of-range values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rcl_interfaces.msg import (
    FloatingPointRange,
    IntegerRange,
    ParameterDescriptor,
    SetParametersResult,
)
from rclpy.node import Node
from rclpy.parameter import Parameter

from tta_ros.paths import REPO_ROOT, share_dir


@dataclass(frozen=True)
class ParamSpec:
    """One node parameter: name, default, description, numeric range or allowed choices."""

    name: str
    default: Any
    description: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    read_only: bool = False

    def descriptor(self) -> ParameterDescriptor:
        desc = self.description
        if self.choices:
            desc += f" (one of: {', '.join(self.choices)})"
        d = ParameterDescriptor(description=desc, read_only=self.read_only)
        if self.low is not None and self.high is not None:
            if isinstance(self.default, bool):
                raise ValueError(f"parameter {self.name!r}: a bool has no range")
            if isinstance(self.default, int):
                d.integer_range = [IntegerRange(from_value=int(self.low),
                                                to_value=int(self.high), step=1)]
            else:
                d.floating_point_range = [FloatingPointRange(
                    from_value=float(self.low), to_value=float(self.high), step=0.0)]
        return d

    def check(self, value: Any) -> str:
        """'' when `value` is acceptable, else the reason (names the value)."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{self.name}={value!r} is not finite"
        if self.low is not None and self.high is not None and isinstance(value, int | float) \
                and not isinstance(value, bool) and not self.low <= value <= self.high:
            return f"{self.name}={value!r} outside [{self.low:g}, {self.high:g}]"
        if self.choices and value not in self.choices:
            return f"{self.name}={value!r} not one of {', '.join(self.choices)}"
        return ""


def declare_all(node: Node, specs: Sequence[ParamSpec]) -> None:
    """Declare every spec on `node` (values from overrides / params files win)."""
    for spec in specs:
        node.declare_parameter(spec.name, spec.default, spec.descriptor())


def values(node: Node, specs: Iterable[ParamSpec]) -> dict[str, Any]:
    """Current value of each spec'd parameter, by name."""
    return {s.name: node.get_parameter(s.name).value for s in specs}


def validate(specs: Sequence[ParamSpec], params: Sequence[Parameter],
             runtime: Iterable[str] | None = None) -> SetParametersResult:
    """on_set_parameters callback body: refuse the first bad value with its reason, and
    (when `runtime` names the parameters that may change while running) any other one."""
    by_name = {s.name: s for s in specs}
    allowed = None if runtime is None else set(runtime)
    for p in params:
        spec = by_name.get(p.name)
        if spec is None:
            continue
        if allowed is not None and p.name not in allowed:
            return SetParametersResult(successful=False,
                                       reason=f"{p.name} cannot change at run time")
        reason = spec.check(p.value)
        if reason:
            return SetParametersResult(successful=False, reason=reason)
    return SetParametersResult(successful=True)


def check_initial(specs: Sequence[ParamSpec], current: dict[str, Any]) -> None:
    """Raise ValueError naming the first bad value among the declared parameters."""
    for spec in specs:
        reason = spec.check(current[spec.name])
        if reason:
            raise ValueError(reason)


PATH_PARAMS = ("model_card", "profile")


def resolve_data_path(value: str, base: Path | None = None) -> str:
    """A path parameter as a usable path: '' and absolute paths unchanged; a relative one is
    looked up in the working directory, `base` (default: the repository root) and the
    package share directory (where colcon installs checkpoints/, config/, bags/), first hit
    wins. When none exists it is returned relative to `base`, so the loader's error names it.
    """
    if not value or Path(value).is_absolute():
        return value
    base = REPO_ROOT if base is None else base
    share = share_dir()
    for root in (Path.cwd(), base, *([share] if share else [])):
        if (root / value).exists():
            return str((root / value).resolve())
    return str(base / value)


def resolve_output_path(value: str) -> str:
    """A path parameter of a file the node writes, as an absolute path: relative to the
    working directory (never looked up elsewhere, unlike resolve_data_path); '' stays ''."""
    return str((Path.cwd() / Path(value).expanduser()).resolve()) if value else ""


def resolve_paths(params: dict[str, Any], base: Path | None = None) -> dict[str, Any]:
    """`params` with its model_card/profile values resolved by resolve_data_path."""
    return {k: resolve_data_path(v, base) if k in PATH_PARAMS and isinstance(v, str) else v
            for k, v in params.items()}
