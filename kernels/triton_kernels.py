"""Triton (CUDA) kernels of the DAF format (tta_kernels.reference). Imported only through
tta_kernels.dispatch, which guards the import; tests also run them in Triton's interpreter.

- `quantize_pack`, power-of-two groups up to FUSED_MAX_GROUP: one fused program per ROWS
  groups (load once, min/max reduced in registers, quantize, pack, store; DAF §3.2.3).
- `quantize_pack` otherwise (large or odd groups), and `group_minmax`: DAF's hybrid
  reduction (§3.2.1-3.2.2): a (group, block) grid; each program reduces its BLOCK values by
  Triton's tree reduction (tl.min / tl.max: registers, then shared memory), then merges its
  result into the group's slot in DRAM by Algorithm 1, a compare-and-swap loop on the
  float's int32 bits (`_atomic_min_max`); a second kernel quantizes and packs from the
  reduced min/max.
- `unpack_dequantize`: one flat program per BLOCK packed bytes (any group size).

Bit-exact with the reference by construction: the reciprocal is computed as PyTorch's
``L / rng`` is, ``(1 / rng) * L`` (reciprocal, then multiply), and ``scale = rng / L``, both
IEEE divisions (div_rn: Triton's '/' and fdiv may lower to an approximate one);
rounding half to even (as torch.round) is DAF's 2**23 trick (§3.3.1): for 0 <= v < 2**23,
v + 2**23 is rounded by the float add to the nearest even integer, whose float32 bits are
0x4B000000 + that integer; kernels run with enable_fp_fusion=False, so the decode's product
and sum are two roundings (no FMA contraction), as in the reference. Packing sums the
shifted codes of a byte, which equals their OR since the lanes never overlap. A group
holding a NaN gets NaN min and scale (as amin / amax), the NaN's bits not preserved, and
code 0 for a NaN value (the reference's on x86; a GPU's canonical NaN has other bits); a
zero min or max present with both signs may carry either sign (as in tta_kernels.native).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import Quantized, check_args, n_groups

ROWS = 16  # groups per program of the fused kernel (fewer for groups above 128)
FUSED_MAX_GROUP = 1024  # larger groups, or groups not a power of two: the hybrid path
BLOCK = 1024  # values per program of the hybrid reduction and its quantize pass
UNPACK_BLOCK = 512  # packed bytes per program of the unpack kernel


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
    bad = tl.max(tl.max((x != x).to(tl.int32), axis=2), axis=1)
    mn = tl.where(bad > 0, float("nan"), mn)
    mx = tl.where(bad > 0, float("nan"), mx)
    rng = mx - mn  # scales as reference.scales: rng / L, (1 / rng) * L or 0
    levels = (1 << BITS) - 1.0
    recip = tl.div_rn(1.0 + tl.zeros_like(rng), tl.where(rng > 0, rng, 1.0))
    inv = tl.where(rng > 0, recip * levels, 0.0)
    scale = tl.div_rn(rng, levels + tl.zeros_like(rng))
    v = (x - mn[:, None, None]) * inv[:, None, None] + 8388608.0  # the 2**23 trick
    q = tl.where(v == v, v.to(tl.int32, bitcast=True) - 0x4B000000, 0)  # NaN: code 0
    byte = tl.sum(q << (lane[None, None, :] * BITS), axis=2)
    tl.store(codes_ptr + rows[:, None] * NB + bcol[None, :], byte.to(tl.uint8),
             mask=ok[:, None])
    tl.store(mn_ptr + rows, mn, mask=ok)
    tl.store(scale_ptr + rows, scale, mask=ok)


@triton.jit
def _atomic_min_max(bits_ptr, val, IS_MIN: tl.constexpr):
    """DAF Algorithm 1: fold float `val` into the float whose int32 bits are at bits_ptr
    (min or max; NaN wins, as in amin / amax) by compare-and-swap on the bits, retried
    until no other program changed the slot in between. Returns the slot's final float."""
    old = tl.load(bits_ptr, volatile=True)
    assumed = old ^ 1  # differs from old: enter the loop
    while assumed != old:
        assumed = old
        cur = assumed.to(tl.float32, bitcast=True)
        if IS_MIN:
            better = val < cur
        else:
            better = val > cur
        pick = tl.where((better | (val != val)) & (cur == cur), val, cur)
        old = tl.atomic_cas(bits_ptr, assumed, pick.to(tl.int32, bitcast=True))
    return old.to(tl.float32, bitcast=True)


@triton.jit
def _hybrid_minmax_kernel(x_ptr, mn_bits_ptr, mx_bits_ptr, n, GROUP: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Program (g, b): values [b BLOCK, (b + 1) BLOCK) of group g (tail padded with
    x[n - 1]); tree-reduced in the program, then merged by Algorithm 1."""
    g = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = e < GROUP
    offs = tl.minimum(g * GROUP + e, n - 1)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    lo = tl.min(tl.where(inside, x, float("inf")), axis=0)
    hi = tl.max(tl.where(inside, x, float("-inf")), axis=0)
    bad = tl.max(((x != x) & inside).to(tl.int32), axis=0) > 0
    lo = tl.where(bad, float("nan"), lo)
    hi = tl.where(bad, float("nan"), hi)
    _atomic_min_max(mn_bits_ptr + g, lo, True)
    _atomic_min_max(mx_bits_ptr + g, hi, False)


@triton.jit
def _quantize_given_kernel(x_ptr, mn_ptr, mx_ptr, codes_ptr, scale_ptr, n,
                           BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Program (g, b): codes of values [b BLOCK, (b + 1) BLOCK) of group g from the group's
    reduced min/max; program (g, 0) also stores the group's scale."""
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = BLOCK // PER
    g = tl.program_id(0)
    blk = tl.program_id(1)
    bcol = tl.arange(0, NB)
    lane = tl.arange(0, PER)
    e = blk * BLOCK + bcol[:, None] * PER + lane[None, :]
    inside = e < GROUP
    x = tl.load(x_ptr + tl.minimum(g * GROUP + e, n - 1), mask=inside, other=0.0)
    mn = tl.load(mn_ptr + g)
    rng = tl.load(mx_ptr + g) - mn
    levels = (1 << BITS) - 1.0
    recip = tl.div_rn(1.0 + tl.zeros_like(rng), tl.where(rng > 0, rng, 1.0))
    inv = tl.where(rng > 0, recip * levels, 0.0)
    scale = tl.div_rn(rng, levels + tl.zeros_like(rng))
    v = (x.to(tl.float32) - mn) * inv + 8388608.0
    q = tl.where(v == v, v.to(tl.int32, bitcast=True) - 0x4B000000, 0)  # NaN: code 0
    byte = tl.sum(q << (lane[None, :] * BITS), axis=1)
    first = blk * BLOCK + bcol * PER
    tl.store(codes_ptr + (g * GROUP + first) // PER, byte.to(tl.uint8), mask=first < GROUP)
    if blk == 0:
        tl.store(scale_ptr + g, scale)


@triton.jit
def _unpack_dequantize_kernel(codes_ptr, mn_ptr, scale_ptr, out_ptr, n, nbytes,
                              BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, PER)
    byte = tl.load(codes_ptr + k, mask=k < nbytes, other=0)
    q = (byte.to(tl.int32)[:, None] >> (lane[None, :] * BITS)) & ((1 << BITS) - 1)
    e = k[:, None] * PER + lane[None, :]
    ok = e < n
    mn = tl.load(mn_ptr + e // GROUP, mask=ok, other=0.0)
    scale = tl.load(scale_ptr + e // GROUP, mask=ok, other=0.0)
    val = q.to(tl.float32) * scale + mn
    tl.store(out_ptr + e, val.to(out_ptr.dtype.element_ty), mask=ok)


def _flat(x: Tensor) -> Tensor:
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"expected a non-empty 1-D tensor, got shape {tuple(x.shape)}")
    return x.contiguous()


def group_minmax(x: Tensor, group: int, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Per-group (min, max) of flat x in float32 by the hybrid reduction (tree within a
    program of `block` values, Algorithm 1's CAS across the programs of a group)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    if block < 2 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 2, got {block!r}")
    x = _flat(x)
    block = min(block, triton.next_power_of_2(group))
    groups = n_groups(x.numel(), group)
    mn = torch.full((groups,), float("inf"), device=x.device)
    mx = torch.full((groups,), float("-inf"), device=x.device)
    _hybrid_minmax_kernel[(groups, triton.cdiv(group, block))](
        x, mn.view(torch.int32), mx.view(torch.int32), x.numel(), GROUP=group, BLOCK=block)
    return mn, mx


def fused_applies(group: int) -> bool:
    """Whether quantize_pack runs the one-program-per-groups fused kernel for `group`."""
    return group <= FUSED_MAX_GROUP and group & (group - 1) == 0


def quantize_pack(x: Tensor, bits: int, group: int, hybrid: bool | None = None,
                  block: int = BLOCK) -> Quantized:
    """Triton quantize + pack of a flat tensor (reference format): the fused kernel, or
    the hybrid reduction + a quantize pass (hybrid=None: by fused_applies)."""
    check_args(bits, group)
    x = _flat(x)
    n = x.numel()
    groups = n_groups(n, group)
    codes = torch.empty(groups * group * bits // 8, dtype=torch.uint8, device=x.device)
    scale = torch.empty(groups, dtype=torch.float32, device=x.device)
    if not (fused_applies(group) if hybrid is None else hybrid is False):
        mn, mx = group_minmax(x, group, block)
        block = min(block, triton.next_power_of_2(group))
        _quantize_given_kernel[(groups, triton.cdiv(group, block))](
            x, mn, mx, codes, scale, n, BITS=bits, GROUP=group, BLOCK=block,
            enable_fp_fusion=False)
        return Quantized(codes, mn, scale)
    mn = torch.empty(groups, dtype=torch.float32, device=x.device)
    rows = max(1, min(ROWS, 2048 // group))
    _quantize_pack_kernel[(triton.cdiv(groups, rows),)](
        x, codes, mn, scale, n, groups, BITS=bits, GROUP=group, ROWS=rows,
        enable_fp_fusion=False)
    return Quantized(codes, mn, scale)


def unpack_dequantize(qt: Quantized, bits: int, group: int, n: int,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """Triton unpack + dequantize: the first n values (flat)."""
    check_args(bits, group)
    nbytes = qt.codes.numel()
    out = torch.empty(n, dtype=dtype, device=qt.codes.device)
    _unpack_dequantize_kernel[(triton.cdiv(nbytes, UNPACK_BLOCK),)](
        qt.codes, qt.mn, qt.scale, out, n, nbytes, BITS=bits, GROUP=group,
        BLOCK=UNPACK_BLOCK, enable_fp_fusion=False)
    return out
