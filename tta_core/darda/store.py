"""Domain bank files: safetensors tensors + JSON metadata, written atomically.

A bank file holds flat named tensors (detector statistics, each domain's state) and, in
the safetensors header's metadata, `format`, `version` and `meta` (JSON: domain names,
gate records, the model fingerprint, the adapted tensors' names and shapes, the embedding
layout). Nothing is unpickled. Writing goes to a temporary file in the same folder, is
flushed to disk, then renamed over the target (os.replace), so a crash leaves the old file
or the new one, never half of one.

`load_bank` refuses, with one InputError line naming the file and the reason, a file that
is not a safetensors file, is truncated, has another format or version, or was made for
another model (fingerprint, tensor names or shapes differ); the caller starts fresh.
"""

from __future__ import annotations

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

from tta_core.errors import InputError, one_line

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


def save_bank(path: str | Path, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    """Write tensors + meta to `path` atomically (tmp file, fsync, os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    header = {"format": FORMAT, "version": str(VERSION),
              "meta": json.dumps(meta, allow_nan=False)}
    flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    try:
        save_file(flat, str(tmp), metadata=header)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise InputError(f"domain bank {path}: not a readable safetensors file "
                         f"({one_line(exc)})") from None
    return tensors, header


def load_bank(path: str | Path, expect: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict]:
    """(tensors, meta) of a bank file whose meta matches `expect` key by key; InputError
    (one line, naming the file) for anything unusable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"domain bank {str(path)!r} not found")
    tensors, header = _read(path)
    if header.get("format") != FORMAT:
        raise InputError(f"domain bank {path}: format {header.get('format')!r}, expected "
                         f"{FORMAT!r}")
    if header.get("version") != str(VERSION):
        raise InputError(f"domain bank {path}: version {header.get('version')!r}, this tta "
                         f"reads version {VERSION}")
    try:
        meta = json.loads(header.get("meta", ""))
    except json.JSONDecodeError as exc:
        raise InputError(f"domain bank {path}: metadata is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise InputError(f"domain bank {path}: metadata is not a JSON object")
    for key, want in expect.items():
        if meta.get(key) != want:
            raise InputError(f"domain bank {path} was made for another model: {key} is "
                             f"{_short(meta.get(key))}, this model has {_short(want)}")
    return tensors, meta


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
