"""Weights files: read a state_dict safely and say in one line why it does not fit a model.

Two formats, neither of which runs code on load: torch files, always read with
`torch.load(weights_only=True)` (never unpickled), and `.safetensors` files (a JSON header
then raw little-endian tensor bytes; read here with the standard library, so the
safetensors package is not needed). A state_dict that does not fit names the first missing
and unexpected keys and shape mismatches, where torch's own message is many lines long.
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tta_core.errors import InputError, one_line

SAFETENSORS_SUFFIX = ".safetensors"
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
    "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
SHOWN_KEYS = 4  # keys named per kind of mismatch; the rest are counted


def _load_failure(exc: BaseException) -> str:
    """Why torch.load refused a file, in a few words (never torch's advice to load it
    unsafely: only weights_only loading is done here)."""
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError):
        detail = text.partition("WeightsUnpickler error:")[2].partition("Check the doc")[0]
        return "not a weights-only torch file" + (f": {one_line(detail)}" if detail.strip()
                                                  else "")
    if isinstance(exc, EOFError):
        return "empty or truncated file"
    return one_line(text.partition(". ")[0])


def _st_tensor(path: Path, name: str, info: Any, body: memoryview) -> torch.Tensor:
    """One tensor of a safetensors file from its header entry."""
    try:
        dtype = _ST_DTYPES[info["dtype"]]
        shape = [int(s) for s in info["shape"]]
        start, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise InputError(f"{path} is not a valid safetensors file (tensor {name!r} has "
                         f"header entry {info!r})") from None
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if min(shape, default=0) < 0 or not 0 <= start <= end <= len(body) \
            or end - start != nbytes:
        raise InputError(f"{path} is not a valid safetensors file (tensor {name!r}: "
                         f"offsets {start}..{end} do not hold shape {shape} {info['dtype']})")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(body[start:end]), dtype=dtype).reshape(shape)


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a `.safetensors` file (CPU); InputError naming the file when it is
    not one. Format: u64 little-endian header size, JSON header, tensor bytes."""
    path = Path(path)
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 <= size <= len(data) - 8:
        raise InputError(f"{path} is not a valid safetensors file (header size "
                         f"{size} for a {len(data)}-byte file)")
    try:
        header = json.loads(data[8:8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputError(f"{path} is not a valid safetensors file (header is not "
                         "JSON)") from None
    if not isinstance(header, dict):
        raise InputError(f"{path} is not a valid safetensors file (header is not a JSON "
                         "object)")
    body = memoryview(data)[8 + size:]
    return {name: _st_tensor(path, name, info, body) for name, info in header.items()
            if name != "__metadata__"}


def load_state_dict(ckpt: str | Path) -> dict[str, Any]:
    """The state_dict in `ckpt` (CPU tensors): a `.safetensors` file, else a torch file read
    with weights_only loading; InputError naming the file when it is neither."""
    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise FileNotFoundError(f"weights file {str(ckpt)!r} not found")
    if ckpt.suffix == SAFETENSORS_SUFFIX:
        return read_safetensors(ckpt)
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise InputError(f"{ckpt} is not a valid checkpoint ({_load_failure(exc)})") from None
    if not isinstance(state, dict):
        raise InputError(f"{ckpt} is not a valid checkpoint (it holds a "
                         f"{type(state).__name__}, not a state_dict)")
    return state


def _first(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN_KEYS])
    more = len(keys) - SHOWN_KEYS
    return f"[{shown}]" + (f" (+{more} more)" if more > 0 else "")


def _hint(state: dict[str, Any], unexpected: list[str]) -> str:
    """A likely cause: a wrapped training checkpoint or a DataParallel prefix."""
    nested = [k for k, v in state.items() if isinstance(v, dict)]
    if nested:
        return (f"; the file holds a dict under {nested[0]!r} (a training checkpoint?): "
                "save model.state_dict() itself")
    if unexpected and all(k.startswith("module.") for k in unexpected):
        return "; keys start with 'module.' (saved from DataParallel): strip that prefix"
    return ""


def state_dict_mismatch(model: nn.Module, state: dict[str, Any]) -> str:
    """'' when `state` fits `model` key for key and shape for shape, else one line naming
    the first missing keys, unexpected keys and shape mismatches (checkpoint vs model)."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} vs model {tuple(v.shape)}"
              for k, v in expected.items()
              if k in state and tuple(getattr(state[k], "shape", ())) != tuple(v.shape)]
    parts = [f"{what} {_first(keys)}" for what, keys in (
        ("missing keys", missing), ("unexpected keys", unexpected),
        ("shape mismatches", shapes)) if keys]
    return "; ".join(parts) + (_hint(state, unexpected) if parts else "")


def load_into(model: nn.Module, state: dict[str, Any], what: str) -> nn.Module:
    """`model` with `state` loaded strictly; InputError starting with `what` (the file and
    the architecture) and naming the mismatching keys when it does not fit."""
    problem = state_dict_mismatch(model, state)
    if not problem:
        try:
            model.load_state_dict(state)
            return model
        except (RuntimeError, TypeError, AttributeError) as exc:
            problem = one_line(exc)
            problem = problem if len(problem) <= 300 else problem[:300] + "..."
    raise InputError(f"{what}: {problem}")
