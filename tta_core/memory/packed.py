"""Compressed forms of a saved activation: exact 1-bit masks and pruned values + bitmap.

Both are flattened in the tensor's *memory* order (so channels-last tensors are not
copied) and decoded to a tensor with the original shape, strides, dtype and device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from tta_kernels import native, native_masks

from tta_core.memory.bits import pack_bits, packed_size, unpack_bits


def memory_order(t: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """(flat view of t in memory order, permutation); copies only if t is not dense."""
    perm = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    p = t.permute(perm)
    if p.is_contiguous():
        return p.reshape(-1), perm
    return t.contiguous().reshape(-1), tuple(range(t.dim()))


def restore_layout(flat: Tensor, shape: torch.Size, perm: tuple[int, ...]) -> Tensor:
    """The tensor `memory_order` flattened, back in its shape and strides (a view of
    `flat`)."""
    pshape = [shape[d] for d in perm]
    inverse = sorted(range(len(perm)), key=lambda i: perm[i])
    return flat.view(pshape).permute(inverse)


@dataclass(eq=False)
class PackedMask:
    """An activation kept as 1 bit per entry: inside the band (lo, hi) or not.

    Decodes to ``inside`` (a value strictly inside the band) where the bit is set and to
    ``lo`` elsewhere: exactly what threshold/hardtanh backward need (they test lo < x < hi).
    """

    bits: Tensor
    shape: torch.Size
    perm: tuple[int, ...]
    dtype: torch.dtype
    lo: float
    inside: float

    @classmethod
    def encode(cls, t: Tensor, band: tuple[float, float]) -> PackedMask:
        """Encode t's band membership (1 bit per element)."""
        lo, hi = band
        flat, perm = memory_order(t)
        inside = lo + 1.0 if hi - lo > 2.0 else (lo + hi) / 2
        if native_masks(flat.dtype, flat.device):  # one C pass (tta_kernels.native)
            return cls(native.mask_pack(flat.contiguous(), lo, hi), t.shape, perm, t.dtype,
                       lo, inside)
        mask = flat > lo if hi == float("inf") else (flat > lo) & (flat < hi)
        return cls(pack_bits(mask), t.shape, perm, t.dtype, lo, inside)

    def decode(self) -> Tensor:
        """The stand-in tensor for the backward."""
        n = self.shape.numel()
        if native_masks(self.dtype, self.bits.device):
            return restore_layout(native.mask_unpack(self.bits, n, self.lo, self.inside),
                            self.shape, self.perm)
        vals = unpack_bits(self.bits, n).to(self.dtype)
        if (self.lo, self.inside) != (0.0, 1.0):
            vals = vals * (self.inside - self.lo) + self.lo
        return restore_layout(vals, self.shape, self.perm)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.bits.untyped_storage().nbytes()


def prune_mask(flat: Tensor, keep: float, sample: int) -> Tensor:
    """Bool mask of the ~keep fraction of largest |flat| entries (zeros never kept).

    The threshold is the kthvalue of |x| on a strided sample of at most `sample` entries
    (a global topk costs as much as a conv forward); entries strictly above it are kept, so
    a tensor with more zeros than 1 - keep keeps only its nonzeros.
    """
    n = flat.numel()
    step = max(1, n // sample)
    s = flat[::step].abs()
    k = min(s.numel(), round((1.0 - keep) * s.numel()))
    thr = s.kthvalue(k).values if k > 0 else s.new_zeros(())
    return flat.abs() > thr


@dataclass(eq=False)
class PackedPruned:
    """Magnitude-pruned values in memory order + their positions: a 1-bit bitmap, or int32
    indices when fewer than 1/32 of the entries are kept (then smaller than the bitmap)."""

    bits: Tensor  # the bitmap (uint8), or the kept entries' int32 indices
    values: Tensor
    shape: torch.Size
    perm: tuple[int, ...]

    @classmethod
    def encode(cls, t: Tensor, keep: float, sample: int) -> PackedPruned:
        """Keep the largest-|x| ~keep fraction of t."""
        flat, perm = memory_order(t)
        mask = prune_mask(flat, keep, sample)
        values = flat[mask]
        if values.numel() * 4 < packed_size(flat.numel()) and flat.numel() < 2**31:
            return cls(mask.nonzero().view(-1).to(torch.int32), values, t.shape, perm)
        return cls(pack_bits(mask), values, t.shape, perm)

    def decode(self) -> Tensor:
        """Dense tensor with zeros where entries were pruned."""
        n = self.shape.numel()
        if self.bits.dtype == torch.int32:
            flat = self.values.new_zeros(n).index_put_((self.bits.long(),), self.values)
        else:
            mask = unpack_bits(self.bits, n)
            flat = self.values.new_zeros(mask.shape).masked_scatter_(mask, self.values)
        return restore_layout(flat, self.shape, self.perm)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.bits.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()


@dataclass(eq=False)
class CentredPruned:
    """A norm layer's input: exact means over the normalised dims + the largest-|x − mean|
    ~keep fraction of the deviations (PackedPruned). A pruned entry decodes to its mean, so
    the layer's x̂ is 0 there (a pruned-to-zero x would give x̂ = −μ/σ instead)."""

    mean: Tensor
    deviations: PackedPruned

    @classmethod
    def encode(cls, t: Tensor, keep: float, dims: tuple[int, ...], sample: int
               ) -> CentredPruned:
        """Keep the means of t over `dims` and the largest ~keep fraction of deviations."""
        x = t.detach()
        mean = x.mean(dim=dims, keepdim=True)
        return cls(mean, PackedPruned.encode(x - mean, keep, sample))

    def decode(self) -> Tensor:
        """The means with the kept deviations added (original shape and strides)."""
        return self.deviations.decode().add_(self.mean)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.mean.untyped_storage().nbytes() + self.deviations.nbytes


def mask_nbytes(numel: int) -> int:
    """Bytes of a PackedMask of numel elements."""
    return packed_size(numel)


def pruned_nbytes(numel: int, kept: int, elem: int) -> int:
    """Bytes of a PackedPruned with `kept` of numel values of elem bytes each."""
    return min(packed_size(numel), 4 * kept) + kept * elem
