"""1-bit packing of boolean masks, 8 elements per byte.

torch has no packbits and torchao (which has sub-byte packing) is not installed here, so
this is the small vectorised version the codec needs. Layout: element ``8*i + j`` of the
flattened mask is bit ``j`` of byte ``i`` (``numpy.packbits(..., bitorder="little")``); the
last byte is zero-padded. On little-endian hosts eight bools are read as one int64 word and
gathered with one multiply (each byte is 0 or 1, so the partial products never carry);
elsewhere a shift-and-sum fallback gives the same bytes.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor

_GATHER = 0x0102040810204080  # byte j (value 0/1) of a word lands on bit 56 + j
_LITTLE = sys.byteorder == "little"


def packed_size(n: int) -> int:
    """Bytes that pack_bits uses for n elements (ceil(n / 8))."""
    if n < 0:
        raise ValueError(f"element count must be >= 0, got {n}")
    return (n + 7) // 8


def _bytes_of(mask: Tensor) -> Tensor:
    """The mask flattened, as uint8 0/1, zero-padded to a multiple of 8, offset 0."""
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_bits needs a bool tensor, got dtype {mask.dtype}")
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad or flat.storage_offset() % 8:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return flat.view(torch.uint8)


def pack_bits(mask: Tensor) -> Tensor:
    """Pack a bool tensor (flattened in row-major order) into packed_size(numel) uint8."""
    b = _bytes_of(mask)
    if not _LITTLE:
        return _pack_shift(b)
    words = b.view(torch.int64)
    return (((words * _GATHER) >> 56) & 0xFF).to(torch.uint8)


def _pack_shift(b: Tensor) -> Tensor:
    """Portable packing of 0/1 bytes (any byte order): bits OR-ed by a sum over 8 lanes."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return (b.view(-1, 8) << shifts).sum(1, dtype=torch.uint8)


@functools.lru_cache(maxsize=8)
def _spread_table(device: torch.device) -> Tensor:
    """256 int64 words: word v holds bit j of v in its byte j (little-endian hosts)."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return bits.to(torch.uint8).view(torch.int64).reshape(256).to(device)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of pack_bits: the first n elements as a flat bool tensor."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(f"unpack_bits needs a 1-D uint8 tensor, got {packed.dtype} "
                        f"with shape {tuple(packed.shape)}")
    if not 0 <= n <= 8 * packed.numel():
        raise ValueError(f"n={n} outside 0..{8 * packed.numel()} for {packed.numel()} bytes")
    if not _LITTLE:
        return _unpack_shift(packed)[:n]
    words = _spread_table(packed.device).index_select(0, packed.to(torch.int32))
    return words.view(torch.uint8).view(torch.bool)[:n]


def _unpack_shift(packed: Tensor) -> Tensor:
    """Portable unpacking (any byte order)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(torch.bool).reshape(-1)
