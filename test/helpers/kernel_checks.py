"""Bit-exactness checks of tta_kernels.triton_kernels against the reference, shared by the
interpreter tests (run in a subprocess with TRITON_INTERPRET=1: triton.jit reads it when
triton itself and each kernel are defined, so it must be set before triton is imported)
and the CUDA test (run in process on the GPU).

    python -m helpers.kernel_checks fused_2 hybrid_minmax ...   # prints {name: "ok" | error}
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback
from collections.abc import Callable
from types import ModuleType

import torch
from tta_kernels import reference


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and values, NaN matching NaN (either tensor on any device)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() and not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(a.nan_to_num(), b.nan_to_num())


def check_quantize(mod: ModuleType, x: torch.Tensor, bits: int, group: int,
                   **kw: object) -> None:
    """mod.quantize_pack(x) has the reference's codes, minima and scales."""
    ref = reference.quantize_pack(x.cpu(), bits, group)
    got = mod.quantize_pack(x, bits, group, **kw)
    for name, a, b in zip(("codes", "mn", "scale"), ref, got, strict=True):
        assert same(a, b), (name, x.numel(), bits, group, kw)


def check_unpack(mod: ModuleType, x: torch.Tensor, bits: int, group: int) -> None:
    """mod.unpack_dequantize of the reference's encoding decodes as the reference does."""
    qt = reference.quantize_pack(x.cpu(), bits, group)
    on = reference.Quantized(*(t.to(x.device) for t in qt))
    got = mod.unpack_dequantize(on, bits, group, x.numel())
    assert same(got, reference.unpack_dequantize(qt, bits, group, x.numel())), (bits, group)


@functools.lru_cache(maxsize=16)
def _sensitive_rows(bits: int, group: int, rows: int) -> torch.Tensor:
    levels = float(2**bits - 1)
    r = torch.rand(20_000, generator=torch.Generator().manual_seed(bits)) * 10 + 0.01
    r = r[(levels / r) != (torch.full_like(r, levels) / r)][:256, None]
    mid = (torch.arange(levels) + 0.5) * r / levels  # code boundaries, then +-2 ulp
    cand = torch.cat([mid, *(torch.nextafter(mid, mid + s) for s in (1, -1))], 1)
    cand = torch.cat([cand, *(torch.nextafter(cand, cand + s) for s in (1, -1))], 1)
    ieee = torch.full_like(r, levels) / r
    hit = (torch.round(cand * (levels / r)) != torch.round(cand * ieee)) & (cand > 0) & (
        cand < r)
    out = []
    for i in hit.any(1).nonzero().view(-1)[:rows].tolist():
        vals = cand[i][hit[i]][: group - 2]
        out.append(torch.cat([torch.zeros(1), r[i], vals, vals.new_zeros(group - 2 - len(vals))]))
    assert len(out) == rows, "no reciprocal-sensitive group found"
    return torch.cat(out)


def reciprocal_sensitive(bits: int, group: int, rows: int = 2) -> torch.Tensor:
    """Groups (min 0, max r) holding values whose code differs between inv = L / r as one
    IEEE division and PyTorch's L / r, which is (1 / r) * L: only a kernel computing the
    reciprocal as the reference does gets them right."""
    return _sensitive_rows(bits, group, rows).clone()


def inputs(n: int, seed: int) -> list[torch.Tensor]:
    """Gaussian, post-ReLU x 1e3, constant, and Gaussian with NaNs (x86's and a GPU's
    canonical bits) and an inf (n values each)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    nan = x.clone()
    nan[2 * n // 3] = float("inf")
    nan[n // 3] = float("nan")
    gpu_nan = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)
    nan[min(n // 3 + 1, n - 1)] = gpu_nan  # a GPU's canonical NaN
    return [x, torch.relu(x) * 1e3, torch.full((n,), 2.0), nan]


def fused(mod: ModuleType, bits: int, device: str = "cpu") -> None:
    """The fused kernel: tails, constant groups, a NaN group, large values, groups only
    right with the reference's reciprocal."""
    for x in inputs(300, bits):
        check_quantize(mod, x.to(device), bits, 128)
    check_quantize(mod, torch.randn(5, device=device), bits, 8)
    check_quantize(mod, reciprocal_sensitive(bits, 8).to(device), bits, 8)


def hybrid_minmax(mod: ModuleType, device: str = "cpu") -> None:
    """Groups of 4 programs (block < group): each program's tree min/max folded into the
    group's slot by Algorithm 1 equals amin / amax, NaN and the padded tail included."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5)) * 4
    x[900] = float("nan")
    mn, mx = mod.group_minmax(x.to(device), 256, block=64)
    rmn, rmx = reference.group_minmax(x, 256)
    assert same(mn, rmn) and same(mx, rmx), (mn, rmn, mx, rmx)
    assert mn.isnan().tolist() == [False, False, False, True]
    try:
        mod.group_minmax(x.to(device), 256, block=48)
    except ValueError as exc:
        assert "block must be a power of two" in str(exc)
    else:
        raise AssertionError("block=48 was accepted")


def hybrid_quantize(mod: ModuleType, bits: int, device: str = "cpu") -> None:
    """Groups not a power of two (24), or spanning several programs (256 at block 128):
    hybrid min/max, then the quantize pass, give the reference's bytes."""
    g = torch.Generator().manual_seed(bits)
    check_quantize(mod, (torch.randn(50, generator=g) * 3).to(device), bits, 24)
    check_quantize(mod, torch.randn(520, generator=g).to(device), bits, 256, hybrid=True,
                   block=128)
    check_quantize(mod, reciprocal_sensitive(bits, 64).to(device), bits, 64, hybrid=True,
                   block=32)


def unpack(mod: ModuleType, bits: int, device: str = "cpu") -> None:
    """The flat unpack kernel for a power-of-two and an odd group size."""
    for n, group in ((1000, 128), (100, 24)):
        check_unpack(mod, torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device),
                     bits, group)


def sweep(mod: ModuleType, device: str = "cpu") -> None:
    """The fused kernel over more sizes and seeds, the hybrid path over a tail group."""
    for seed in range(2):
        for n in (1, 129, 1000):
            for x in inputs(n, seed):
                for bits in (2, 4, 8):
                    check_quantize(mod, x.to(device), bits, 128)
                    if n == 129 and seed == 0:
                        check_quantize(mod, x.to(device), bits, 128, hybrid=True, block=64)


CHECKS: dict[str, Callable[[ModuleType], None]] = {
    **{f"fused_{b}": (lambda m, b=b: fused(m, b)) for b in (2, 4, 8)},
    "hybrid_minmax": hybrid_minmax,
    **{f"hybrid_quantize_{b}": (lambda m, b=b: hybrid_quantize(m, b)) for b in (2, 4, 8)},
    **{f"unpack_{b}": (lambda m, b=b: unpack(m, b)) for b in (2, 4, 8)},
    "sweep": sweep,
}


def main(names: list[str]) -> int:
    """Run the named checks on triton_kernels (as imported here); print one JSON line of
    results (stdout) and one of seconds per check (stderr)."""
    torch.set_num_threads(1)
    from tta_kernels import triton_kernels

    out, seconds = {}, {}
    for name in names:
        start = time.perf_counter()
        try:
            CHECKS[name](triton_kernels)
            out[name] = "ok"
        except Exception:  # reported per check to the calling test
            out[name] = traceback.format_exc(limit=4)[-3000:]
        seconds[name] = round(time.perf_counter() - start, 2)
    print(json.dumps(seconds), file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
