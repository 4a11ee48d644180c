"""The selected method's options as `method.<field>` parameters of the perception node.

Generated from the method's config dataclass (tta_core.runtime.options.describe), so a new
config field is a new parameter without a change here or in the node:

- type: bool, int, float, str and lists of them -> the ROS parameter type of that name;
- range -> IntegerRange / FloatingPointRange (inclusive; an open bound such as "> 0" is
  left to the config's own validation), choices -> listed in the description, enforced;
- an optional field (None allowed) takes 0 (numbers), '' (strings) or [] (lists) for None,
  and its description says so (the range is widened to hold that value);
- a field with `settable=False` (input_shape, arch) is no parameter: the node fills it in
  from the model card;
- `path='read'` values are looked up like model_card (tta_ros.ros_params.resolve_data_path)
  and must exist; `path='write'` ones are taken relative to the working directory.

`MethodOptions.check` validates a change: each value's type, range and choices, then the
whole config built with the method's `make_config` and checked by its own `validate` /
`check`; a refusal is that check's one-line reason. `check_precision_param` adds what
needs the node's device: `method.precision` must be one the method takes, fp16 only on
CUDA. `check_live` refuses what
the running method's setters cannot take (a size it does not serve), `apply_live` hands
changed values to them (set_lr, set_sigma, set_deadline, set_size); whatever has no
setter, or is marked `runtime=False` (a built method cannot take it), needs a rebuild.

`report_given` says, at WARN and once each, what the node was given and cannot take
(tta_ros.param_report): method.* values someone set for options the method lacks
(`method:=tent sigma:=0.5`; a value at the option's default is nobody's setting), values
for no parameter at all with the closest one, and run-time sets of either. `own_options`
keeps of a node's parameters only the options its method has (the demo replays one
params file with several methods).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.node import Node
from rclpy.parameter import Parameter

from tta_core.api import DeadlineTunable, Resizable, RuntimeTunable, TTAMethodLike
from tta_core.errors import one_line
from tta_core.registry import available_methods, method_class
from tta_core.runtime.deadline import DeadlineConfig
from tta_core.runtime.options import OptionInfo, check_value, describe
from tta_core.runtime.precision import precision_error
from tta_ros.param_report import foreign_line, set_values
from tta_ros.ros_params import (
    report_unknown,
    resolve_data_path,
    resolve_output_path,
    start_values,
    warn_once,
)

PREFIX = "method."
DEADLINE_KEYS = tuple(f.name for f in dataclasses.fields(DeadlineConfig))
_TYPES = {"bool": Parameter.Type.BOOL, "int": Parameter.Type.INTEGER,
          "float": Parameter.Type.DOUBLE, "str": Parameter.Type.STRING,
          "list[bool]": Parameter.Type.BOOL_ARRAY, "list[int]": Parameter.Type.INTEGER_ARRAY,
          "list[float]": Parameter.Type.DOUBLE_ARRAY, "list[str]": Parameter.Type.STRING_ARRAY}
_UNSET = {"bool": False, "int": 0, "float": 0.0, "str": ""}
_INT64 = 2**63 - 1
# fields a running method can take (apply_live); activation_budget_mb only where the
# method already runs a DAF codec, which reads it before every batch
LIVE = {"lr", "sigma", "keep", "activation_budget_mb", *DEADLINE_KEYS}
_IS = {"bool": lambda v: isinstance(v, bool),
       "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
       "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
       "str": lambda v: isinstance(v, str)}


@dataclasses.dataclass(frozen=True)
class MethodParam:
    """One config field as the parameter `method.<field>`."""

    info: OptionInfo

    @property
    def name(self) -> str:
        return PREFIX + self.info.name

    @property
    def ros_type(self) -> Parameter.Type:
        return _TYPES[self.info.type]

    @property
    def unset(self) -> Any:
        """The ROS value that stands for None (optional fields)."""
        return [] if self.info.is_list else _UNSET[self.info.type]

    def ros_value(self, value: Any) -> Any:
        """A config value as this parameter's value (None -> the unset value)."""
        if value is None:
            return self.unset
        if self.info.is_list:
            return [self._scalar(v) for v in value]
        return self._scalar(value)

    def _scalar(self, value: Any) -> Any:
        kind = self.info.scalar
        return float(value) if kind == "float" else str(value) if kind == "str" else value

    def coerce(self, value: Any) -> Any:
        """`value` in this parameter's type where that loses nothing (an int for a float
        option, a tuple for a list); anything else unchanged (check refuses it)."""
        def one(v: Any) -> Any:
            return float(v) if self.info.scalar == "float" and _IS["int"](v) else v
        if self.info.is_list:
            return [one(v) for v in value] if isinstance(value, list | tuple) else value
        return one(value)

    def config_value(self, value: Any) -> Any:
        """This parameter's value as the config takes it: None for the unset value of an
        optional field, a tuple for a list, a resolved path for a path option."""
        if self.info.optional and value == self.unset:
            return None
        if self.info.is_list:
            return tuple(value)
        if self.info.path == "read":
            return resolve_data_path(value)
        if self.info.path == "write":
            return resolve_output_path(value)
        return value

    def check(self, value: Any) -> str:
        """'' when `value` is in range and among the choices (and a read path exists),
        else the reason naming the parameter and the value."""
        if self.info.optional and value == self.unset:
            return ""
        items = value if self.info.is_list and isinstance(value, list | tuple) else [value]
        if (self.info.is_list and items is not value) or not all(
                map(_IS[self.info.scalar], items)):
            return f"{self.name}={value!r} is not a {self.info.type}"
        reason = check_value(self.info, list(value) if self.info.is_list else value)
        if reason:
            return PREFIX + reason
        if self.info.path == "read" and value and not Path(resolve_data_path(value)).exists():
            return f"{self.name}={value!r}: no such file"
        return ""

    def descriptor(self) -> ParameterDescriptor:
        """Description (help, choices, what None is) and the numeric range."""
        info, text = self.info, self.info.help
        if info.choices:
            text += f" (one of: {', '.join(str(c) for c in info.choices)})"
        if info.optional:
            text += f" [{self.unset!r} = None]"
        if not info.runtime:
            text += " (a change rebuilds the method)"
        d = ParameterDescriptor(description=text, type=self.ros_type.value)
        if (info.low is None and info.high is None) or info.scalar not in ("int", "float"):
            return d
        low = -math.inf if info.low is None else info.low
        high = math.inf if info.high is None else info.high
        if info.optional:
            low, high = min(low, 0), max(high, 0)
        if info.scalar == "int":
            d.integer_range = [IntegerRange(from_value=int(max(low, -_INT64)),
                                            to_value=int(min(high, _INT64)), step=1)]
        else:
            d.floating_point_range = [FloatingPointRange(from_value=float(low),
                                                         to_value=float(high), step=0.0)]
        return d


def method_params(method: str) -> dict[str, MethodParam]:
    """The parameters of method `method`, by name: every settable config field."""
    return {p.name: p for p in (MethodParam(i) for i in describe(method_class(method).config_cls)
                                if i.settable)}


def option_defaults() -> dict[str, list[Any]]:
    """Every method's options, by parameter name: the ROS default in each method that has
    it."""
    out: dict[str, list[Any]] = {}
    for method in available_methods():
        for name, p in method_params(method).items():
            out.setdefault(name, []).append(p.ros_value(p.info.default))
    return out


def own_options(params: Mapping[str, Any], method: str) -> dict[str, Any]:
    """`params` without the method.* values method `method` has no option for."""
    own = method_params(method)
    return {k: v for k, v in params.items() if not k.startswith(PREFIX) or k in own}


def _no_option(method: str, options: Mapping[str, Any], name: str) -> str:
    """Why `name` is no parameter while `method` runs: '' unless it is another method's
    option."""
    return f"method {method} has no option {name[len(PREFIX):]!r}" if name in options else ""


def report_given(node: Node, opts: MethodOptions) -> None:
    """What the perception node says about its start values once `opts.method`'s
    parameters are declared (module docstring): the method.* values set for options the
    method lacks, in one line naming it; values for no parameter of the node (the first
    time); from then on run-time sets of undeclared parameters, another method's option
    named as such."""
    from tta_ros.nodes.node_params import taken_elsewhere

    options = option_defaults()
    given = start_values(node)
    foreign = set_values({k: v for k, v in given.items()
                          if k in options and k not in opts.params}, options)
    if line := foreign_line(opts.method, foreign):
        warn_once(node, ("method", opts.method), line)
    report_unknown(node, handled=options, others=taken_elsewhere("perception"),
                   candidates=options, why=functools.partial(_no_option, opts.method, options))


def check_config(method: str, config: Mapping[str, Any]) -> str:
    """'' when `config` builds a valid config of `method` (make_config, then the config's
    own validate/check), else the reason in one line."""
    try:
        cfg = method_class(method).make_config(**config)
        check = getattr(cfg, "validate", None) or getattr(cfg, "check", None)
        if check is not None:
            check()
    except (TypeError, ValueError) as exc:
        return f"method {method}: {one_line(exc)}"
    return ""


class MethodOptions:
    """The selected method's parameters and their current values (ROS form)."""

    def __init__(self, method: str, overrides: Mapping[str, Any] | None = None) -> None:
        """`overrides`: values given at start (params file, -p), by parameter name."""
        self.method = method
        self.params = method_params(method)
        self.filled = {i.name for i in describe(method_class(method).config_cls)
                       if not i.settable}  # fields the node fills in (from the model card)
        given = overrides or {}
        self.values = {name: p.coerce(given[name]) if name in given
                       else p.ros_value(p.info.default) for name, p in self.params.items()}

    def config(self, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Config keyword arguments from the current values updated by `values`."""
        merged = {**self.values, **(values or {})}
        return {p.info.name: p.config_value(merged[name]) for name, p in self.params.items()}

    def get(self, field: str, default: Any = None) -> Any:
        """The config value of `field`, or `default` when the method has no such option."""
        name = PREFIX + field
        return self.params[name].config_value(self.values[name]) if name in self.params \
            else default

    def check(self, changes: Mapping[str, Any]) -> str:
        """'' when the values updated by `changes` (parameter name -> ROS value) are each
        valid and make a valid config, else the first reason."""
        for name, value in changes.items():
            param = self.params.get(name)
            if param is None:
                return f"{name}: method {self.method} has no option {name[len(PREFIX):]!r}"
            if reason := param.check(value):
                return reason
        return check_config(self.method, self.config(changes))


def check_precision_param(method: str, value: Any, device: Any) -> str:
    """'' when `method.precision=value` can run: a precision the method's forwards take
    (TTAMethod.precisions) on the node's `device` (fp16: CUDA only), else why not."""
    if value is None:
        return ""
    if reason := precision_error(value, device):
        return PREFIX + reason
    takes = getattr(method_class(method), "precisions", ("fp32",))
    if value not in takes:
        return (f"{PREFIX}precision={value!r}: method {method} serves "
                f"{', '.join(takes)} only")
    return ""


def check_live(method: TTAMethodLike, changed: Mapping[str, Any]) -> str:
    """'' when the running method's setters can take `changed` (field -> config value),
    else why not: a size (keep) a Resizable method does not serve."""
    keep = changed.get("keep")
    if keep is not None and isinstance(method, Resizable) and keep not in method.sizes():
        return (f"{PREFIX}keep={keep!r} is no size of method {method.name} (sizes: "
                f"{', '.join(f'{s:g}' for s in method.sizes())})")
    return ""


def apply_live(method: TTAMethodLike, changed: Mapping[str, Any]) -> set[str]:
    """Hand changed config values (field -> value) to the method's setters; the fields it
    has no setter for (they need a rebuild of the method)."""
    rest = set(changed)
    if not rest <= LIVE:
        return rest  # a rebuild takes them all
    if changed.get("lr") is not None:
        method.set_lr(float(changed["lr"]))
        rest.discard("lr")
    if "sigma" in changed and isinstance(method, RuntimeTunable):
        method.set_sigma(float(changed["sigma"]))
        rest.discard("sigma")
    deadline = {k: v for k, v in changed.items() if k in DEADLINE_KEYS}
    if deadline and isinstance(method, DeadlineTunable):
        method.set_deadline(**deadline)
        rest -= set(deadline)
    if "keep" in changed and isinstance(method, Resizable):
        method.set_size(changed["keep"])
        rest.discard("keep")
    budget = changed.get("activation_budget_mb")
    if budget is not None and getattr(method, "codec", None) is not None:
        method.finish()  # the codec reads the config before the next batch's forward
        method.config.activation_budget_mb = float(budget)
        rest.discard("activation_budget_mb")
    return rest
