"""tta_kernels (DAF quantize + pack): exact integer round trips at 2/4/8 bits, every CPU
path equal to the pure-PyTorch reference bit for bit (the fused C kernel and its mask
variant included, NaN/inf groups and reciprocal-sensitive groups too), CUDA when a GPU is
present, import and fallback without GPU/compiler. The Triton kernels in Triton's
interpreter: test_kernels_triton.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import tta_kernels
from helpers import ROOT, kernel_checks
from tta_kernels import cpu, dispatch, native, reference

SHAPES = (1, 7, 128, 1000, 4096 + 5)
GROUPS = (8, 24, 64, 128)

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    const = torch.full((n,), 3.25)
    mixed = x.clone()
    mixed[: n // 2] = -7.0  # constant groups next to varied ones
    relu = torch.relu(x) * 1e3  # many zeros, large values
    return [x, const, mixed, relu]


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_pack_unpack_round_trip_is_exact_for_integer_codes(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2**bits, (8 * 1000,), generator=g, dtype=torch.uint8)
    packed = reference.pack_codes(q, bits)
    assert packed.numel() == q.numel() * bits // 8
    assert torch.equal(reference.unpack_codes(packed, bits), q)
    assert torch.equal(cpu._pack(q, bits), packed)
    assert torch.equal(cpu.unpack_codes(packed, bits), q)
    # layout: code k in byte k // (8 / bits) at bit bits * (k % (8 / bits))
    per = 8 // bits
    k = 5 * per + per - 1
    assert (int(packed[5]) >> (bits * (per - 1))) & (2**bits - 1) == int(q[k])


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_integer_valued_groups_decode_exactly(bits: int) -> None:
    """Values already on the grid (integers 0..L, each group spanning 0 and L) come back."""
    levels = 2**bits - 1
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, levels + 1, (64, 128), generator=g).float()
    q[:, 0], q[:, 1] = 0, levels
    for impl in (reference, cpu, tta_kernels):
        qt = impl.quantize_pack(q.reshape(-1), bits, 128)
        back = impl.unpack_dequantize(qt, bits, 128, q.numel(), torch.float32)
        assert torch.equal(back, q.reshape(-1)), impl.__name__


@pytest.mark.parametrize("bits", (2, 4, 8))
@pytest.mark.parametrize("n", SHAPES)
def test_vectorised_path_equals_reference_bit_for_bit(bits: int, n: int) -> None:
    for x in _inputs(n, n):
        for group in GROUPS:
            ref = reference.quantize_pack(x, bits, group)
            fast = cpu.quantize_pack(x, bits, group)
            for a, b in zip(ref, fast, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (n, group)
            dense = reference.unpack_dequantize(ref, bits, group, n, x.dtype)
            assert torch.equal(cpu.unpack_dequantize(ref, bits, group, n, x.dtype), dense)
            err = (dense - x).abs().view(-1)
            span = (x.max() - x.min()).item()
            assert float(err.max()) <= span / (2**bits - 1) / 2 + 1e-5 * (1 + span)


@pytest.mark.parametrize("bits", (2, 4, 8))
@pytest.mark.parametrize("n", SHAPES)
def test_native_path_equals_reference_bit_for_bit(bits: int, n: int) -> None:
    """The C passes (tta_kernels.native, built with this machine's compiler: the fused
    kernel and the two-pass baseline) give the reference's codes, minima, scales and decoded
    values exactly."""
    for x in _inputs(n, n + 1):
        for group in GROUPS:
            ref = reference.quantize_pack(x, bits, group)
            for fast in (native.quantize_pack(x, bits, group),
                         native.quantize_pack_two_pass(x, bits, group)):
                for a, b in zip(ref, fast, strict=True):
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            dense = reference.unpack_dequantize(ref, bits, group, n, x.dtype)
            assert torch.equal(native.unpack_dequantize(ref, bits, group, n, x.dtype), dense)


@pytest.mark.parametrize("band", ((0.0, float("inf")), (-1.0, 1.0), (0.0, 6.0)))
def test_native_masks_equal_the_pytorch_packing(band: tuple[float, float]) -> None:
    """The C mask passes pack lo < x < hi (NaN: 0) in tta_core.memory.bits' layout and decode
    to the same floats as the PyTorch decode (bit * (inside - lo) + lo)."""
    from tta_core.memory.bits import pack_bits, unpack_bits
    from tta_core.memory.packed import PackedMask

    lo, hi = band
    for n in (1, 7, 8, 1001, 4096 + 3):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
        x[::7] = float("nan")
        x[1::11] = lo  # on the edge: outside
        want = pack_bits((x > lo) & (x < hi))
        got = native.mask_pack(x, lo, hi)
        assert torch.equal(got, want), n
        inside = PackedMask.encode(x, band).inside
        ref = unpack_bits(want, n).float()
        if (lo, inside) != (0.0, 1.0):
            ref = ref * (inside - lo) + lo
        assert torch.equal(native.mask_unpack(got, n, lo, inside), ref), n
    assert dispatch.native_masks(torch.float32, torch.device("cpu"))
    assert not dispatch.native_masks(torch.float16, torch.device("cpu"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and values, NaN matching NaN."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _special_inputs() -> list[torch.Tensor]:
    """NaN and +-inf groups, reciprocal-sensitive groups (codes that change if L / rng is
    computed as one division instead of PyTorch's (1 / rng) * L), signed zeros."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(9))
    x[5], x[300], x[301], x[700] = float("nan"), float("inf"), -float("inf"), float("inf")
    zeros = torch.zeros(200)
    zeros[1::2] = -0.0
    return [x, zeros, *(kernel_checks.reciprocal_sensitive(b, 8, rows=4) for b in (2, 4, 8))]


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_fused_kernel_handles_nan_inf_and_reciprocal_sensitive_groups(bits: int) -> None:
    """The fused C kernel computes min/max and both scales itself: NaN groups get NaN min
    and scale and the reference's codes, inf groups and reciprocal-sensitive groups the
    reference's bytes (the two-pass form, which takes PyTorch's scales, as well)."""
    for x in _special_inputs():
        ref = reference.quantize_pack(x, bits, 8)
        for fast in (native.quantize_pack(x, bits, 8), native.quantize_pack_two_pass(x, bits, 8)):
            assert all(_same(a, b) for a, b in zip(ref, fast, strict=True)), x[:4]
    x = _special_inputs()[0]
    assert native.quantize_pack(x, bits, 128).mn.isnan().tolist() == [True] + [False] * 7


@pytest.mark.parametrize("band", ((0.0, float("inf")), (-1.0, 1.0)))
def test_fused_mask_variant_gives_both_encodings_of_one_tensor(band: tuple[float, float]
                                                               ) -> None:
    """quantize_pack_mask: the reference's quantized bytes and tta_core.memory.bits' packing
    of lo < x < hi (NaN: 0, tail byte zero-padded) from one pass; the dispatcher's
    fallback (vectorised path) gives the same pair."""
    from tta_core.memory.bits import pack_bits

    for n in (1, 13, 1000, 4096 + 3):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 2
        x[::17] = float("nan")
        x[1::11] = band[0]
        want = pack_bits((x > band[0]) & (x < band[1]))
        assert torch.equal(reference.mask_bits(x, band), want)
        for group in (8, 24, 128):
            ref = reference.quantize_pack(x, 4, group)
            qt, mask = native.quantize_pack_mask(x, 4, group, band)
            assert torch.equal(mask, want) and all(
                _same(a, b) for a, b in zip(ref, qt, strict=True)), (n, group)
    qt, mask = tta_kernels.quantize_pack_mask(x, 2, 64, band)
    assert torch.equal(mask, want) and torch.equal(qt.codes, reference.quantize_pack(
        x, 2, 64).codes)
    with pytest.raises(ValueError, match="band must satisfy lo < hi"):
        native.quantize_pack_mask(x, 4, 8, (1.0, 1.0))


def test_fused_mask_variant_falls_back_off_the_native_path(monkeypatch) -> None:
    monkeypatch.setenv("TTA_KERNELS_CPU", "vectorised")
    x = torch.relu(torch.randn(777, generator=torch.Generator().manual_seed(1)))
    qt, mask = tta_kernels.quantize_pack_mask(x, 8, 128, (0.0, float("inf")))
    assert all(torch.equal(a, b) for a, b in zip(qt, reference.quantize_pack(x, 8, 128),
                                                 strict=True))
    assert torch.equal(mask, reference.mask_bits(x, (0.0, float("inf"))))


def test_relu_decode_agrees_with_the_exact_mask() -> None:
    """unpack_dequantize_relu of a ReLU output: the reference decode made to agree with the
    exact mask (set bit and value 0 -> 2**-64; NaN stays NaN), in one C pass bit for bit;
    value > 0 exactly where x > 0, and within half a step of x as the plain decode is."""
    g = torch.Generator().manual_seed(3)
    for n in (5, 1001, 4096 + 3):
        x = torch.relu(torch.randn(n, generator=g))
        x[3::97] = 1e-6  # positives that round to the group's min 0
        x[1::251] = float("nan")
        mask = native.mask_pack(x, 0.0, float("inf"))
        for bits in (2, 4, 8):
            for group in (8, 24, 256):
                qt = reference.quantize_pack(x, bits, group)
                plain = reference.unpack_dequantize(qt, bits, group, n)
                want = reference.relu_agree(plain, mask)
                got = native.unpack_dequantize_relu(qt, bits, group, n, mask)
                assert _same(got, want), (n, bits, group)
                assert torch.equal(got > 0, x > 0)
                moved = (got != plain) & ~plain.isnan()
                assert torch.equal(got[moved], torch.full_like(got[moved], reference.RELU_TINY))
    with pytest.raises(ValueError, match="mask must be 1-D uint8 covering n=16"):
        native.unpack_dequantize_relu(qt, 2, 8, 16, torch.zeros(1, dtype=torch.uint8))


@pytest.mark.slow
def test_portable_c_loops_equal_the_intrinsics_build(monkeypatch, tmp_path) -> None:
    """daf_cpu.c built with -DDAF_PORTABLE (the generic loops a non-x86 target compiles)
    gives the same bytes as the reference."""
    monkeypatch.setenv("TTA_KERNELS_CACHE", str(tmp_path))
    lib = native.load(native.build(("-DDAF_PORTABLE",)))
    monkeypatch.setattr(native, "library", lambda: lib)
    for x in [*_inputs(1000 + 5, 2), *_special_inputs()]:
        for bits in (2, 4, 8):
            for group in (8, 24, 128):
                ref = reference.quantize_pack(x, bits, group)
                qt, mask = native.quantize_pack_mask(x, bits, group, (0.0, float("inf")))
                assert all(_same(a, b) for a, b in zip(ref, qt, strict=True)), (bits, group)
                assert torch.equal(mask, reference.mask_bits(x, (0.0, float("inf"))))
    from tta_core.memory.bits import unpack_bits

    for n in (1, 8, 13, 1001):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        packed = native.mask_pack(x, 0.0, float("inf"))
        want = unpack_bits(packed, n).float() * (0.5 - -1.0) + -1.0
        assert torch.equal(native.mask_unpack(packed, n, -1.0, 0.5), want), n
        qt = reference.quantize_pack(x.relu(), 2, 8)
        plain = reference.unpack_dequantize(qt, 2, 8, n)
        assert torch.equal(native.unpack_dequantize_relu(qt, 2, 8, n, packed),
                           reference.relu_agree(plain, packed)), n


@pytest.mark.slow
def test_native_is_the_default_where_a_compiler_is_and_falls_back_without(tmp_path) -> None:
    """With a C compiler the CPU default is the native path (its library cached under
    TTA_KERNELS_CACHE, keyed by source, flags, compiler and CPU); without one (CC names
    nothing) the first call warns once and the vectorised path answers with the same bytes."""
    code = """
        import warnings, torch, tta_kernels
        from tta_kernels import native, reference
        from tta_core.memory.packed import PackedMask
        x = torch.randn(5000)
        ref = reference.quantize_pack(x, 4, 64)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = [tta_kernels.quantize_pack(x, 4, 64) for _ in range(2)]
            mask = PackedMask.encode(x, (0.0, float("inf"))).decode()
        assert all(torch.equal(a, b) for g in got for a, b in zip(ref, g))
        assert torch.equal(mask, (x > 0).float())
        print(tta_kernels.backend(x), len(seen), seen[0].message if seen else "")
    """
    cache = tmp_path / "cache"
    ok = _python(code, TTA_KERNELS_CACHE=str(cache))
    assert ok.returncode == 0 and ok.stdout.split()[:2] == ["native", "0"], ok.stderr[-2000:]
    assert len(list(cache.glob("libdaf_cpu-*.so"))) == 1
    bad = _python(code, TTA_KERNELS_CACHE=str(cache / "none"), CC="no-such-cc")
    assert bad.returncode == 0, bad.stderr[-2000:]
    assert bad.stdout.split()[:2] == ["vectorised", "1"] and "no-such-cc" in bad.stdout
    with pytest.raises(ValueError, match="CPU tensors"):
        native.unpack_dequantize(reference.quantize_pack(torch.randn(8), 4, 8)._replace(
            mn=torch.zeros(1, device="meta")), 4, 8, 8)


def test_half_precision_inputs_decode_to_their_dtype() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float16, torch.bfloat16):
        xh = x.to(dtype)
        ref = reference.quantize_pack(xh, 8, 64)
        fast = cpu.quantize_pack(xh, 8, 64)
        assert all(torch.equal(a, b) for a, b in zip(ref, fast, strict=True))
        out = cpu.unpack_dequantize(fast, 8, 64, 1000, dtype)
        assert out.dtype == dtype
        assert torch.equal(out, reference.unpack_dequantize(ref, 8, 64, 1000, dtype))


@pytest.mark.slow
def test_compiled_path_equals_reference_or_falls_back(monkeypatch) -> None:
    """The torch.compile path (or, without a working compiler, its fallback) gives the
    reference's bytes; the dispatcher names the path it took."""
    monkeypatch.setenv("TTA_KERNELS_CPU", "compiled")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    got = tta_kernels.quantize_pack(x, 4, 64)
    ref = reference.quantize_pack(x, 4, 64)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    back = tta_kernels.unpack_dequantize(got, 4, 64, 3000, torch.float32)
    assert torch.equal(back, reference.unpack_dequantize(ref, 4, 64, 3000))
    assert tta_kernels.backend(x) in ("compiled", "vectorised")


def test_dispatch_rejects_bad_arguments_in_one_line(monkeypatch) -> None:
    with pytest.raises(ValueError, match="bits must be one of"):
        tta_kernels.quantize_pack(torch.randn(16), 3, 8)
    with pytest.raises(ValueError, match="group must be a positive multiple of 8"):
        tta_kernels.quantize_pack(torch.randn(16), 4, 12)
    monkeypatch.setenv("TTA_KERNELS_CPU", "fastest")
    with pytest.raises(ValueError, match="TTA_KERNELS_CPU must be one of"):
        tta_kernels.quantize_pack(torch.randn(16), 4, 8)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    paths = [str(ROOT), *sys.path]
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=240, env=full, cwd=ROOT)


@pytest.mark.slow
def test_import_needs_no_gpu_and_missing_triton_falls_back_with_one_notice() -> None:
    code = """
        import sys, warnings
        sys.modules["triton"] = None  # as on a machine without triton
        import torch, tta_kernels
        from tta_kernels import dispatch
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert dispatch.triton_module() is None
            assert dispatch.triton_module() is None
        assert len(seen) == 1 and "triton unavailable" in str(seen[0].message), seen
        x = torch.randn(100)
        assert tta_kernels.backend(x) == "vectorised"
        print("ok")
    """
    proc = _python(code, CUDA_VISIBLE_DEVICES="", TTA_KERNELS_CPU="vectorised")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.cuda
def test_cuda_dispatch_equals_reference_bit_for_bit() -> None:
    assert dispatch.backend(torch.zeros(1, device="cuda")) == "triton"
    for n in SHAPES:
        for x in _inputs(n, n):
            for bits in (2, 4, 8):
                ref = reference.quantize_pack(x, bits, 128)
                got = tta_kernels.quantize_pack(x.cuda(), bits, 128)
                assert all(torch.equal(a, b.cpu()) for a, b in zip(ref, got, strict=True))
                back = tta_kernels.unpack_dequantize(got, bits, 128, n, torch.float32)
                assert torch.equal(back.cpu(), reference.unpack_dequantize(ref, bits, 128, n))


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_native_passes_split_among_threads_give_the_same_bytes(bits: int) -> None:
    """Above native.MIN_THREADED values a pass splits its groups among torch's threads
    (OpenMP): encoding, mask and the ReLU decode are the bytes of the one-thread pass."""
    n = native.MIN_THREADED * 2 + 37
    x = torch.relu(torch.randn(n, generator=torch.Generator().manual_seed(bits))) * 5
    x[11::1009] = float("nan")
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert native.threads(n) == threads
        qt, mask = native.quantize_pack_mask(x, bits, 256, (0.0, float("inf")))
        runs.append((*qt, mask, native.unpack_dequantize(qt, bits, 256, n),
                     native.unpack_dequantize_relu(qt, bits, 256, n, mask)))
    torch.set_num_threads(1)  # as the one_thread fixture set it
    assert all(_same(a, b) for a, b in zip(*runs, strict=True))
    ref = reference.quantize_pack(x, bits, 256)
    assert all(_same(a, b) for a, b in zip(ref, runs[1][:3], strict=True))
