"""DAF storage for the activation codec: per-group min-max quantization (DAF Eq. 1) at
8/4/2 bits, bit-packed by tta_kernels; 0 bits = not stored.

A unit's bit width is decided before its forward (CodecPlan.bits): autograd has already
taken a reference to every saved tensor when the pack hook returns, so a save cannot be
dropped or shrunk later in the forward; 0 bits therefore means the unit's weight is frozen
for the batch (nothing reads its input in backward: ∂x needs only the weight), and the codec
refuses a 0-bit unit whose parameters require grad. Groups are consecutive entries in the
tensor's memory order (channels-last tensors are not copied); min and scale are float32 per
group (8 bytes per `group` entries: 1.6 % of a float32 tensor at group 128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from tta_kernels import Quantized, n_groups, packed_nbytes, quantize_pack, unpack_dequantize

from tta_core.memory.packed import memory_order, restore_layout

BIT_WIDTHS = (0, 2, 4, 8)
STORED_BITS = (2, 4, 8)
# "other" saves (BN inputs, pooling inputs) are quantized only from this size up: BN's saved
# mean / invstd (one value per channel) stay exact and so does anything small
MIN_QUANT_NUMEL = 4096
NORM_KINDS = ("bn", "ln", "gn")  # units.NORM_UNIT_KINDS
NARROW = "narrow"  # codec encoding: an integer save in the narrowest integer dtype that fits
_NARROW_DTYPES = (torch.int8, torch.int16, torch.int32)


@dataclass(frozen=True)
class Quant:
    """A codec encoding: `bits` per entry (0 = not stored) in groups of `group` entries."""

    bits: int
    group: int


def check_bits(unit: str, bits: object, allowed: tuple[int, ...] = BIT_WIDTHS) -> None:
    """Raise a one-line ValueError unless bits is one of `allowed`."""
    if isinstance(bits, bool) or bits not in allowed:
        raise ValueError(f"bit width for unit {unit!r} must be one of {allowed}, got {bits!r}")


@dataclass(eq=False)
class PackedQuant:
    """A tensor stored as bit-packed per-group min-max codes."""

    qt: Quantized
    shape: torch.Size
    perm: tuple[int, ...]
    dtype: torch.dtype
    bits: int
    group: int

    @classmethod
    def encode(cls, t: Tensor, bits: int, group: int) -> PackedQuant:
        """Quantize t (flattened in memory order) at `bits`."""
        flat, perm = memory_order(t.detach())
        return cls(quantize_pack(flat, bits, group), t.shape, perm, t.dtype, bits, group)

    def decode(self) -> Tensor:
        """The dequantized tensor (original shape, strides and dtype)."""
        flat = unpack_dequantize(self.qt, self.bits, self.group, self.shape.numel(),
                                 self.dtype)
        return restore_layout(flat, self.shape, self.perm)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, mins and scales."""
        return sum(t.untyped_storage().nbytes() for t in self.qt)


@dataclass(eq=False)
class Dropped:
    """A 0-bit save: nothing is held; decodes to zeros, which no gradient reads (the unit
    is frozen: the codec checks it before the forward)."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int = 0

    @classmethod
    def encode(cls, t: Tensor) -> Dropped:
        """Remember only t's layout."""
        return cls(t.shape, t.stride(), t.dtype, t.device)

    def decode(self) -> Tensor:
        """Zeros of the saved tensor's shape, as one zero broadcast (stride 0): nothing is
        allocated or written, and the frozen unit's backward reads only the shape (its ∂x
        needs the weight; the tests compare the gradients with materialized zeros')."""
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(self.shape)


def narrow_dtype(t: Tensor) -> torch.dtype | None:
    """The smallest signed integer dtype holding every value of integer tensor t, if it is
    narrower than t's own (max-pool indices < H*W fit int16: 4x smaller than int64)."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or not t.numel():
        return None
    lo, hi = (int(v) for v in torch.aminmax(t.detach()))
    for dtype in _NARROW_DTYPES:
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return dtype if info.bits < 8 * t.element_size() else None
    return None


@dataclass(eq=False)
class PackedInt:
    """An integer save (max-pool indices) held losslessly in a narrower integer dtype."""

    values: Tensor
    dtype: torch.dtype

    def decode(self) -> Tensor:
        """The original values in the original dtype and strides."""
        return self.values.to(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.values.untyped_storage().nbytes()


def encode_quant(t: Tensor, enc: Quant) -> PackedQuant | Dropped:
    """The stored form of t under a Quant encoding."""
    if enc.bits == 0:
        return Dropped.encode(t)
    return PackedQuant.encode(t, enc.bits, enc.group)


def quant_nbytes(numel: int, bits: int, group: int) -> int:
    """Bytes of an encoding of numel entries at `bits` (0 for a dropped save)."""
    if bits == 0:
        return 0
    return packed_nbytes(numel, bits, group) + 8 * n_groups(numel, group)
