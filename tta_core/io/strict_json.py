"""Strict JSON for every file and line tta writes: NaN and ±inf become null (RFC 8259 has
no NaN; Python's json writes a bare `NaN` that strict readers reject), then
`json.dumps(..., allow_nan=False)` so nothing non-standard can slip through. Paths become
strings, tuples lists, numpy scalars and arrays plain numbers and lists. Stdlib only."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["dumps", "strict", "write_json"]


def strict(obj: Any) -> Any:
    """A JSON-ready copy of `obj`: non-finite floats -> None, Path -> str, tuples/sets ->
    lists, numpy scalars/arrays -> Python numbers/lists, dict keys -> str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [strict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy array or scalar, torch
        return strict(obj.tolist())
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """`json.dumps` of `strict(obj)` with allow_nan=False (other kwargs passed on)."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)


def write_json(path: str | Path, obj: Any, indent: int | None = 1) -> Path:
    """Write `obj` as strict JSON (newline-terminated) to `path` atomically: a temporary
    file in the same folder, then a rename, so a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(obj, indent=indent) + "\n")
    os.replace(tmp, path)
    return path
