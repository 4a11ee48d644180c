"""DAF paged activation store (tta_core.daf.arena): never over budget under random
put/remove/resize sequences (hypothesis), data intact through compaction, downgrade and
eviction order by importance per byte (per ms on the time side), shrinking with pinned
entries downgrades without a crash."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tta_core.daf.arena import PagedArena

PAGE = 1024


def _check_invariants(arena: PagedArena) -> None:
    owned = [False] * len(arena.free)
    for b in arena.table.values():
        assert b.n_pages == -(-b.nbytes // PAGE) and b.bits in (2, 4, 8)
        for p in range(b.page, b.page + b.n_pages):
            assert not owned[p], "two entries share a page"
            owned[p] = True
    assert [not f for f in arena.free] == owned, "free map disagrees with the page table"
    assert arena.used_bytes <= arena.capacity
    assert arena.buf.numel() == arena.capacity
    if all(b.floor_bits == 0 for b in arena.table.values()):
        assert arena.capacity <= arena.budget and arena.over_budget == 0


_OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 7), st.integers(1, 6000), st.sampled_from((2, 4, 8)),
              st.floats(0.01, 100.0)),
    st.tuples(st.just("remove"), st.integers(0, 7)),
    st.tuples(st.just("resize"), st.integers(0, 64 * PAGE)),
), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(_OPS, st.integers(0, 2**31 - 1))
def test_arena_never_exceeds_its_budget_and_keeps_data(ops: list, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    arena = PagedArena(32 * PAGE, page_size=PAGE, group=64)
    original: dict[int, tuple[torch.Tensor, int]] = {}
    for op in ops:
        if op[0] == "put":
            _, key, n, bits, imp = op
            x = torch.randn(n, generator=gen)
            got = arena.put(key, x, bits, imp)
            assert got == arena.bits_of(key) and got <= bits
            original[key] = (x, got)
        elif op[0] == "remove":
            arena.remove(op[1])
            original.pop(op[1], None)
        else:
            arena.resize(op[1])
        _check_invariants(arena)
        for key, (x, bits) in original.items():
            if arena.bits_of(key) == bits and bits:  # never downgraded: exact codes
                err = (arena.get(key) - x).abs().max()
                assert float(err) <= float(x.max() - x.min()) / (2**bits - 1) / 2 + 1e-5


def test_memory_pressure_downgrades_least_importance_per_byte_first() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 4000  # 8 bits: 4000 + 8 * 63 bytes -> 5 pages
    arena = PagedArena(20 * PAGE, page_size=PAGE, group=64)
    importance = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 4.0}
    for key, imp in importance.items():
        assert arena.put(key, torch.randn(n, generator=gen), 8, imp) == 8
    assert arena.used_bytes == arena.capacity
    arena.put("e", torch.randn(n, generator=gen), 8, 10.0)
    # pages at 8/4/2 bits: 5/3/2 (4536/2520/1512 B); e needs 5 free pages. Least importance
    # per byte: b@8 (1/4536) -> b@4 (1/2520 < c's 2/4536) -> c@8 (2/4536 < b@2's 1/1512)
    assert arena.changes == [("b", 8, 4), ("b", 4, 2), ("c", 8, 4)]
    assert [arena.bits_of(k) for k in "abcde"] == [8, 2, 4, 8, 8]
    assert arena.used_bytes == arena.capacity == 20 * PAGE


def test_per_byte_not_raw_importance_picks_the_victim() -> None:
    """A big entry of moderate importance goes before a small one of lower importance."""
    gen = torch.Generator().manual_seed(1)
    arena = PagedArena(16 * PAGE, page_size=PAGE, group=64)
    arena.put("big", torch.randn(8000, generator=gen), 8, 2.0)   # 9 pages, 2.0 / ~8.5 KB
    arena.put("small", torch.randn(1000, generator=gen), 8, 1.0)  # 2 pages, 1.0 / ~1.1 KB
    arena.put("new", torch.randn(6000, generator=gen), 8, 50.0)  # 7 pages: 2 short
    assert arena.changes == [("big", 8, 4)]
    assert arena.bits_of("small") == 8


def test_a_new_entry_worth_less_per_byte_is_itself_downgraded() -> None:
    gen = torch.Generator().manual_seed(2)
    arena = PagedArena(10 * PAGE, page_size=PAGE, group=64)
    arena.put("a", torch.randn(4000, generator=gen), 8, 5.0)
    arena.put("b", torch.randn(4000, generator=gen), 8, 5.0)
    assert arena.put("cheap", torch.randn(4000, generator=gen), 8, 0.1) == 0
    assert arena.bits_of("a") == arena.bits_of("b") == 8 and arena.changes == []


def test_time_budget_evicts_least_importance_per_ms() -> None:
    gen = torch.Generator().manual_seed(3)
    arena = PagedArena(64 * PAGE, page_size=PAGE, time_budget_ms=10.0, group=64)
    arena.put("slow", torch.randn(100, generator=gen), 8, 4.0, time_ms=6.0)  # 0.67 / ms
    arena.put("fast", torch.randn(100, generator=gen), 8, 1.0, time_ms=1.0)  # 1.0 / ms
    arena.put("new", torch.randn(100, generator=gen), 8, 6.0, time_ms=5.0)   # 1.2 / ms
    assert arena.changes == [("slow", 8, 0)]
    assert arena.bits_of("fast") == arena.bits_of("new") == 8
    assert arena.used_time_ms <= 10.0


def test_shrinking_with_pinned_entries_downgrades_without_a_crash() -> None:
    gen = torch.Generator().manual_seed(4)
    arena = PagedArena(64 * PAGE, page_size=PAGE, step=4 * PAGE, group=64)
    xs = {k: torch.randn(6000, generator=gen) for k in range(6)}
    for k, x in xs.items():
        arena.put(k, x, 8, float(k + 1), floor_bits=2)
    changes = arena.resize(20 * PAGE)
    assert changes and all(new >= 2 for _k, _old, new in changes)
    assert arena.used_bytes <= arena.capacity == 20 * PAGE and arena.over_budget == 0
    assert arena.bits_of(0) < arena.bits_of(5)  # the least important went down first
    arena.resize(3 * PAGE)  # below what the pinned entries need at 2 bits
    assert all(arena.bits_of(k) == 2 for k in xs)
    assert arena.over_budget > 0 and arena.capacity % (4 * PAGE) == 0
    for k, x in xs.items():  # still decodable (coarser)
        assert float((arena.get(k) - x).abs().max()) < float(x.max() - x.min())
    arena.resize(64 * PAGE)  # grows back in steps
    assert arena.capacity == 64 * PAGE and arena.over_budget == 0
    _check_invariants(arena)


def _r18_grads(ctx) -> torch.Tensor:
    from helpers.models import flat_grads, resnet18_64px

    model, x = resnet18_64px()
    return flat_grads(model, x, ctx(model))


def test_arena_codec_with_room_gives_the_plain_codecs_gradients(monkeypatch) -> None:
    """Same quantization, stored in pages and read back through views: bit-identical (the
    plain codec with each save decoded on its own, as pages are: no shared ReLU decode)."""
    from tta_core.daf.arena_codec import ArenaCodec
    from tta_core.memory import ActivationCodec, CodecPlan

    monkeypatch.setattr(ActivationCodec, "_share_relu_decode", lambda *a: None)
    plan = CodecPlan(default_bits=4, norm_bits=8)
    arena = PagedArena(64 * 2**20, page_size=4096)
    plain = _r18_grads(lambda m: ActivationCodec(m, plan))
    paged = _r18_grads(lambda m: ArenaCodec(m, plan, arena))
    assert torch.equal(plain, paged)
    assert 0 < arena.used_bytes <= arena.capacity and not arena.changes


def test_arena_codec_under_a_tight_budget_downgrades_the_least_important() -> None:
    from helpers.models import cosine, flat_grads, resnet18_64px

    from tta_core.daf.arena_codec import ArenaCodec
    from tta_core.memory import ActivationCodec, CodecPlan

    model, x = resnet18_64px()
    plan = CodecPlan(default_bits=8, norm_bits=8)
    roomy = ActivationCodec(model, plan)
    exact = flat_grads(model, x, roomy)
    importance = {n: (10.0 if n.startswith("layer4") else 1.0)
                  for n, _m in model.named_modules() if n}
    arena = PagedArena(roomy.result.total // 2, page_size=4096)
    codec = ArenaCodec(model, plan, arena, importance)
    got = flat_grads(model, x, codec)
    widths = {b.bits for b in arena.table.values()}
    assert arena.used_bytes <= arena.capacity and codec.overflow_bytes == 0
    assert min(widths) >= 2 and len(widths) > 1
    units = codec.scope.unit_names
    assert all(arena.bits_of(k) == 8 for k, b in arena.table.items()
               if b.importance == 10.0), "important entries were downgraded"
    assert cosine(exact, got) >= 0.95 and len(units) > 0
    tiny = PagedArena(64 * 4096, page_size=4096)  # far too small even at 2 bits
    squeezed = ArenaCodec(model, plan, tiny, importance)
    flat_grads(model, x, squeezed)  # no crash: the excess is stored outside and reported
    assert squeezed.overflow_bytes > 0 and tiny.used_bytes <= tiny.capacity
