"""Method options that describe themselves: config dataclass fields with help and limits.

A method config declares each field with `option(default, help, ...)`, a
`dataclasses.field` whose metadata carries the help text, an inclusive numeric range,
the allowed choices, whether a built method can take a change of the value (`runtime`;
False: a host rebuilds the method to change it), whether a user
sets it at all (`settable=False`: the code that builds the method fills it in, e.g.
`input_shape` and `arch` from the model card) and whether it names a file (`path`).
`describe(config_cls)` lists every field as an `OptionInfo` with a plain type (bool, int,
float, str, or list[...] of those; `optional` when None is allowed), so a host (the ROS
perception node, a command line) exposes a method's options without knowing the method.
Ranges are what the field's own validation accepts at most; the config's validation
(`validate`/`check`) stays the judge of combinations and of open bounds. No ROS here.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["OPTION_KEY", "PATH_KINDS", "SCALARS", "OptionInfo", "check_value", "describe",
           "option"]

OPTION_KEY = "tta_option"  # dataclasses.field metadata key
SCALARS = ("bool", "int", "float", "str")
PATH_KINDS = ("", "read", "write")  # read: a data file looked up; write: a file written


@dataclasses.dataclass(frozen=True)
class _Meta:
    help: str
    low: float | None
    high: float | None
    choices: tuple[Any, ...]
    runtime: bool
    settable: bool
    path: str


def option(default: Any, help: str, *, low: float | None = None, high: float | None = None,
           choices: Sequence[Any] = (), runtime: bool = True, settable: bool = True,
           path: str = "") -> Any:
    """A dataclass field with `default` (a list/dict/set is copied per instance) and its
    description: `help`, inclusive range [low, high] (either may be None: open),
    `choices`, `runtime` (False: a built method cannot take a change, even through a
    setter: a host rebuilds it), `settable` (False: filled in by the builder, not a user
    setting), `path` ('read' / 'write': a file)."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"option range [{low}, {high}] is empty")
    if path not in PATH_KINDS:
        raise ValueError(f"option path {path!r} not one of {PATH_KINDS}")
    meta = {OPTION_KEY: _Meta(help, low, high, tuple(choices), runtime, settable, path)}
    if isinstance(default, list | dict | set):
        return dataclasses.field(default_factory=lambda: copy.copy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class OptionInfo:
    """One config field as a host sees it. `type` is a scalar of SCALARS, `list[<scalar>]`,
    or `unsupported: <annotation>` (a field no host can set; describe's tests refuse it)."""

    name: str
    type: str
    optional: bool
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] = ()
    runtime: bool = True
    settable: bool = True
    path: str = ""

    @property
    def expressible(self) -> bool:
        """Whether `type` is a scalar or a list of one."""
        return self.type in SCALARS or self.type in {f"list[{s}]" for s in SCALARS}

    @property
    def is_list(self) -> bool:
        return self.type.startswith("list[")

    @property
    def scalar(self) -> str:
        """The element type of a list, else the type itself."""
        return self.type[5:-1] if self.is_list else self.type


def _scalar(tp: Any) -> str:
    if tp is bool:
        return "bool"
    if tp is int:
        return "int"
    if tp is float:
        return "float"
    if tp is str or tp is Path:
        return "str"
    return ""


def _kind(tp: Any) -> tuple[str, bool]:
    """(type name, optional) of an annotation; ('unsupported: ...', ...) when no plain
    type fits. A union of str with other path-like types (Path, a loaded object) is a str."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        optional = len(rest) < len(args)
        kinds = [_kind(a)[0] for a in rest]
        plain = {k for k in kinds if not k.startswith("unsupported")}
        if len(plain) == 1 and (len(plain) == len(set(kinds)) or plain == {"str"}):
            return plain.pop(), optional
        return f"unsupported: {tp}", optional
    if origin in (tuple, list) or origin is Sequence:
        elems = [a for a in args if a is not Ellipsis]
        if len(set(elems)) == 1 and _scalar(elems[0]):
            return f"list[{_scalar(elems[0])}]", False
        return f"unsupported: {tp}", False
    scalar = _scalar(tp)
    return (scalar, False) if scalar else (f"unsupported: {tp}", False)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def describe(config_cls: type) -> list[OptionInfo]:
    """Every field of dataclass `config_cls` (inherited ones included, in field order);
    a field declared without `option` has help ''."""
    hints = typing.get_type_hints(config_cls)
    out = []
    for f in dataclasses.fields(config_cls):
        kind, optional = _kind(hints[f.name])
        meta = f.metadata.get(OPTION_KEY) or _Meta("", None, None, (), True, True, "")
        out.append(OptionInfo(f.name, kind, optional, _default(f), meta.help, meta.low,
                              meta.high, meta.choices, meta.runtime, meta.settable,
                              meta.path))
    return out


def check_value(info: OptionInfo, value: Any) -> str:
    """'' when `value` (None for an optional field) is within the option's range and
    choices, else the reason in one line naming the option and the value."""
    if value is None:
        return "" if info.optional else f"{info.name}=None: a value is required"
    for item in value if info.is_list else [value]:
        if isinstance(item, float) and not math.isfinite(item):
            return f"{info.name}={value!r} is not finite"
        if info.choices and item not in info.choices:
            return (f"{info.name}={value!r} not one of "
                    f"{', '.join(str(c) for c in info.choices)}")
        numeric = isinstance(item, int | float) and not isinstance(item, bool)
        if numeric and info.low is not None and item < info.low:
            return f"{info.name}={value!r} below {info.low:g}"
        if numeric and info.high is not None and item > info.high:
            return f"{info.name}={value!r} above {info.high:g}"
    return ""
