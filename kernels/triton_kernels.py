"""Triton (CUDA) kernels of the DAF format (tta_kernels.reference), one program per ROWS
groups: load the groups once, min/max reduce in registers, quantize, pack, store; and the
inverse. Imported only through tta_kernels.dispatch, which guards the import.

Bit-exact with the reference by construction: the reciprocal L / (max - min) is an IEEE
division (fdiv with ieee_rounding: Triton's '/' may lower to an approximate division);
rounding half to even (as torch.round) is DAF's 2**23 trick (§3.3.1): for 0 <= v < 2**23,
v + 2**23 is rounded by the float add to the nearest even integer, whose float32 bits are
0x4B000000 + that integer; the kernels run with enable_fp_fusion=False, so the decode's
product and sum are two roundings (no FMA contraction), as in the reference. Packing sums
the shifted codes of a byte, which equals their OR since the lanes never overlap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import Quantized, check_args, n_groups

ROWS = 16  # groups per program


@triton.jit
def _quantize_pack_kernel(x_ptr, codes_ptr, mn_ptr, scale_ptr, n, groups,
                          BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PER
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    bcol = tl.arange(0, NB)
    lane = tl.arange(0, PER)
    offs = rows[:, None, None] * GROUP + bcol[None, :, None] * PER + lane[None, None, :]
    offs = tl.minimum(offs, n - 1)  # the tail repeats x[n - 1], as the reference pads
    ok = rows < groups
    x = tl.load(x_ptr + offs, mask=ok[:, None, None], other=0.0).to(tl.float32)
    mn = tl.min(tl.min(x, axis=2), axis=1)
    mx = tl.max(tl.max(x, axis=2), axis=1)
    rng = mx - mn
    levels = (1 << BITS) - 1.0
    safe = tl.where(rng > 0, rng, 1.0)
    inv = tl.where(rng > 0, tl.fdiv(levels + tl.zeros_like(rng), safe, ieee_rounding=True), 0.0)
    scale = tl.fdiv(rng, levels + tl.zeros_like(rng), ieee_rounding=True)
    v = (x - mn[:, None, None]) * inv[:, None, None] + 8388608.0
    q = v.to(tl.int32, bitcast=True) - 0x4B000000
    byte = tl.sum(q << (lane[None, None, :] * BITS), axis=2)
    tl.store(codes_ptr + rows[:, None] * NB + bcol[None, :], byte.to(tl.uint8),
             mask=ok[:, None])
    tl.store(mn_ptr + rows, mn, mask=ok)
    tl.store(scale_ptr + rows, scale, mask=ok)


@triton.jit
def _unpack_dequantize_kernel(codes_ptr, mn_ptr, scale_ptr, out_ptr, n, groups,
                              BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PER
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    bcol = tl.arange(0, NB)
    lane = tl.arange(0, PER)
    ok = rows < groups
    byte = tl.load(codes_ptr + rows[:, None] * NB + bcol[None, :], mask=ok[:, None], other=0)
    q = (byte.to(tl.int32)[:, :, None] >> (lane[None, None, :] * BITS)) & ((1 << BITS) - 1)
    mn = tl.load(mn_ptr + rows, mask=ok, other=0.0)
    scale = tl.load(scale_ptr + rows, mask=ok, other=0.0)
    val = q.to(tl.float32) * scale[:, None, None] + mn[:, None, None]
    offs = rows[:, None, None] * GROUP + bcol[None, :, None] * PER + lane[None, None, :]
    tl.store(out_ptr + offs, val.to(out_ptr.dtype.element_ty), mask=offs < n)


def quantize_pack(x: Tensor, bits: int, group: int) -> Quantized:
    """Triton quantize + pack of a flat tensor (reference format)."""
    check_args(bits, group)
    x = x.contiguous()
    n = x.numel()
    groups = n_groups(n, group)
    codes = torch.empty(groups * group * bits // 8, dtype=torch.uint8, device=x.device)
    mn = torch.empty(groups, dtype=torch.float32, device=x.device)
    scale = torch.empty_like(mn)
    _quantize_pack_kernel[(triton.cdiv(groups, ROWS),)](
        x, codes, mn, scale, n, groups, BITS=bits, GROUP=group, ROWS=ROWS,
        enable_fp_fusion=False)
    return Quantized(codes, mn, scale)


def unpack_dequantize(qt: Quantized, bits: int, group: int, n: int,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """Triton unpack + dequantize: the first n values (flat)."""
    check_args(bits, group)
    groups = qt.mn.numel()
    out = torch.empty(n, dtype=dtype, device=qt.codes.device)
    _unpack_dequantize_kernel[(triton.cdiv(groups, ROWS),)](
        qt.codes, qt.mn, qt.scale, out, n, groups, BITS=bits, GROUP=group, ROWS=ROWS,
        enable_fp_fusion=False)
    return out
