"""Where a shipped data file (a model card such as checkpoints/small_resnet_signs32.json, a
profile, a bundle) is found: the one lookup of every `tta` command, the card loader and the
ROS nodes (tta_ros.ros_params.resolve_data_path hands its share folder in as `extra`).

A relative path is looked up, first hit wins, in

1. the working directory,
2. `base` (default: the source checkout that holds tta_core, where checkpoints/ and
   config/ sit next to it),
3. the folders in `extra`, then each folder a `tta.data_roots` entry point names (a
   callable returning a folder or None; tta_ros names its colcon share folder, so an
   installed `tta` finds the cards colcon installed there; tta_core never names it).

An absolute path is only itself. A path found nowhere raises FileNotFoundError naming the
path and every place it was looked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

__all__ = ["CHECKOUT_ROOT", "ENTRY_POINT_GROUP", "data_roots", "find_data_file",
           "lookup_places", "require_data_file"]

ENTRY_POINT_GROUP = "tta.data_roots"
CHECKOUT_ROOT = Path(__file__).resolve().parents[2]  # a source checkout; site-packages if not


def _provided_roots() -> list[Path]:
    """The folders the `tta.data_roots` entry points name (a provider that cannot be loaded
    or names none adds nothing: the other places still count)."""
    roots = []
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            root = ep.load()()
        except Exception:  # a broken provider must not hide the other places
            continue
        if root is not None:
            roots.append(Path(root))
    return roots


def data_roots(base: Path | None = None, extra: Sequence[Path] = ()) -> list[Path]:
    """The folders a relative path is looked up in, in order, each once (module docstring)."""
    roots: list[Path] = []
    for root in (Path.cwd(), CHECKOUT_ROOT if base is None else Path(base), *extra,
                 *_provided_roots()):
        root = root.resolve()
        if root not in roots:
            roots.append(root)
    return roots


def lookup_places(value: str | Path, base: Path | None = None,
                  extra: Sequence[Path] = ()) -> list[Path]:
    """Every path `value` is looked for at, in order (one for an absolute path)."""
    value = Path(value).expanduser()
    if value.is_absolute():
        return [value]
    return [root / value for root in data_roots(base, extra)]


def find_data_file(value: str | Path, base: Path | None = None,
                   extra: Sequence[Path] = ()) -> Path | None:
    """The first existing place of `value` (resolved), or None."""
    return next((p.resolve() for p in lookup_places(value, base, extra) if p.exists()), None)


def require_data_file(value: str | Path, what: str = "file", hint: str = "",
                      base: Path | None = None, extra: Sequence[Path] = ()) -> Path:
    """The first existing place of `value`; FileNotFoundError "<what> 'x' not found; looked
    in A, B, C (<hint>)" naming every place when there is none."""
    places = lookup_places(value, base, extra)
    found = next((p.resolve() for p in places if p.exists()), None)
    if found is None:
        raise FileNotFoundError(f"{what} {str(value)!r} not found; looked in "
                                + ", ".join(str(p) for p in places)
                                + (f" ({hint})" if hint else ""))
    return found
