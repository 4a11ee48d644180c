"""Parameter helpers shared by the tta nodes: descriptors with ranges, one spec; data paths.

Each node lists its parameters as `ParamSpec`s; `declare_all` declares them with a
ParameterDescriptor (description + FloatingPointRange/IntegerRange where numeric), so
`ros2 param describe` shows the range and rclpy itself refuses out-of-range values.

Start values: rclpy has no public getter for the values a node is given at start (params
files, `-p`, `parameter_overrides`), so each tta node is built with
`automatically_declare_parameters_from_overrides=True`: rclpy declares every given value,
`start_values` (the first thing declare_all does) reads them with
`get_parameters_by_prefix` and undeclares them again, and the node declares its own
parameters with their descriptors (rclpy's own, RCLPY_OWN, stay as rclpy declared them).
What no parameter takes stays undeclared and is named once at WARN (`report_unknown`, words
from tta_ros.param_report), as are run-time sets of an undeclared parameter (refused by
rclpy).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
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

from tta_core.io.shipped import find_data_file
from tta_ros.param_report import did_you_mean, refused_line, unknown_line, unknown_names
from tta_ros.paths import REPO_ROOT, share_dir

#: parameters rclpy declares itself where not declared yet (TimeSource,
#: TypeDescriptionService): never start values of ours, left declared
RCLPY_OWN = frozenset({"use_sim_time", "start_type_description_service"})


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

    def coerce(self, value: Any) -> Any:
        """A start value given for this parameter in the default's type: an int where a
        float is expected (`batch_timeout_s:=0`, YAML `rate_hz: 5`) becomes that float,
        in lists too; ValueError naming the value for any other type."""
        want = self.default
        if _is_int(value) and isinstance(want, float):
            return float(value)
        if isinstance(value, list | tuple) and isinstance(want, list | tuple):
            if want and isinstance(want[0], float):
                return [float(v) if _is_int(v) else v for v in value]
            return list(value)
        if type(value) is not type(want) and not (_is_int(value) and _is_int(want)):
            raise ValueError(f"{self.name}={value!r} is of type {type(value).__name__}, "
                             f"expected {type(want).__name__}")
        return value

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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class _Given:
    """What a node was given at start, and what it has said about it."""

    values: dict[str, Any]
    said: set[tuple[str, ...]] = field(default_factory=set)
    # why a name is no parameter, where the node knows better (perception: another
    # method's option); '' for the plain words
    why: Callable[[str], str] | None = None
    candidates: tuple[str, ...] = ()  # names a typo may have meant, besides the declared
    watching: bool = False  # run-time sets of undeclared parameters are named


_GIVEN: weakref.WeakKeyDictionary[Node, _Given] = weakref.WeakKeyDictionary()


def start_values(node: Node) -> dict[str, Any]:
    """The values `node` was given at start, by name (module docstring). Read on the first
    call, which must come before the node declares any parameter of its own (declare_all
    makes it); later calls return the same values."""
    given = _GIVEN.get(node)
    if given is None:
        values = {name: p.value for name, p in node.get_parameters_by_prefix("").items()
                  if name not in RCLPY_OWN}
        for name in values:
            node.undeclare_parameter(name)
        given = _GIVEN[node] = _Given(values)
    return dict(given.values)


def warn_once(node: Node, key: tuple[str, ...], line: str) -> None:
    """Log `line` at WARN unless `node` already said something under `key`."""
    given = _GIVEN.setdefault(node, _Given({}))
    if key not in given.said:
        given.said.add(key)
        node.get_logger().warning(line)


def declared_names(node: Node) -> list[str]:
    """The parameters `node` has declared."""
    return list(node.get_parameters_by_prefix(""))


def report_unknown(node: Node, handled: Collection[str] = (),
                   others: Collection[str] | None = None, candidates: Iterable[str] = (),
                   why: Callable[[str], str] | None = None) -> None:
    """Name at WARN, once each, the start values `node` declares no parameter for, except
    those `handled` elsewhere and those another node takes (`others`, None where unknown:
    param_report.unknown_names), with the closest of its parameters and `candidates`;
    and from now on each run-time set of an undeclared parameter (`why`, when given, says
    why for the names it knows). Call it once the node has declared its parameters; a
    later call only replaces `why` and `candidates`."""
    given = _GIVEN.setdefault(node, _Given({}))
    given.why, given.candidates = why, tuple(candidates)
    own = declared_names(node)
    for name in unknown_names(given.values, own, handled, others):
        warn_once(node, ("unknown", name), unknown_line(
            node.get_name(), name, given.values[name], [*own, *given.candidates]))
    given.watching = True


def _refused(node: Node, param: Parameter) -> None:
    """A run-time set of the undeclared `param`: say why it is refused (report_unknown)."""
    given = _GIVEN.get(node)
    if given is None or not given.watching:
        return
    why = given.why(param.name) if given.why else ""
    if not why:
        why = f"no parameter of {node.get_name()}" + did_you_mean(
            param.name, [*declared_names(node), *given.candidates])
    warn_once(node, ("set", param.name, why), refused_line(param.name, param.value, why))


def declare_all(node: Node, specs: Sequence[ParamSpec]) -> None:
    """Declare every spec on `node`; a value given at start (start_values) wins, in the
    spec's type (ParamSpec.coerce: `0` for a float parameter is 0.0); run-time changes take
    ints for floats too (accept_ints_for_floats)."""
    given = start_values(node)
    for spec in specs:
        value = spec.coerce(given[spec.name]) if spec.name in given else spec.default
        # a node built without automatic declaration has no start values here: rclpy then
        # applies a given value itself
        node.declare_parameter(spec.name, value, spec.descriptor(),
                               ignore_override=spec.name in given)
    accept_ints_for_floats(node)


#: (declared type, type given) -> conversion of a run-time value that loses nothing
_WIDEN = {(Parameter.Type.DOUBLE, Parameter.Type.INTEGER): float,
          (Parameter.Type.DOUBLE_ARRAY, Parameter.Type.INTEGER_ARRAY):
              lambda v: [float(x) for x in v]}


def accept_ints_for_floats(node: Node) -> None:
    """Let run-time changes give an int for a float parameter (`ros2 param set /scheduler
    sigma 1`: the CLI sends an INTEGER, which rclpy refuses for a DOUBLE parameter before
    any on-set callback): a pre-set callback turns it into that float, for every declared
    parameter of `node` (its own and method.*). A set of an undeclared parameter is
    named in the log (report_unknown) before rclpy refuses it: rclpy runs one chain of
    pre-set callbacks and joins what each returns, so this is the node's only one."""
    def widen(params: list[Parameter]) -> list[Parameter]:
        out = []
        for p in params:
            declared = (Parameter.Type(node.describe_parameter(p.name).type)
                        if node.has_parameter(p.name) else None)
            if declared is None:
                _refused(node, p)
            conv = _WIDEN.get((declared, p.type_))
            out.append(Parameter(p.name, declared, conv(p.value)) if conv else p)
        return out

    node.add_pre_set_parameters_callback(widen)


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


def declare_checked(node: Node, specs: Sequence[ParamSpec]) -> dict[str, Any]:
    """declare_all, then the values, checked (check_initial): what a node's constructor
    starts with."""
    declare_all(node, specs)
    current = values(node, specs)
    check_initial(specs, current)
    return current


PATH_PARAMS = ("model_card", "profile")


def resolve_data_path(value: str, base: Path | None = None) -> str:
    """A path parameter as a usable path: '' and absolute paths unchanged; a relative one is
    looked up in the working directory, `base` (default: the repository root) and the
    package share directory (where colcon installs checkpoints/, config/, bags/), first hit
    wins: the lookup of every `tta` command (tta_core.io.shipped). When none exists it is
    returned relative to `base`, so the loader's error names it.
    """
    if not value or Path(value).is_absolute():
        return value
    base = REPO_ROOT if base is None else base
    share = share_dir()
    found = find_data_file(value, base, [share] if share else [])
    return str(found) if found is not None else str(base / value)


def resolve_output_path(value: str) -> str:
    """A path parameter of a file the node writes, as an absolute path: relative to the
    working directory (never looked up elsewhere, unlike resolve_data_path); '' stays ''."""
    return str((Path.cwd() / Path(value).expanduser()).resolve()) if value else ""


def resolve_paths(params: dict[str, Any], base: Path | None = None) -> dict[str, Any]:
    """`params` with its model_card/profile values resolved by resolve_data_path."""
    return {k: resolve_data_path(v, base) if k in PATH_PARAMS and isinstance(v, str) else v
            for k, v in params.items()}
