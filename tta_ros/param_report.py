"""What a node says about the parameter values it was given: only values someone set, each
once, at WARN.

The values are the node's start values (params files, `-p`, launch parameters and
arguments, bringup's `--set`: tta_ros.ros_params.start_values) and run-time sets. Options
nobody set are never named: the start values hold only what was given, and a given value
equal to the option's default is no setting either (a shared params file that spells a
method's defaults out, read by a node running another method). Three lines:

- `foreign_line`: the method.* values the selected method has no option for, e.g.
  `method:=tent sigma:=0.5`, in one line naming the method;
- `unknown_line`: a value for no parameter of the node, with the parameter it was most
  likely meant for, e.g. `deadline_mode` under perception, whose parameter is
  `method.deadline_mode`;
- `refused_line`: a run-time set of an undeclared parameter, which rclpy refuses, said in
  the node's log with the reason.

`shared_elsewhere` keeps a value another node of the system takes (a `/**` section gives
model_card to every node) from being named, unless the node has that parameter under
another name; a node that does not know the others' parameters names only values close to
one of its own (`unknown_names`).

Plain Python (no rclpy): tta_ros.ros_params and tta_ros.nodes.method_params call it.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any


def _last(name: str) -> str:
    return name.rpartition(".")[2]


def closest(name: str, candidates: Iterable[str]) -> str:
    """The candidate `name` was most likely meant for, '' when none is close: one whose last
    dotted part is `name`'s (`deadline_mode` -> `method.deadline_mode`), else the closest
    spelling (difflib)."""
    cands = sorted(set(candidates) - {name})
    same_last = [c for c in cands if _last(c) == _last(name)]
    pool = same_last or cands
    near = difflib.get_close_matches(name, pool, n=1, cutoff=0.0 if same_last else 0.6)
    return near[0] if near else ""


def same_value(given: Any, default: Any) -> bool:
    """Whether a given value is `default` (an int for a float default counts; a bool never
    stands for a number, nor a number for a bool)."""
    if isinstance(given, bool) != isinstance(default, bool):
        return False
    if isinstance(given, list | tuple) and isinstance(default, list | tuple):
        return len(given) == len(default) and all(map(same_value, given, default))
    return bool(given == default)


def set_values(given: Mapping[str, Any],
               defaults: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """The values of `given` someone set: those equal to none of their name's `defaults`
    (a name without defaults is always set)."""
    return {k: v for k, v in given.items()
            if not any(same_value(v, d) for d in defaults.get(k, ()))}


def shared_elsewhere(name: str, own: Collection[str], others: Collection[str]) -> bool:
    """Whether a value for `name`, no parameter of this node, is one another node takes
    (`others`: their parameters) and this node has no parameter of the same last part
    (`own`), so it came from a section shared by all nodes rather than by mistake."""
    return name in others and not any(_last(p) == _last(name) for p in own)


def unknown_names(given: Iterable[str], own: Collection[str], handled: Collection[str] = (),
                  others: Collection[str] | None = ()) -> list[str]:
    """The given names that are no parameter of the node (`own`), are not `handled`
    elsewhere (perception: every method's options) and not shared_elsewhere, sorted.
    `others` None: the other nodes' parameters are not known here (the resource monitor
    imports no node but itself), so only names close to one of the node's are taken as
    meant for it."""
    mine = [*own, *handled]
    return sorted(n for n in given if n not in own and n not in handled and (
        closest(n, mine) if others is None else not shared_elsewhere(n, mine, others)))


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest of `candidates`, '' when none is close."""
    near = closest(name, candidates)
    return f" (did you mean {near}?)" if near else ""


def unknown_line(node: str, name: str, value: Any, candidates: Iterable[str]) -> str:
    """`name=value` is no parameter of `node`, with the closest of `candidates`."""
    return f"{name}={value!r} is no parameter of {node}: not used" + did_you_mean(
        name, candidates)


def foreign_line(method: str, values: Mapping[str, Any]) -> str:
    """The line naming the method.* `values` method `method` has no option for ('' for
    none)."""
    if not values:
        return ""
    named = ", ".join(f"{k}={v!r}" for k, v in sorted(values.items()))
    return f"method {method} has no option {named}: not used"


def refused_line(name: str, value: Any, why: str) -> str:
    """A run-time set of `name` to `value` refused, and why."""
    return f"{name}={value!r} refused: {why}"
