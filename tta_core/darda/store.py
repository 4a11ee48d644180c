"""Domain bank files: safetensors tensors + JSON metadata, written atomically.

A bank file holds flat named tensors (detector statistics, each domain's state) and, in
the safetensors header's metadata, `format`, `version` and `meta` (JSON: domain names,
gate records, the model fingerprint, the adapted tensors' names and shapes, the embedding
layout). Nothing is unpickled. Writing goes to a temporary file in the same folder, is
flushed to disk, then renamed over the target (os.replace), so a crash leaves the old file
or the new one, never half of one. A process killed mid-save (SIGKILL runs no cleanup)
leaves its temporary `.NAME.PID.tmp` behind: `clean_stale_temps` removes those of
processes that are no longer alive, and runs before every save and when a method opens
its bank file, so none survives the next start.

`load_bank` refuses, with one InputError line naming the file and the reason, a file that
is not a safetensors file, is truncated, has another format or version, or was made for
another model (fingerprint, tensor names or shapes differ); the caller starts fresh.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from tta_core.errors import InputError, one_line, require_file

FORMAT = "tta.domain_bank"
VERSION = 1


def model_fingerprint(model: nn.Module, skip: Mapping[str, Tensor] | None = None) -> str:
    """sha256 (hex, 16 chars) of the model's class, state_dict names/shapes/dtypes and the
    bytes of every tensor not in `skip` (the adapted state, which a bank overrides)."""
    h = hashlib.sha256(type(model).__name__.encode())
    skip_ids = {id(t) for t in (skip or {}).values()}
    for name, t in model.state_dict(keep_vars=True).items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if id(t) not in skip_ids and t.numel():
            h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 probes without sending anything)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def clean_stale_temps(path: str | Path) -> list[Path]:
    """Remove `.NAME.PID.tmp` files next to `path` left by dead processes (a save that was
    killed); returns the removed paths. Temps of live processes (a save in progress) stay."""
    path = Path(path)
    removed = []
    if not path.parent.is_dir():
        return removed
    prefix = f".{path.name}."
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = tmp.name[len(prefix):-len(".tmp")]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def save_bank(path: str | Path, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    """Write tensors + meta to `path` atomically (tmp file, fsync, os.replace); stale
    temporaries of killed saves are removed first."""
    save_tensors(path, tensors, meta, FORMAT, VERSION)


def save_tensors(path: str | Path, tensors: Mapping[str, Tensor], meta: Mapping[str, Any],
                 fmt: str, version: int) -> None:
    """`save_bank` for any file format of this room (the DARDA bundle uses it too)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    header = {"format": fmt, "version": str(version),
              "meta": json.dumps(meta, allow_nan=False)}
    flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    try:
        save_file(flat, str(tmp), metadata=header)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path, what: str = "domain bank") -> tuple[dict[str, Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise InputError(f"{what} {path}: not a readable safetensors file "
                         f"({one_line(exc)})") from None
    return tensors, header


def load_bank(path: str | Path, expect: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict]:
    """(tensors, meta) of a bank file whose meta matches `expect` key by key; InputError
    (one line, naming the file) for anything unusable."""
    return load_tensors(path, expect, FORMAT, VERSION, "domain bank")


def load_tensors(path: str | Path, expect: Mapping[str, Any], fmt: str, version: int,
                 what: str) -> tuple[dict[str, Tensor], dict]:
    """`load_bank` for any file format of this room; `what` names the file kind."""
    path = Path(path)
    require_file(path, f"{what} {str(path)!r}", f"{what} {str(path)!r} not found")
    tensors, header = _read(path, what)
    if header.get("format") != fmt:
        raise InputError(f"{what} {path}: format {header.get('format')!r}, expected "
                         f"{fmt!r}")
    if header.get("version") != str(version):
        raise InputError(f"{what} {path}: version {header.get('version')!r}, this tta "
                         f"reads version {version}")
    try:
        meta = json.loads(header.get("meta", ""))
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} {path}: metadata is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise InputError(f"{what} {path}: metadata is not a JSON object")
    for key, want in expect.items():
        if meta.get(key) != want:
            raise InputError(f"{what} {path} was made for another model: {key} is "
                             f"{_short(meta.get(key))}, this model has {_short(want)}")
    return tensors, meta


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
