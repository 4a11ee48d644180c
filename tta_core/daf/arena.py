"""DAF's paged activation store (§3.4.2-3.4.4, Algorithm 3): one preallocated byte arena.

    arena = PagedArena(budget=64 * 2**20)            # bytes; pages of 64 KiB
    bits = arena.put("layer1.0.conv1", x, bits=4, importance=0.7)   # 0: not stored
    x_hat = arena.get("layer1.0.conv1")              # dequantized (None if evicted)
    arena.resize(32 * 2**20)                         # shrink: downgrade / evict, compact

Each stored activation is one run of consecutive fixed-size pages (first fit) holding its
packed codes, then its per-group float32 mins and scales (tta_kernels format); reads are
views into the arena. A page table maps keys to runs.

Priorities (Algorithm 3): a min-heap per budget, keyed by importance per byte (memory) and
importance per millisecond (time; only with a time budget). The paper's text says
"SelectMax" on those trees, which contradicts §3.4.1 (maximise stored importance, so the
*least* important per unit of cost must go first): we read it as SelectMin. While a budget
is exceeded, the tighter budget (larger used/budget ratio) picks its least-valuable entry;
on the memory side that entry is downgraded one width (8 -> 4 -> 2 -> 0 bits), on the time
side it is evicted. An entry is never taken below its ``floor_bits`` (the codec pins saves
already handed to autograd: they may shrink but not vanish); the entry being stored competes
too, so a new entry worth less per byte than every stored one is itself downgraded.

resize(): the capacity moves in whole ``step`` bytes (DAF: 100 MB steps). Shrinking first
downgrades/evicts until the used pages fit, then moves runs lying past the new end into
free runs below (compaction), then shrinks the storage in place (views stay valid); if
pinned entries cannot fit, the arena keeps the smallest capacity that holds them and
reports the excess in ``over_budget`` (no crash; the next batch plans with the new budget).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor
from tta_kernels import Quantized, n_groups, packed_nbytes, quantize_pack, unpack_dequantize

DOWNGRADE = {8: 4, 4: 2, 2: 0}


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def block_nbytes(numel: int, bits: int, group: int) -> int:
    """Arena bytes of one entry: codes (padded to 4 bytes) + float32 min and scale per group."""
    return 0 if bits == 0 else _pad4(packed_nbytes(numel, bits, group)) + 8 * n_groups(numel,
                                                                                        group)


@dataclass
class Block:
    """A page-table entry: where an activation lives and what it is worth."""

    key: Hashable
    numel: int
    dtype: torch.dtype
    bits: int
    group: int
    importance: float
    time_ms: float
    floor_bits: int
    page: int = -1
    n_pages: int = 0
    version: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the packed entry at its current width."""
        return block_nbytes(self.numel, self.bits, self.group)

    def per_byte(self) -> float:
        return self.importance / max(self.nbytes, 1)

    def per_ms(self) -> float:
        return self.importance / max(self.time_ms, 1e-9)


class _MinQueue:
    """Min-heap with lazy invalidation (entries carry the block version they were pushed at)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.heap: list[tuple[float, int, Hashable, int]] = []
        self._seq = itertools.count()

    def push(self, b: Block) -> None:
        value = b.per_byte() if self.key == "byte" else b.per_ms()
        heapq.heappush(self.heap, (value, next(self._seq), b.key, b.version))

    def peek(self, table: dict[Hashable, Block], skip: set[Hashable]) -> Block | None:
        """The valid entry with the least key that is not in `skip` and can still shrink."""
        stale = []
        found = None
        while self.heap:
            _v, _s, key, version = self.heap[0]
            b = table.get(key)
            if b is None or b.version != version:
                heapq.heappop(self.heap)
                continue
            if key in skip or b.bits <= b.floor_bits:
                stale.append(heapq.heappop(self.heap))
                continue
            found = b
            break
        for item in stale:
            heapq.heappush(self.heap, item)
        return found


class PagedArena:
    """A byte arena of at most `budget` bytes in pages; put/get/remove/resize (module doc)."""

    def __init__(self, budget: int, page_size: int = 65536, step: int | None = None,
                 time_budget_ms: float | None = None, group: int = 128,
                 device: str | torch.device = "cpu") -> None:
        if page_size < 8 or page_size % 8:
            raise ValueError(f"page_size must be a positive multiple of 8, got {page_size}")
        if budget < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {budget}")
        self.page_size, self.group = page_size, group
        self.step = step if step is not None else page_size
        if self.step < page_size or self.step % page_size:
            raise ValueError(f"step must be a multiple of page_size {page_size}, got {step}")
        self.time_budget_ms = time_budget_ms
        self.budget = budget
        self.buf = torch.empty(self._pages_for(budget) * page_size, dtype=torch.uint8,
                               device=device)
        self.free = [True] * self._pages_for(budget)
        self.table: dict[Hashable, Block] = {}
        self.mem_q, self.time_q = _MinQueue("byte"), _MinQueue("ms")
        self.over_budget = 0
        self.changes: list[tuple[Hashable, int, int]] = []  # (key, old bits, new bits)

    # ------------------------------------------------------------ sizes
    def _pages_for(self, budget: int) -> int:
        return budget // self.step * self.step // self.page_size

    def _pages(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size)

    @property
    def capacity(self) -> int:
        """Bytes of the arena now (whole steps, at most the budget unless over_budget)."""
        return len(self.free) * self.page_size

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages in use."""
        return sum(b.n_pages for b in self.table.values()) * self.page_size

    @property
    def used_time_ms(self) -> float:
        """Summed time cost of the stored entries."""
        return sum(b.time_ms for b in self.table.values())

    # ------------------------------------------------------------ page runs
    def _first_fit(self, n: int) -> int | None:
        run = 0
        for i, free in enumerate(self.free):
            run = run + 1 if free else 0
            if run == n:
                return i - n + 1
        return None

    def _place(self, b: Block, qt: Quantized) -> None:
        b.n_pages = self._pages(b.nbytes)
        page = self._first_fit(b.n_pages)
        if page is None:
            self._compact()
            page = self._first_fit(b.n_pages)
        if page is None:
            raise MemoryError(f"arena: no run of {b.n_pages} pages for {b.key!r}")
        b.page = page
        self.free[page:page + b.n_pages] = [False] * b.n_pages
        start = page * self.page_size
        codes = qt.codes.numel()
        meta = start + _pad4(codes)
        self.buf[start:start + codes].copy_(qt.codes)
        self.buf[meta:meta + 8 * qt.mn.numel()].view(torch.float32).copy_(
            torch.cat((qt.mn, qt.scale)))

    def _release(self, b: Block) -> None:
        self.free[b.page:b.page + b.n_pages] = [True] * b.n_pages
        b.page, b.n_pages = -1, 0

    def packed(self, key: Hashable) -> Quantized | None:
        """The entry's codes, mins and scales as views into the arena (None if absent)."""
        b = self.table.get(key)
        if b is None:
            return None
        start = b.page * self.page_size
        codes = packed_nbytes(b.numel, b.bits, b.group)
        g = n_groups(b.numel, b.group)
        meta = self.buf[start + _pad4(codes):start + _pad4(codes) + 8 * g].view(torch.float32)
        return Quantized(self.buf[start:start + codes], meta[:g], meta[g:])

    def get(self, key: Hashable) -> Tensor | None:
        """The entry dequantized (flat, its dtype), or None if not stored."""
        b, qt = self.table.get(key), self.packed(key)
        if b is None or qt is None:
            return None
        return unpack_dequantize(qt, b.bits, b.group, b.numel, b.dtype)

    def bits_of(self, key: Hashable) -> int:
        """The entry's width now (0: not stored)."""
        b = self.table.get(key)
        return 0 if b is None else b.bits

    # ------------------------------------------------------------ store / shrink
    def put(self, key: Hashable, x: Tensor, bits: int, importance: float,
            floor_bits: int = 0, time_ms: float = 0.0) -> int:
        """Store flat x at up to `bits` (Algorithm 3, forward pass); the width it got."""
        if bits not in (0, *DOWNGRADE) or floor_bits not in (0, *DOWNGRADE) \
                or floor_bits > bits:
            raise ValueError(f"bits {bits!r} / floor_bits {floor_bits!r} must be 0/2/4/8 "
                             "with floor_bits <= bits")
        self.remove(key)
        self.changes = []
        b = Block(key, x.numel(), x.dtype, bits, self.group, float(importance),
                  float(time_ms), floor_bits)
        self._make_room(b)
        if b.bits:
            self._place(b, quantize_pack(x.reshape(-1), b.bits, b.group))
            self.table[key] = b
            self._push(b)
        return b.bits

    def _push(self, b: Block) -> None:
        self.mem_q.push(b)
        if self.time_budget_ms is not None:
            self.time_q.push(b)

    def _time_ratio(self, extra: float) -> float:
        if self.time_budget_ms is None:
            return 0.0
        return (self.used_time_ms + extra) / max(self.time_budget_ms, 1e-9)

    def _make_room(self, new: Block) -> None:
        """Downgrade/evict the least valuable (new entry included) until new fits."""
        while new.bits:
            mem_ratio = ((self.used_bytes + self._pages(new.nbytes) * self.page_size)
                         / max(self.capacity, 1))
            time_ratio = self._time_ratio(new.time_ms)
            if mem_ratio <= 1.0 and time_ratio <= 1.0:
                return
            on_time = time_ratio > mem_ratio
            queue = self.time_q if on_time else self.mem_q
            victim = queue.peek(self.table, {new.key})
            worth = (lambda b: b.per_ms()) if on_time else (lambda b: b.per_byte())
            if new.bits > new.floor_bits and (victim is None or worth(new) <= worth(victim)):
                new.bits = new.floor_bits if on_time else DOWNGRADE[new.bits]
                continue
            if victim is None:
                raise MemoryError(f"arena budget {self.budget} B cannot hold {new.key!r} at "
                                  f"{new.floor_bits} bits: every entry is at its floor")
            self._downgrade(victim, victim.floor_bits if on_time else DOWNGRADE[victim.bits])

    def _downgrade(self, b: Block, bits: int) -> None:
        """Re-encode b at `bits` (0: evict) from its dequantized values."""
        self.changes.append((b.key, b.bits, bits))
        x = self.get(b.key)
        self._release(b)
        if bits == 0:
            del self.table[b.key]
            return
        b.bits, b.version = max(bits, b.floor_bits), b.version + 1
        self._place(b, quantize_pack(x, b.bits, b.group))
        self._push(b)

    def remove(self, key: Hashable) -> None:
        """Free an entry's pages (no-op when absent)."""
        b = self.table.pop(key, None)
        if b is not None:
            self._release(b)

    def _compact(self) -> None:
        """Move every run, in page order, to the lowest free pages (no gaps left)."""
        nxt = 0
        for b in sorted(self.table.values(), key=lambda b: b.page):
            if b.page != nxt:
                src = self.buf[b.page * self.page_size:(b.page + b.n_pages) * self.page_size]
                dst = nxt * self.page_size
                self.buf[dst:dst + src.numel()].copy_(src.clone())
                b.page = nxt
            nxt += b.n_pages
        self.free = [i >= nxt for i in range(len(self.free))]

    def resize(self, budget: int) -> list[tuple[Hashable, int, int]]:
        """Grow or shrink to `budget` bytes (whole steps); the downgrades it made."""
        self.changes = []
        self.budget = budget
        target = self._pages_for(budget)
        used = sum(b.n_pages for b in self.table.values())
        while used > target:
            victim = self.mem_q.peek(self.table, set())
            if victim is None:
                break
            self._downgrade(victim, DOWNGRADE[victim.bits])
            used = sum(b.n_pages for b in self.table.values())
        self._compact()
        step_pages = self.step // self.page_size
        pages = max(target, -(-used // step_pages) * step_pages)
        self.over_budget = max(0, pages - target) * self.page_size
        self.buf.untyped_storage().resize_(pages * self.page_size)
        self.buf = torch.empty(0, dtype=torch.uint8, device=self.buf.device).set_(
            self.buf.untyped_storage(), 0, (pages * self.page_size,))
        self.free = self.free[:pages] + [True] * (pages - len(self.free))
        return list(self.changes)
