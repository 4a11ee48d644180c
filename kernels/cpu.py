"""Fast CPU paths of the DAF kernels: vectorised eager PyTorch and a torch.compile variant.

Both produce exactly the reference's bytes (tta_kernels.reference documents the format):

- ``vectorised``: amin and amax passes, in-place arithmetic, rounding by DAF's 2**23 trick
  (§3.3.1: for 0 <= v < 2**22, the float add v + 2**23 rounds v half to even, as
  torch.round, and the sum's int32 bits are 0x4B000000 + the integer, so an integer cast
  to uint8 keeps just the code: no round pass, no float-to-int conversion); one-byte codes
  packed by reading 2 (4) of them as one int16 (int32) word and OR-ing shifted copies (the
  codes never overlap); unpacked by widening each byte to an int16 (int32) word and
  shifting its codes apart. The clamp of the reference is left out: x - min >= 0 exactly
  and (max - min) * (L / (max - min)) <= L * (1 + 2**-22) < L + 0.5, so the rounded value
  is already inside [0, L].
- ``compiled``: the same arithmetic under torch.compile (inductor C++/OpenMP), fused into
  a reduction and one pass; rows of one group, the group count marked dynamic and the group
  size static (one compile serves every tensor size). Needs a C++ compiler at run time:
  when compiling fails the caller falls back to ``vectorised`` (tta_kernels.dispatch).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .reference import Quantized, check_args, padded_groups, scales

# packing: the 8/bits one-byte codes of one output byte, read as one word
_PACK_WORD = {2: torch.int32, 4: torch.int16}
MAGIC = 8388608.0  # 2**23
# unpacking: one packed byte widened to a word that holds its 8/bits codes, one per byte
_UNPACK_WORD = {2: torch.int32, 4: torch.int16}


def _pack(q: Tensor, bits: int) -> Tensor:
    """uint8 codes (one per byte) -> packed bytes: word w holds code j at bit 8 j; OR-ing
    w >> (8 - bits) j moves code j to bit bits * j of the low byte, and codes never overlap
    there (each is < 2**bits); the cast to uint8 keeps the low byte."""
    if bits == 8:
        return q
    w = q.view(_PACK_WORD[bits])
    out = w >> (8 - bits)
    out |= w
    for j in range(2, 8 // bits):
        out |= w >> (j * (8 - bits))
    return out.to(torch.uint8)


def unpack_codes(codes: Tensor, bits: int) -> Tensor:
    """Packed bytes -> one uint8 code per element: widen each byte to a word and move
    code j from bit bits * j to bit 8 j (its own byte, little-endian)."""
    if bits == 8:
        return codes
    w = codes.to(_UNPACK_WORD[bits])
    mask = 2**bits - 1
    out = w & mask
    for j in range(1, 8 // bits):
        lane = w & (mask << (bits * j))
        lane <<= j * (8 - bits)
        out |= lane
    return out.view(torch.uint8)


def quantize_pack(x: Tensor, bits: int, group: int) -> Quantized:
    """Vectorised quantize + pack (reference format)."""
    check_args(bits, group)
    g = padded_groups(x, group)
    mn, mx = g.amin(1), g.amax(1)  # two passes: 20x faster than aminmax(dim=1) on CPU
    scale, inv = scales(mn, mx, bits)
    t = g - mn[:, None]
    t.mul_(inv[:, None]).add_(MAGIC)  # rounds half to even into the low mantissa bits
    w = t.view(-1).view(torch.int32)  # 0x4B000000 + code: the low byte is the code
    return Quantized(_pack(w.to(torch.uint8), bits), mn, scale)


def unpack_dequantize(qt: Quantized, bits: int, group: int, n: int,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """Vectorised unpack + dequantize: the first n values (flat)."""
    check_args(bits, group)
    t = unpack_codes(qt.codes, bits).view(-1, group).float()
    t.mul_(qt.scale[:, None]).add_(qt.mn[:, None])
    t = t.view(-1)[:n]
    return t if dtype == torch.float32 else t.to(dtype)


def _quantize_body(g: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Reference arithmetic on (groups, group) rows, rounding by the 2**23 trick, packing
    by shifted lanes: inductor fuses it into a reduction + one pass."""
    mn, mx = g.amin(1), g.amax(1)
    scale, inv = scales(mn, mx, bits)
    v = (g - mn[:, None]) * inv[:, None] + MAGIC
    lanes = (v.view(torch.int32) & 0xFF).view(-1, 8 // bits)
    out = lanes[:, 0]
    for j in range(1, 8 // bits):
        out = out | (lanes[:, j] << (bits * j))
    return out.to(torch.uint8), mn, scale


def _dequantize_body(codes: Tensor, scale: Tensor, mn: Tensor, bits: int) -> Tensor:
    """(groups, group * bits / 8) packed bytes -> (groups, group) values, q * scale + mn."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    q = (codes.to(torch.int32)[:, :, None] >> shifts) & (2**bits - 1)
    prod = q.reshape(codes.shape[0], -1).float() * scale[:, None]
    return prod + mn[:, None]


@functools.lru_cache(maxsize=1)
def compiled_bodies() -> tuple:
    """(quantize, dequantize) compiled once: the group count is dynamic (mark_dynamic),
    the group size static, so a new tensor size reuses the code and the reduction over a
    group is vectorised (fully dynamic shapes compiled 10-40x slower code)."""
    opts = {"dynamic": False, "fullgraph": True}
    return torch.compile(_quantize_body, **opts), torch.compile(_dequantize_body, **opts)


def quantize_pack_compiled(x: Tensor, bits: int, group: int) -> Quantized:
    """torch.compile'd quantize + pack (reference format)."""
    check_args(bits, group)
    g = padded_groups(x, group)
    torch._dynamo.mark_dynamic(g, 0)
    codes, mn, scale = compiled_bodies()[0](g, bits)
    return Quantized(codes, mn, scale)


def unpack_dequantize_compiled(qt: Quantized, bits: int, group: int, n: int,
                               dtype: torch.dtype = torch.float32) -> Tensor:
    """torch.compile'd unpack + dequantize: the first n values (flat)."""
    check_args(bits, group)
    codes = qt.codes.view(qt.mn.numel(), -1)
    torch._dynamo.mark_dynamic(codes, 0)
    torch._dynamo.mark_dynamic(qt.scale, 0)
    torch._dynamo.mark_dynamic(qt.mn, 0)
    t = compiled_bodies()[1](codes, qt.scale, qt.mn, bits).view(-1)[:n]
    return t if dtype == torch.float32 else t.to(dtype)
