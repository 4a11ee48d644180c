"""A sweep specification: `tta bench` options shared by every cell (`base`), a grid whose
cartesian product gives the cells, exclusions, and the baseline of the paired tests.

    name: small
    baseline: bn_adapt            # paired differences against this method (by seed)
    base:                         # `tta bench` options every cell shares
      samples-per-domain: 8
      threads: 1
    grid:                         # one axis per option; each cell takes one value of each
      methods: [bn_adapt, tent]   # one method per cell
      batch-size: [4, 16]
      seed: [0, 1, 2]
    exclude:                      # drop the cells that match every key of an entry
      - {methods: tent, batch-size: 16}

A `set` entry (`METHOD.KEY=VALUE`) reaches only the cells whose methods include METHOD,
so one base can configure several variants of a method (`methods: [darda@full,
darda@bn_only]` with `set: [darda@full.variant=full, darda@bn_only.variant=bn_only]`).

Keys are `tta bench` option names (dashes or underscores). Values: a scalar, `true` for a
flag, a list for a repeatable option (`set: [adashadow.sigma=0.5, ...]`); under `grid`
each value is one level. Keys are checked here (one-line errors naming the key); values
when the cell runs, where a bad one fails that cell alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tta_core.errors import InputError

#: bench options a sweep sets itself (per cell) and a spec may not
RESERVED = ("out", "no_progress")
#: options that are the unit of comparison rather than the condition
UNIT_KEYS = ("methods", "seed")


@dataclass(frozen=True)
class Cell:
    """One bench run: its options (normalised keys, spec order) in CLI form."""

    options: tuple[tuple[str, Any], ...]

    @property
    def as_dict(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def method(self) -> str:
        return str(self.as_dict.get("methods", ""))

    @property
    def seed(self) -> int:
        return int(self.as_dict.get("seed", 0))

    @property
    def condition(self) -> tuple[tuple[str, Any], ...]:
        """Everything but the method and the seed: what a comparison holds fixed. The
        `set` entries of a named variant (`METHOD@NAME.KEY=VALUE`) belong to its method,
        not to the condition: a variant is compared with the other methods."""
        out = []
        for k, v in self.options:
            if k == "set":
                v = [e for e in (v if isinstance(v, list | tuple) else [v])
                     if "@" not in str(e).partition("=")[0].rpartition(".")[0]]
                if not v:
                    continue
            if k not in UNIT_KEYS:
                out.append((k, _hashable(v)))
        return tuple(out)

    def argv(self) -> list[str]:
        """`tta bench` arguments of this cell."""
        out: list[str] = []
        for key, value in self.options:
            flag = "--" + key.replace("_", "-")
            values = value if isinstance(value, list | tuple) else [value]
            for v in values:
                if v is True:
                    out.append(flag)
                elif v is not False and v is not None:
                    out += [flag, ",".join(map(str, v)) if isinstance(v, list | tuple)
                            else str(v)]
        return out


@dataclass(frozen=True)
class SweepSpec:
    """What to run; `cells()` expands it."""

    name: str
    base: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    exclude: tuple[dict[str, Any], ...] = ()
    baseline: str = ""

    def cells(self) -> list[Cell]:
        """The cartesian product of the grid over the base, less the excluded cells."""
        axes = list(self.grid.items())
        cells = []
        for values in itertools.product(*(v for _, v in axes)):
            point = {**self.base, **dict(zip((k for k, _ in axes), values, strict=True))}
            if any(_matches(point, ex) for ex in self.exclude):
                continue
            if "set" in point and "methods" in point:
                point["set"] = _sets_for(point["set"], point["methods"])
                if not point["set"]:
                    del point["set"]
            cells.append(Cell(tuple(point.items())))
        return cells


def _sets_for(sets: Any, methods: Any) -> list[str]:
    """The `set` entries whose METHOD is one of the cell's `methods`."""
    names = set(methods if isinstance(methods, list | tuple) else str(methods).split(","))
    entries = sets if isinstance(sets, list | tuple) else [sets]
    return [e for e in entries if str(e).partition("=")[0].rpartition(".")[0] in names]


def _matches(point: Mapping[str, Any], rule: Mapping[str, Any]) -> bool:
    return all(_same(point.get(k), v) for k, v in rule.items())


def _same(a: Any, b: Any) -> bool:
    return _hashable(a) == _hashable(b)


def _hashable(x: Any) -> Any:
    """Lists (repeatable options) as tuples, so values can key a dict."""
    return tuple(_hashable(v) for v in x) if isinstance(x, list | tuple) else x


def _key(key: str, known: Sequence[str], where: str) -> str:
    k = str(key).replace("-", "_")
    if k in RESERVED:
        raise InputError(f"sweep {where}: {key!r} is set by the sweep itself (per cell)")
    if k not in known:
        raise InputError(f"sweep {where}: {key!r} is not a `tta bench` option "
                         f"(known: {', '.join(sorted(known))})")
    return k


def _mapping(raw: Any, where: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InputError(f"sweep {where}: expected a mapping of options, got "
                         f"{type(raw).__name__}")
    return dict(raw)


def parse_spec(raw: Any, known: Sequence[str], default_name: str = "sweep") -> SweepSpec:
    """A SweepSpec from parsed YAML; one-line InputError naming the bad key or value."""
    raw = _mapping(raw, "file")
    unknown = set(raw) - {"name", "base", "grid", "exclude", "baseline"}
    if unknown:
        raise InputError(f"sweep: unknown top-level key(s) {', '.join(sorted(unknown))} "
                         "(expected name, base, grid, exclude, baseline)")
    base = {_key(k, known, "base"): v for k, v in _mapping(raw.get("base"), "base").items()}
    grid: dict[str, list[Any]] = {}
    for k, v in _mapping(raw.get("grid"), "grid").items():
        levels = v if isinstance(v, list) else [v]
        if not levels:
            raise InputError(f"sweep grid: {k!r} has no values")
        grid[_key(k, known, "grid")] = levels
    if isinstance(grid.get("methods"), list):
        grid["methods"] = [str(m) for m in grid["methods"]]
    excl = raw.get("exclude") or []
    if not isinstance(excl, list):
        raise InputError("sweep exclude: expected a list of option mappings")
    exclude = tuple({_key(k, known, "exclude"): v for k, v in _mapping(e, "exclude").items()}
                    for e in excl)
    spec = SweepSpec(str(raw.get("name") or default_name), base, grid, exclude,
                     str(raw.get("baseline") or ""))
    if not spec.cells():
        raise InputError("sweep: the grid leaves no cell (every one excluded?)")
    methods = {c.method for c in spec.cells()}
    if spec.baseline and spec.baseline not in methods:
        raise InputError(f"sweep baseline {spec.baseline!r} is not among the cells' methods "
                         f"({', '.join(sorted(methods))})")
    return spec


def load_spec(path: str | Path, known: Sequence[str]) -> SweepSpec:
    """Read and check a spec file."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"sweep spec {str(p)!r} not found")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise InputError(f"sweep spec {p}: not valid YAML ({str(exc).splitlines()[0]})"
                         ) from None
    return parse_spec(raw, known, p.stem)
