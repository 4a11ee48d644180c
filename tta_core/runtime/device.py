"""Device names from users (node parameter, `tta bench --device`), checked once: a clear
one-line error instead of a CUDA initialisation traceback on the first batch."""

from __future__ import annotations

import torch

from tta_core.runtime.gc_pauses import collect_frozen
from tta_core.runtime.malloc_tuning import return_freed_memory


def check_device(name: str) -> torch.device:
    """The torch device `name` (cpu, cuda, cuda:N), or a ValueError naming why it cannot
    be used here."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={name!r} is not a torch device (cpu, cuda, cuda:N): "
                         f"{str(exc).splitlines()[0]}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={name!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={name!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device={name!r}: only cpu and cuda devices are supported")
    return dev


def release_memory(device: torch.device | None = None) -> None:
    """After the last reference to a model went: collect it (its cycles too, frozen ones
    included: gc_pauses), return CUDA's cached blocks on a CUDA `device` and the heap's
    free pages to the system."""
    collect_frozen()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    return_freed_memory()
