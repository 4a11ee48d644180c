"""tta_kernels.bn_stats: robust BN's one-read statistics pass equals
torch.batch_norm_update_stats (batch mean, biased variance, running statistics moved)."""

from __future__ import annotations

import pytest
import torch
from tta_kernels import bn_stats, native

SHAPES = [(4, 8, 56, 56), (2, 3, 23, 29), (1, 16, 1, 600), (8, 32, 7, 7), (16, 6, 40)]


def _input(shape: tuple[int, ...], mean: float, std: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * std + mean


def _check(shape: tuple[int, ...], mean: float, std: float, momentum: float,
           channels_last: bool = False) -> None:
    x = _input(shape, mean, std, sum(shape))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    c = shape[1]
    rm = torch.linspace(-0.5, 0.5, c) + mean
    rv = torch.linspace(0.5, 2.0, c)
    ref_m, ref_v = rm.clone(), rv.clone()
    want = torch.batch_norm_update_stats(x, ref_m, ref_v, momentum)
    start_m, start_v = rm.double(), rv.double()
    got = bn_stats.update_stats(x, rm, rv, momentum)
    exact = x.double().transpose(0, 1).reshape(c, -1)
    e_mean, e_var = exact.mean(1), exact.var(1, unbiased=False)
    # against the exact (double) statistics; against PyTorch's too for NCHW (Welford):
    # its channels-last pass sums in float, off by ~2e-6 relative on the mean and, at mean
    # 500 / std 0.01, by 3e-4 on the variance, where this pass is within 2e-5
    scale = 1e-6 * (1 + abs(mean))
    torch.testing.assert_close(got[0].double(), e_mean, rtol=1e-6, atol=scale)
    torch.testing.assert_close(got[1].double(), e_var, rtol=2e-5, atol=1e-12)
    if not channels_last:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=scale)
        torch.testing.assert_close(rv, ref_v, rtol=2e-5, atol=1e-12)
    torch.testing.assert_close(rm.double(), (1 - momentum) * start_m + momentum * e_mean,
                               rtol=1e-6, atol=scale)
    torch.testing.assert_close(rv.double(), (1 - momentum) * start_v + momentum * exact.var(1),
                               rtol=2e-5, atol=1e-12)


# channels-last: more rows than one block (64), channel counts off the 8-lane width
CL_SHAPES = [(4, 8, 56, 56), (2, 13, 23, 29), (1, 2050, 2, 3), (3, 64, 5, 7),
             (3, 520, 5, 9),  # wide rows: 135 rows, walked 8 at a time
             (2, 72, 120, 125)]  # beyond STREAM_VALUES: walked one row at a time


@pytest.mark.parametrize("shape", SHAPES)
def test_equals_torch_update_stats_and_moves_running_stats(shape) -> None:
    assert bn_stats.library() is not None, "bn_stats.c did not build here"
    for mean, std in ((0.3, 0.5), (-2.0, 3.0)):
        _check(shape, mean, std, 0.1)


@pytest.mark.parametrize("shape", CL_SHAPES)
def test_channels_last_equals_torch_update_stats(shape) -> None:
    for mean, std in ((0.3, 0.5), (-2.0, 3.0)):
        _check(shape, mean, std, 0.1, channels_last=True)


@pytest.mark.parametrize("channels_last", [False, True])
def test_large_mean_small_spread_keeps_the_variance(channels_last) -> None:
    """mean 500, std 0.01 (squares 2.5e9 × the variance): values summed about a value of
    their own channel keep the variance where E[x²] − E[x]² would lose it all."""
    _check((4, 8, 32, 32), 500.0, 0.01, 0.05, channels_last)


def test_without_running_stats_returns_batch_stats_only() -> None:
    x = _input((4, 8, 30, 30), 0.2, 1.0, 3)
    want = torch.batch_norm_update_stats(x, None, None, 0.0)
    got = bn_stats.update_stats(x, None, None, 0.0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-7)


def test_layouts_and_dtypes_it_does_not_take_go_to_torch(monkeypatch) -> None:
    """Strided views, float64, tiny tensors: PyTorch's pass (the C library is not called)."""
    calls = []
    real = bn_stats.library()
    monkeypatch.setattr(bn_stats, "library", lambda: calls.append(1) or real)
    for x in (_input((4, 8, 30, 60), 0.0, 1.0, 1)[..., ::2],
              _input((4, 8, 30, 30), 0.0, 1.0, 2).double(), _input((2, 3, 4, 4), 0.0, 1.0, 3)):
        rm, rv = torch.zeros(8, dtype=x.dtype)[: x.shape[1]], torch.ones(x.shape[1], dtype=x.dtype)
        want = torch.batch_norm_update_stats(x, rm.clone(), rv.clone(), 0.1)
        got = bn_stats.update_stats(x, rm, rv, 0.1)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert calls == []
    x = _input((4, 8, 30, 30), 0.0, 1.0, 4)
    bn_stats.update_stats(x, None, None, 0.0)
    assert calls == [1]


def test_falls_back_to_torch_without_a_compiler(monkeypatch) -> None:
    monkeypatch.setattr(bn_stats, "library", lambda: None)
    x = _input((4, 8, 30, 30), 1.0, 2.0, 5)
    want = torch.batch_norm_update_stats(x, None, None, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(bn_stats.update_stats(x, None, None, 0.0),
                                                  want, strict=True))


@pytest.mark.slow
def test_portable_build_equals_torch(monkeypatch, tmp_path) -> None:
    """bn_stats.c with -DDAF_PORTABLE (the plain loops a non-x86 target compiles)."""
    monkeypatch.setenv("TTA_KERNELS_CACHE", str(tmp_path))
    lib = bn_stats.load(native.build(("-DDAF_PORTABLE",), source=bn_stats.SOURCE))
    monkeypatch.setattr(bn_stats, "library", lambda: lib)
    for shape in SHAPES[:3]:
        _check(shape, 0.3, 0.5, 0.1)
    for shape in CL_SHAPES[:2]:
        _check(shape, 0.3, 0.5, 0.1, channels_last=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
def test_normalise_update_is_eval_bn_then_the_same_statistics(channels_last, threads) -> None:
    """One read: the output is eval-mode BN with the running statistics as they were, the
    batch and moved statistics those of update_stats (bit for bit, same thread count);
    channel counts off the 8- and 16-lane widths, with and without an affine."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_normalise(channels_last)
    finally:
        torch.set_num_threads(old)


def _check_normalise(channels_last: bool) -> None:
    shapes = CL_SHAPES if channels_last else SHAPES[:4]
    for k, shape in enumerate([*shapes, (2, 40, 9, 9)]):
        affine = k % 2 == 0
        x = _input(shape, 0.3, 2.0, sum(shape))
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        c = shape[1]
        rm, rv = torch.linspace(-0.5, 0.5, c), torch.linspace(0.5, 2.0, c)
        w, b = (torch.linspace(0.5, 1.5, c), torch.linspace(-1, 1, c)) if affine else (None,) * 2
        want = torch.nn.functional.batch_norm(x, rm, rv, w, b, False, 0.0, 1e-5)
        ref_m, ref_v = rm.clone(), rv.clone()
        stats = bn_stats.update_stats(x, ref_m, ref_v, 0.1)
        before = rm.clone(), rv.clone()
        got = bn_stats.normalise_update(x, rm, rv, 0.1, w, b, 1e-5, k % 2 == 1)
        assert got is not None and len(got) == (5 if k % 2 == 1 else 3)
        if k % 2 == 1:  # keep_old: the statistics the output was normalised by
            assert torch.equal(got[3], before[0]) and torch.equal(got[4], before[1])
        torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
        assert got[0].is_contiguous(memory_format=torch.channels_last if channels_last
                                    else torch.contiguous_format)
        assert torch.equal(got[1], stats[0]) and torch.equal(got[2], stats[1])
        assert torch.equal(rm, ref_m) and torch.equal(rv, ref_v)


def test_normalise_update_declines_what_the_kernel_does_not_take() -> None:
    x = _input((4, 8, 30, 30), 0.0, 1.0, 6)
    rm, rv = torch.zeros(8), torch.ones(8)
    assert bn_stats.normalise_update(x.double(), rm.double(), rv.double(), 0.1, None, None,
                                     1e-5) is None
    assert bn_stats.normalise_update(x[..., ::2], rm, rv, 0.1, None, None, 1e-5) is None
    assert bn_stats.normalise_update(x, rm, rv, 0.1, torch.ones(7), None, 1e-5) is None
    assert torch.equal(rm, torch.zeros(8))  # nothing moved
