"""Weights files: read a state_dict safely and say in one line why it does not fit a model.

Two formats, neither of which runs code on load: torch files, always read with
`torch.load(weights_only=True)` (never unpickled), and `.safetensors` files (read with the
safetensors package). A state_dict that does not fit names the first missing
and unexpected keys and shape mismatches, where torch's own message is many lines long.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from tta_core.errors import InputError, one_line, require_file

SAFETENSORS_SUFFIX = ".safetensors"
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


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a `.safetensors` file (CPU, via the safetensors package); InputError
    naming the file when it is not one."""
    try:
        return safetensors.torch.load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"{path} is not a valid safetensors file ({one_line(exc)})") from None


def load_state_dict(ckpt: str | Path) -> dict[str, Any]:
    """The state_dict in `ckpt` (CPU tensors): a `.safetensors` file, else a torch file read
    with weights_only loading; InputError naming the file when it is neither."""
    ckpt = Path(ckpt)
    require_file(ckpt, f"weights file {str(ckpt)!r}", f"weights file {str(ckpt)!r} not found")
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
