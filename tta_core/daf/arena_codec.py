"""The activation codec storing its quantized saves in DAF's paged store (PagedArena).

    arena = PagedArena(budget_bytes)
    codec = ArenaCodec(model, CodecPlan(default_bits=8, norm_bits=8), arena, importance)
    with codec:
        loss = loss_fn(model(x))
    loss.backward()

Every quantized save (a Quant encoding with bits > 0) goes into the arena as one page run,
keyed in save order, valued at its unit's importance (default 1.0). When it does not fit,
the arena downgrades the least important per byte, the new save included (Algorithm 3's
forward pass) — but never below 2 bits: autograd already holds every earlier save, so
during a forward widths can only shrink, not vanish (0 bits is decided before the forward,
in the plan). A save that cannot fit even then is stored outside the arena at 2 bits and
counted in ``overflow_bytes`` (no crash; plan the next batch with a smaller width or a
larger budget). Entries live until the next forward under the same arena (``__enter__``
clears it): backward reads them through views. ``result`` counts each save's bytes as
first stored; ``arena.used_bytes`` is what the arena holds after later downgrades.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tta_core.daf.arena import PagedArena
from tta_core.memory.codec import ActivationCodec, CodecPlan, Encoding
from tta_core.memory.packed import memory_order, restore_layout
from tta_core.memory.quant import PackedQuant, Quant
from tta_core.memory.scope import SaveSite
from tta_core.model.units import StagedModel

FORWARD_FLOOR_BITS = 2
ARENA_PAGE_BYTES = 4096  # camera-sized activations are small


@dataclass(eq=False)
class ArenaRef:
    """What autograd holds for an arena entry: its key and the layout to restore."""

    arena: PagedArena
    key: int
    shape: torch.Size
    perm: tuple[int, ...]
    nbytes: int  # as first stored

    def decode(self) -> Tensor:
        """The entry dequantized at its current width (after any downgrade)."""
        flat = self.arena.get(self.key)
        if flat is None:
            raise RuntimeError(f"arena entry {self.key} was freed before backward read it: "
                               "run backward before the next forward under this arena")
        return restore_layout(flat, self.shape, self.perm)


class ArenaCodec(ActivationCodec):
    """ActivationCodec whose quantized saves live in a PagedArena (module doc)."""

    def __init__(self, target: StagedModel | nn.Module, plan: CodecPlan, arena: PagedArena,
                 importance: Mapping[str, float] | None = None) -> None:
        super().__init__(target, plan)
        self.arena = arena
        self.importance = dict(importance or {})
        self.overflow_bytes = 0
        self.arena_stored_bytes = 0  # bytes of the saves put into the arena, as first stored
        self._next = 0

    def __enter__(self) -> ArenaCodec:
        for key in list(self.arena.table):
            self.arena.remove(key)
        self.overflow_bytes = 0
        self.arena_stored_bytes = 0
        self._next = 0
        super().__enter__()
        return self

    def _store(self, t: Tensor, enc: Encoding, site: SaveSite, encode: Callable[[], object]
               ) -> object:
        if not isinstance(enc, Quant) or enc.bits == 0:
            return super()._store(t, enc, site, encode)
        return super()._store(t, enc, site, lambda: self._put(t, enc, site))

    def _put(self, t: Tensor, enc: Quant, site: SaveSite) -> ArenaRef | PackedQuant:
        flat, perm = memory_order(t.detach())
        key, self._next = self._next, self._next + 1
        floor = min(enc.bits, FORWARD_FLOOR_BITS)
        try:
            self.arena.put(key, flat, enc.bits, self.importance.get(site.unit, 1.0), floor)
        except MemoryError:
            packed = PackedQuant.encode(t, floor, enc.group)
            self.overflow_bytes += packed.nbytes
            return packed
        ref = ArenaRef(self.arena, key, t.shape, perm, self.arena.table[key].nbytes)
        self.arena_stored_bytes += ref.nbytes
        return ref

    def _unpack(self, packed: object) -> Tensor:
        if isinstance(packed, ArenaRef):
            return packed.decode()
        return super()._unpack(packed)


def arena_stats(codec: ArenaCodec) -> dict[str, float | int | bool]:
    """What the arena holds after the step's forward, what overflowed, whether it held."""
    arena = codec.arena
    widths = [b.bits for b in arena.table.values()]
    return {"arena_bytes": arena.used_bytes, "arena_overflow_bytes": codec.overflow_bytes,
            "arena_budget_bytes": arena.budget, "arena_entries": len(widths),
            "arena_min_bits": min(widths, default=0),
            "within_arena_budget": arena.used_bytes <= arena.budget
            and codec.overflow_bytes == 0}
