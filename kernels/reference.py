"""Pure-PyTorch reference of the DAF kernels: the oracle every fast path must equal bit for bit.

The format (shared by every backend):

- ``x`` is a flat float tensor of ``n`` elements, cut into groups of ``group`` consecutive
  elements (group a multiple of 8); the last group is padded with copies of ``x[n - 1]`` (so
  padding never changes a group's min or max).
- per group, in float32: ``rng = max - min``; ``scale = rng / L`` and ``inv = L / rng``
  (``inv = 0`` where ``rng == 0``), ``L = 2**bits - 1`` (DAF Eq. 1);
  ``q = clamp(round_half_even((x - min) * inv), 0, L)`` (a multiply by the stored reciprocal,
  not a division: every backend then rounds the same two float32 operations).
- codes are bit-packed little-endian within a byte: code ``k`` sits in byte ``k // (8 / bits)``
  at bit ``bits * (k % (8 / bits))`` (as ``numpy.packbits(bitorder="little")`` for 1 bit).
- decoding: ``x_hat = q * scale + min``: two float32 roundings (product, then sum; no FMA).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

BITS = (2, 4, 8)


class Quantized(NamedTuple):
    """Packed codes (uint8), per-group min and scale (float32)."""

    codes: Tensor
    mn: Tensor
    scale: Tensor


def check_args(bits: int, group: int) -> None:
    """Raise a one-line ValueError for an unsupported width or group size."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if group < 8 or group % 8:
        raise ValueError(f"group must be a positive multiple of 8, got {group!r}")


def n_groups(n: int, group: int) -> int:
    """Groups of `group` elements covering n elements (the last one padded)."""
    return (n + group - 1) // group


def packed_nbytes(n: int, bits: int, group: int) -> int:
    """Bytes of the packed codes for n elements (whole groups)."""
    return n_groups(n, group) * group * bits // 8


def padded_groups(x: Tensor, group: int) -> Tensor:
    """x (flat) as float32 rows of `group`, the tail padded with its last element."""
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"expected a non-empty 1-D tensor, got shape {tuple(x.shape)}")
    x = x.float()
    pad = (-x.numel()) % group
    if pad:
        x = torch.cat((x, x[-1:].expand(pad)))
    return x.view(-1, group)


def group_minmax(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Per-group (min, max) in float32."""
    g = padded_groups(x, group)
    return g.min(1).values, g.max(1).values


def scales(mn: Tensor, mx: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """(scale, inv) per group: rng / L and L / rng (0 where the group is constant)."""
    levels = float(2**bits - 1)
    rng = mx - mn
    inv = torch.where(rng > 0, levels / rng, torch.zeros_like(rng))
    return rng / levels, inv


def pack_codes(q: Tensor, bits: int) -> Tensor:
    """Pack uint8 codes (< 2**bits, count a multiple of 8 / bits) little-endian per byte."""
    per = 8 // bits
    lanes = q.reshape(-1, per).to(torch.int32)
    out = torch.zeros(lanes.shape[0], dtype=torch.int32, device=q.device)
    for j in range(per):
        out |= lanes[:, j] << (bits * j)
    return out.to(torch.uint8)


def unpack_codes(codes: Tensor, bits: int) -> Tensor:
    """Inverse of pack_codes: one uint8 code per element."""
    per = 8 // bits
    mask = 2**bits - 1
    wide = codes.to(torch.int32)
    lanes = [(wide >> (bits * j)) & mask for j in range(per)]
    return torch.stack(lanes, 1).reshape(-1).to(torch.uint8)


def quantize_pack(x: Tensor, bits: int, group: int) -> Quantized:
    """Quantize flat x per group at `bits` (DAF Eq. 1) and bit-pack the codes."""
    check_args(bits, group)
    g = padded_groups(x, group)
    mn, mx = g.min(1).values, g.max(1).values
    scale, inv = scales(mn, mx, bits)
    q = torch.round((g - mn[:, None]) * inv[:, None]).clamp(0, 2**bits - 1)
    return Quantized(pack_codes(q.to(torch.uint8), bits), mn, scale)


def mask_bits(x: Tensor, band: tuple[float, float]) -> Tensor:
    """Packed bits of band[0] < x < band[1] for flat x (NaN: 0): value 8k + j at bit j of
    byte k, the last byte zero-padded (tta_core.memory.bits' layout)."""
    lo, hi = band
    inside = ((x > lo) & (x < hi)).to(torch.uint8)
    pad = (-inside.numel()) % 8
    if pad:
        inside = torch.cat((inside, inside.new_zeros(pad)))
    lanes = inside.view(-1, 8).to(torch.int32)
    out = torch.zeros(lanes.shape[0], dtype=torch.int32, device=x.device)
    for j in range(8):
        out |= lanes[:, j] << j
    return out.to(torch.uint8)


def quantize_pack_mask(x: Tensor, bits: int, group: int, band: tuple[float, float]
                       ) -> tuple[Quantized, Tensor]:
    """quantize_pack(x) and mask_bits(x, band): a ReLU output's two encodings."""
    return quantize_pack(x, bits, group), mask_bits(x, band)


def unpack_dequantize(qt: Quantized, bits: int, group: int, n: int,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """The first n decoded values (flat, `dtype`)."""
    check_args(bits, group)
    q = unpack_codes(qt.codes, bits).view(-1, group).float()
    prod = q * qt.scale[:, None]
    return (prod + qt.mn[:, None]).reshape(-1)[:n].to(dtype)


RELU_TINY = 2.0**-64  # positive, and its products with gradients are not denormals


def relu_agree(values: Tensor, mask: Tensor) -> Tensor:
    """Decoded values of a ReLU output (flat float32) made to agree with its exact mask
    (mask_bits(x, (0, inf))): where the bit is set a value <= 0 (a positive x whose code
    rounded to the group's min 0) becomes RELU_TINY, where it is clear a value > 0 becomes 0;
    so value > 0 exactly where x > 0 (what the ReLU's backward reads) and every value stays
    within half a step of x."""
    n = values.numel()
    shifts = torch.arange(8, dtype=torch.int32, device=mask.device)
    bit = ((mask.to(torch.int32)[:, None] >> shifts) & 1).reshape(-1)[:n].bool()
    pos = values > 0
    tiny = torch.full_like(values, RELU_TINY)
    return torch.where(bit, torch.where(pos, values, tiny),
                       torch.where(pos, torch.zeros_like(values), values))
