"""CUDA graphs for a no-grad served forward: one graph per input shape, replayed per batch.

`GraphedForward(fn)` wraps a forward `fn(x) -> Tensor | tuple[Tensor, ...]` that is a pure
function of its input on the device (no host reads, no Python-side effects: a hook that
appends to a list runs at capture only). Per key (x's shape, dtype and device, plus an
optional `signature` a caller passes, e.g. a plan's), the first call warms `fn` up on a
side stream and captures it into a `torch.cuda.CUDAGraph` with a static input buffer (the
PyTorch recipe: warm-up and capture on the same side stream, capture in thread-local mode
so a background thread's CUDA work does not invalidate it). Later calls copy x into the
static input, replay, and return clones of the static outputs (the next replay overwrites
them). Graphs live in a small LRU cache (`max_graphs`); each has its own memory pool, since
graphs of different shapes replay in any order.

`captures` counts successful captures (steady state: none per batch), `replays` the
batches served by a graph. Off CUDA, with `enabled=False`, or when a capture fails, the
forward runs eagerly; `fallback_reason` says why, and the reason is logged once. Weights
updated in place (an optimizer step, `load_state_dict`) are seen by later replays; a model
moved to another device or given new tensors needs `clear()`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GraphedForward"]

log = logging.getLogger(__name__)

Output = Tensor | tuple[Tensor, ...]
WARMUP_RUNS = 3  # eager runs on the side stream before a capture (the PyTorch recipe)
MAX_GRAPHS = 4  # shapes (and signatures) kept captured; the least recently used goes


@dataclass
class _Graph:
    """One captured forward: its graph, static input and static outputs."""

    graph: torch.cuda.CUDAGraph
    static_in: Tensor
    static_out: Output


def _clone(out: Output) -> Output:
    return out.clone() if isinstance(out, Tensor) else tuple(t.clone() for t in out)


def _check_output(out: object) -> None:
    ok = isinstance(out, Tensor) or (isinstance(out, tuple) and out
                                     and all(isinstance(t, Tensor) for t in out))
    if not ok:
        raise TypeError(f"a graphed forward returns a Tensor or a tuple of Tensors, "
                        f"got {type(out).__name__}")


class GraphedForward:
    """A served forward replayed from CUDA graphs where it can be (module docstring)."""

    def __init__(self, fn: Callable[[Tensor], Output], *, enabled: bool = True,
                 max_graphs: int = MAX_GRAPHS, warmup: int = WARMUP_RUNS,
                 name: str = "forward") -> None:
        """`fn`: the no-grad forward; `enabled=False`: always eager (reason 'off');
        `name`: how the log line names this forward."""
        if max_graphs < 1 or warmup < 1:
            raise ValueError(f"max_graphs {max_graphs} and warmup {warmup} must be >= 1")
        self.fn, self.enabled, self.name = fn, bool(enabled), name
        self.max_graphs, self.warmup = int(max_graphs), int(warmup)
        self.captures = 0  # successful captures since construction
        self.replays = 0  # calls served by replaying a graph
        self.fallback_reason = "" if enabled else "CUDA graphs off (cuda_graphs=False)"
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._said = False

    @property
    def graphed(self) -> bool:
        """Whether calls may replay graphs (False once the forward fell back to eager)."""
        return self.enabled and not self.fallback_reason

    @property
    def cached(self) -> int:
        """Graphs held now."""
        return len(self._graphs)

    def __call__(self, x: Tensor, signature: Hashable = None) -> Output:
        """fn(x) under no_grad: a replay of the graph of (x's shape, dtype, device,
        `signature`), captured on first sight; eager off CUDA or after a failed capture.
        The output is the caller's (cloned out of the static buffers)."""
        with torch.no_grad():
            if self.graphed and x.device.type != "cuda":
                self._fall_back(f"device {x.device} is not CUDA: eager forward", logging.INFO)
            if not self.graphed or torch.cuda.is_current_stream_capturing():
                return self.fn(x)
            key = (tuple(x.shape), x.dtype, x.device, signature)
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._capture(x, key)
                if entry is None:
                    return self.fn(x)
            else:
                self._graphs.move_to_end(key)
            entry.static_in.copy_(x)
            entry.graph.replay()
            self.replays += 1
            return _clone(entry.static_out)

    def _capture(self, x: Tensor, key: Hashable) -> _Graph | None:
        """Warm up and capture fn for x's key; None (and eager from now on) when the
        capture fails. An error of fn itself (in the eager warm-up) is raised as it is."""
        static_in, stream = self._warm_up(x)
        try:
            entry = self._record(static_in, stream)
        except Exception as exc:  # any capture failure: serve eagerly, say so once
            text = str(exc).strip()
            self._fall_back(f"capture failed ({type(exc).__name__}: "
                            f"{text.splitlines()[0] if text else ''}): eager forward",
                            logging.WARNING)
            try:
                torch.cuda.synchronize(x.device)
            except RuntimeError:  # the failed capture's error again: eager raises it
                pass
            return None
        self._graphs[key] = entry
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry

    def _warm_up(self, x: Tensor) -> tuple[Tensor, torch.cuda.Stream]:
        """The static input and the side stream fn ran `warmup` times on (eagerly)."""
        static_in = x.detach().clone()
        stream = torch.cuda.Stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.device(x.device), torch.cuda.stream(stream):
            for _ in range(self.warmup):
                _check_output(self.fn(static_in))
        torch.cuda.current_stream(x.device).wait_stream(stream)
        return static_in, stream

    def _record(self, static_in: Tensor, stream: torch.cuda.Stream) -> _Graph:
        """Capture fn on static_in on the warm-up's stream (thread-local capture mode)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(static_in.device), torch.cuda.graph(
                graph, stream=stream, capture_error_mode="thread_local"):
            static_out = self.fn(static_in)
        torch.cuda.current_stream(static_in.device).wait_stream(stream)
        return _Graph(graph, static_in, static_out)

    def _fall_back(self, reason: str, level: int) -> None:
        self.fallback_reason = reason
        self._graphs.clear()
        if not self._said:
            log.log(level, "%s: %s", self.name, reason)
            self._said = True

    def clear(self) -> None:
        """Drop every captured graph (and its memory); the next call captures anew."""
        self._graphs.clear()

    def stats(self) -> dict[str, int | str]:
        """captures, replays, graphs held and the fallback reason ('' while graphed)."""
        return {"captures": self.captures, "replays": self.replays, "cached": self.cached,
                "fallback_reason": self.fallback_reason}
