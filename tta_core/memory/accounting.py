"""Measured saved-activation accounting: what autograd keeps for backward, per unit.

    counter = SavedActivationCounter(staged)      # staged = decompose(model, ...)
    with counter:                                 # one forward (one batch)
        loss = loss_fn(model(x))
    loss.backward()
    counter.result.total, counter.result.per_unit, counter.result.analytic

Counts every tensor a saved-tensor pack hook receives during the context, deduplicated by
storage (tta_core.memory.ledger), parameters and buffers excluded, attributed per unit as
tta_core.memory.scope defines. Eager mode only: see tta_core.memory.codec for the
torch.compile and torch.utils.checkpoint interaction (same hooks).
Also: process peak RSS and CUDA peak allocation helpers.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch
from torch import Tensor, nn

from tta_core.memory.ledger import Ledger, SavedBytes, SaveEvent
from tta_core.memory.quant import narrow_dtype
from tta_core.memory.scope import WGRAD, SaveSite, UnitScope
from tta_core.model.units import StagedModel

_COMPILED_RUNTIME = ("torch/_functorch/_aot_autograd", "torch/_dynamo", "torch/_inductor")
_RUNTIME_FILES: dict[str, bool] = {}  # source file -> part of the compiled runtime


def refuse_compile() -> None:
    """Raise if torch.compile is tracing: the hooks need eager tensors and module hooks."""
    if torch.compiler.is_compiling():
        raise RuntimeError("tta_core.memory saved-tensor hooks need eager mode, but "
                           "torch.compile is tracing: run the model uncompiled")


def _saved_by_compiled_graph(depth: int = 48) -> bool:
    """True when the current save comes from a torch.compile'd graph at run time.

    At run time a compiled graph is an autograd.Function called from torch's AOT-autograd
    runtime, whose frames are then on the Python stack (is_compiling() is False by then).
    A walk of `depth` frames costs microseconds per save.
    """
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        name = frame.f_code.co_filename
        hit = _RUNTIME_FILES.get(name)
        if hit is None:  # first time this file is seen: the substring test, then cached
            norm = name.replace("\\", "/")
            hit = _RUNTIME_FILES[name] = any(part in norm for part in _COMPILED_RUNTIME)
        if hit:
            return True
        frame = frame.f_back
    return False


def _refuse_compiled_modules(model: torch.nn.Module) -> None:
    compiled = [n or "<root>" for n, m in model.named_modules()
                if getattr(m, "_compiled_call_impl", None) is not None]
    if compiled:
        raise RuntimeError(f"module {compiled[0]!r} was compiled (nn.Module.compile): "
                           "tta_core.memory saved-tensor hooks need eager mode")


class SavedTensorContext:
    """Base of the counter and the codec: module hooks + saved_tensors_hooks for one forward.

    target: a StagedModel (its units) or any nn.Module (units = modules owning parameters).

    Subclasses implement _pack (return what autograd should hold) and may override _unpack.
    ``result`` holds the SavedBytes of the last completed context.
    """

    def __init__(self, target: StagedModel | nn.Module) -> None:
        self.scope = UnitScope(target)
        self.ledger = Ledger()
        self.result: SavedBytes | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> SavedTensorContext:
        refuse_compile()
        _refuse_compiled_modules(self.scope.model)
        if self._hooks is not None:
            raise RuntimeError(f"{type(self).__name__} is already active (not reentrant)")
        self.ledger = Ledger()
        self.scope.install()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(exc_type, exc, tb)
        self.scope.remove()
        self.result = self.ledger.result(self.scope.wgrad_inputs, self._keep_ratios())
        self._clear_batch()
        self.ledger.clear()
        if exc_type is None and self.ledger.saves and not self.scope.units_started \
                and self.scope.unit_names:
            raise RuntimeError(
                f"{self.ledger.saves} tensors were saved but no unit module ran: is the model "
                "torch.compile'd, or not the one that was decomposed?")

    def _pack_hook(self, t: Tensor) -> object:
        if self.scope.is_state(t):
            return t
        refuse_compile()
        if _saved_by_compiled_graph():
            raise RuntimeError("a torch.compile'd graph is saving tensors: tta_core.memory "
                               "saved-tensor hooks need the model to run in eager mode")
        self.ledger.saves += 1
        return self._pack(t, self.scope.classify(t))

    def _pack(self, t: Tensor, site: SaveSite) -> object:
        raise NotImplementedError

    def _unpack(self, packed: object) -> Tensor:
        return packed  # type: ignore[return-value]

    def _keep_ratios(self) -> dict[str, float]:
        return {}

    def _clear_batch(self) -> None:
        """Per-batch state to drop at exit (the codec's dedup cache)."""


class SavedActivationCounter(SavedTensorContext):
    """Counts saved-activation bytes of one forward; saves are held unchanged.

    With record=True, ``events`` lists every save (for predict.SaveProfile); wgrad saves
    then also cost a count_nonzero each.
    """

    def __init__(self, target: StagedModel | nn.Module, record: bool = False) -> None:
        super().__init__(target)
        self.record = record
        self.events: list[SaveEvent] = []

    def __enter__(self) -> SavedActivationCounter:
        self.events = []
        super().__enter__()
        return self

    def _pack(self, t: Tensor, site: SaveSite) -> object:
        index = self.ledger.storage_index(t, site)
        if self.record:
            nz = 1.0
            if site.role == WGRAD and t.numel():
                nz = int(torch.count_nonzero(t)) / t.numel()
            view = (index, t.storage_offset(), tuple(t.shape), t.stride(), t._version)
            self.events.append(SaveEvent(index, t.untyped_storage().nbytes(), view, t.numel(),
                                         t.element_size(), site.role, site.unit, nz,
                                         t.is_floating_point(), _narrow_elem(t)))
        return t


def _narrow_elem(t: Tensor) -> int:
    """Bytes per entry of an integer save in its narrowest dtype (0: float or no gain)."""
    dtype = None if t.is_floating_point() else narrow_dtype(t)
    return 0 if dtype is None else torch.iinfo(dtype).bits // 8


@dataclass
class MemoryPeaks:
    """Process peak resident set size and CUDA peak allocation (None without CUDA)."""

    rss_bytes: int
    cuda_bytes: int | None


def reset_peaks() -> bool:
    """Reset the peak RSS (Linux /proc/self/clear_refs) and CUDA peak; False if RSS can't be."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """Peak resident set size since start or the last reset_peaks (VmHWM; else getrusage)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes, Linux: KiB


def memory_peaks() -> MemoryPeaks:
    """Current peaks: process RSS and, when CUDA is available, torch's max allocated."""
    cuda = int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
    return MemoryPeaks(peak_rss_bytes(), cuda)
