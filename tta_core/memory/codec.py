"""Saved-activation codec: per-unit magnitude pruning of ∂W inputs, exact activation masks.

    codec = ActivationCodec(staged, CodecPlan({"layer1.0.conv1": 0.3}, default=0.5))
    with codec:                       # one batch: the dedup cache lives for one forward
        loss = loss_fn(model(x))
    loss.backward()                   # decoding happens here; the context may be closed
    codec.result                      # SavedBytes actually held (measured)

What autograd saves, and what the codec does with it (sites: tta_core.memory.scope):

- an activation module's saved tensor (ReLU result, ReLU6/Hardtanh result or input): the
  backward only tests lo < x < hi, so it is stored as an exact 1-bit mask (``act_masks``);
- a conv/linear input (read only for ∂W; ∂x needs just the weight): magnitude-pruned to the
  unit's keep ratio, stored as a 1-bit position bitmap + the kept values in memory order;
- a BN/LN/GN unit's input, for units in ``norm_keep``: exact means over the normalised dims +
  the ~keep largest deviations from them (`CentredPruned`: a pruned entry has x̂ = 0); ∂γ
  and ∂x are then computed from it (approximate, as a pruned conv input's ∂W);
- a max-pool module's input with ``pool_inputs``: not stored (its backward reads the
  indices and the input's shape only): exact;
- everything else (other BN inputs, pooling indices, ...) is held by reference, as without
  the codec. Pruning the masks, or zeroing a BN input instead of centring it, ruins the
  gradients.

DAF (tta_core.memory.quant): with ``CodecPlan.bits`` / ``default_bits`` a conv/linear
unit's input is stored per-group min-max quantized at 8/4/2 bits and bit-packed instead of
pruned (0 bits: not stored, the unit must be frozen); ``norm_bits`` also quantizes the
float saves of BN/LN/GN units (their inputs, and a max-pool input they own) — 8 bits keeps
their gradients at cosine ~1 and is what gets below the dense-BN floor.

Dedup: one encoding per (data pointer, shape, stride, _version, encoding), reused only while
the source storage is alive (a weak reference to it): after a storage is freed, the
allocator may hand its address to a new tensor of the same shape within the same forward,
and a pointer-only key would then decode the wrong tensor. The cache is cleared at exit.
The same tensor saved under two encodings (a ReLU output: mask for the ReLU, pruned values
for the next conv) is stored once per encoding. A float32 CPU ReLU output's mask is packed
at the tensor's next save (`ReluMask`): when that save quantizes the same tensor, one fused
pass gives both (tta_kernels.quantize_pack_mask). A ReLU output stored both as the ReLU's
mask and quantized is decoded once for both (`_ReluDecode`): the dequantized values
made to agree with the exact mask (tta_kernels.unpack_dequantize_relu: a positive value
that rounded to the group's min 0 decodes to 2**-64), so the ReLU's gradient stays exact,
the conv's input stays within half a step, and backward writes one tensor instead of two.

torch.compile: refused (a clear RuntimeError while tracing; also at exit when tensors were
saved but no unit module's hook ran, as for a compiled module). Compiled graphs save their
own tensors, with no module to attribute them to, so per-unit policies need eager mode.

torch.utils.checkpoint: saved-tensor hooks nest and the innermost pair wins. Inside a
non-reentrant checkpoint region checkpoint's own hooks replace the codec's, so the region's
saves are neither seen nor encoded (they are recomputed in backward, which runs outside the
codec's context); reentrant checkpoint runs its forward under no_grad (nothing saved) and
recomputes in backward. Both compose region by region: the codec compresses what is saved
outside checkpointed regions. Put the codec around the forward only.
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from tta_kernels import Quantized, native_masks, quantize_pack_mask, unpack_dequantize_relu

from tta_core.memory.accounting import SavedTensorContext
from tta_core.memory.packed import (
    CentredPruned,
    PackedMask,
    PackedPruned,
    memory_order,
    restore_layout,
)
from tta_core.memory.quant import (
    MIN_QUANT_NUMEL,
    NARROW,
    NORM_KINDS,
    STORED_BITS,
    Dropped,
    PackedInt,
    PackedQuant,
    Quant,
    check_bits,
    encode_quant,
    narrow_dtype,
)
from tta_core.memory.scope import ACT, WGRAD, SaveSite
from tta_core.model.units import StagedModel

DENSE = "dense"
MASK = "mask"


@dataclass(frozen=True)
class Centred:
    """A codec encoding: a norm unit's input as means + the ~keep largest deviations."""

    keep: float


Encoding = str | float | Quant | Centred  # DENSE, MASK, a keep ratio, DAF bits, Centred


def _check_keep(unit: str, value: object) -> None:
    if value == DENSE:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"keep ratio for unit {unit!r} must be in (0, 1] or 'dense', "
                         f"got {value!r}")


@dataclass(frozen=True)
class CodecPlan:
    """Per-unit keep ratios of conv/linear saved inputs ("dense" = 1 = not pruned).

    Units missing from ``keep`` use ``default``. A keep ratio so close to 1 that bitmap +
    values would not be smaller than the dense tensor (>= 1 - 1/(8 * element size)) is
    stored dense. ``act_masks`` stores activation saves as exact 1-bit masks.
    ``sample``: at most this many entries are sampled for each pruning threshold.

    DAF quantization (tta_core.memory.quant): ``bits`` (per unit, 0/2/4/8) and
    ``default_bits`` (conv/linear units not in ``bits``; None = use the keep ratios) store a
    conv/linear unit's input quantized instead of pruned (bits win over keep); 0 = not
    stored (the unit must be frozen). ``norm_bits`` (BN/LN units not in ``bits``; None =
    dense) quantizes their float saves of at least MIN_QUANT_NUMEL entries; ``group``:
    entries per min/max group (a multiple of 8). ``narrow_ints``: integer saves of at least
    MIN_QUANT_NUMEL entries (max-pool indices) are held losslessly in the narrowest integer
    dtype that fits their values.

    ``norm_keep``: per BN/LN unit, the keep ratio of its input's deviations from the means
    (`Centred`; wins over ``norm_bits``). ``pool_inputs``: max-pool inputs are not stored.
    """

    keep: Mapping[str, float | str] = field(default_factory=dict)
    default: float | str = DENSE
    act_masks: bool = True
    sample: int = 65536
    bits: Mapping[str, int] = field(default_factory=dict)
    default_bits: int | None = None
    norm_bits: int | None = None
    group: int = 128
    narrow_ints: bool = False
    norm_keep: Mapping[str, float] = field(default_factory=dict)
    pool_inputs: bool = False

    def __post_init__(self) -> None:
        _check_keep("<default>", self.default)
        for unit, value in (*self.keep.items(), *self.norm_keep.items()):
            _check_keep(unit, value)
        if self.sample < 1:
            raise ValueError(f"sample must be >= 1, got {self.sample}")
        for unit, b in self.bits.items():
            check_bits(unit, b)
        if self.default_bits is not None:
            check_bits("<default_bits>", self.default_bits)
        if self.norm_bits is not None:
            check_bits("<norm_bits>", self.norm_bits, STORED_BITS)
        if isinstance(self.group, bool) or not isinstance(self.group, int) \
                or self.group < 8 or self.group % 8:
            raise ValueError(f"group must be a positive multiple of 8, got {self.group!r}")

    @classmethod
    def uniform(cls, keep: float | str, act_masks: bool = True) -> CodecPlan:
        """The same keep ratio for every unit."""
        return cls({}, keep, act_masks)

    def keep_of(self, unit: str) -> float:
        """The unit's keep ratio as a number (dense = 1.0)."""
        value = self.keep.get(unit, self.default)
        return 1.0 if value == DENSE else float(value)

    def bits_of(self, unit: str, kind: str = "") -> int | None:
        """The unit's DAF bit width (None: not quantized); norm units use norm_bits."""
        default = self.norm_bits if kind in NORM_KINDS else self.default_bits
        return self.bits.get(unit, default)

    def encoding(self, role: str, unit: str, elem: int, kind: str = "", numel: int = 0,
                 floating: bool = True, input_of: str = "") -> Encoding:
        """How a save of this role, unit and element size is stored (kind: the unit's kind,
        numel / floating: the save's, for DAF quantization of norm units' saves; input_of:
        SaveSite.input_of)."""
        if role == ACT:
            return MASK if self.act_masks else DENSE
        if role == WGRAD:
            bits = self.bits_of(unit, kind)
            if bits is not None:
                return Quant(bits, self.group)
            keep = self.keep_of(unit)
            return DENSE if keep >= 1.0 - 1.0 / (8 * elem) else keep
        if numel >= MIN_QUANT_NUMEL and not floating and self.narrow_ints:
            return NARROW
        if input_of == "pool" and self.pool_inputs:
            return Quant(0, self.group)
        if input_of in NORM_KINDS and unit in self.norm_keep:
            keep = float(self.norm_keep[unit])
            if keep < 1.0 - 1.0 / (8 * elem):
                return Centred(keep)
        if kind in NORM_KINDS and floating and numel >= MIN_QUANT_NUMEL:
            bits = self.bits_of(unit, kind)
            if bits:
                return Quant(bits, self.group)
        return DENSE


RELU_BAND = (0.0, float("inf"))


@dataclass(eq=False)
class ReluMask:
    """A ReLU output's exact 1-bit mask (a PackedMask), packed at the tensor's next save:
    by the fused pass when that save quantizes the same tensor, else alone (`settle`; also
    at the end of the forward). Until then it holds the tensor, which the next op reads
    anyway."""

    t: Tensor | None
    key: tuple
    nbytes: int
    mask: PackedMask | None = None

    def settle(self) -> PackedMask:
        """The packed mask (packed now if no fused pass made it)."""
        if self.mask is None:
            t, self.t = self.t, None
            if t is None or t._version != self.key[3]:
                raise RuntimeError("a ReLU output was modified in place before its next save: "
                                   "its saved mask would not match the ReLU's result")
            self.mask = PackedMask.encode(t, RELU_BAND)
        return self.mask

    def decode(self) -> Tensor:
        """The mask's stand-in tensor (PackedMask.decode)."""
        return self.settle().decode()


@dataclass(eq=False)
class _ReluDecode:
    """The one decode of a ReLU output held as its mask and quantized: made by the first of
    the two unpacks (the conv's, in backward order), handed to the second, then dropped.
    Holds the encodings' tensors, not the encodings (they key a weak dictionary)."""

    qt: Quantized
    bits: int
    group: int
    mask: Tensor
    shape: torch.Size
    perm: tuple[int, ...]
    out: Tensor | None = None

    def take(self) -> Tensor:
        """The decoded tensor: made now, or the one made for the other unpack."""
        if self.out is not None:
            out, self.out = self.out, None
            return out
        flat = unpack_dequantize_relu(self.qt, self.bits, self.group, self.shape.numel(),
                                      self.mask)
        self.out = restore_layout(flat, self.shape, self.perm)
        return self.out


class ActivationCodec(SavedTensorContext):
    """saved_tensors_hooks that store one forward's saves as the plan says (eager only)."""

    def __init__(self, target: StagedModel | nn.Module, plan: CodecPlan) -> None:
        super().__init__(target)
        unknown = sorted((set(plan.keep) | set(plan.bits) | set(plan.norm_keep))
                         - set(self.scope.unit_names))
        if unknown:
            raise ValueError(f"plan names units the model does not have: {unknown[:5]}")
        self.plan = plan
        self._cache: dict[tuple, tuple[StorageWeakRef, object]] = {}
        self._kinds = {name: kind for name, _m, kind in self.scope.units}
        self._modules = {name: mod for name, mod, _k in self.scope.units}
        self._relu_masks: dict[tuple, PackedMask | ReluMask] = {}  # this forward's, by key
        self._pending: ReluMask | None = None  # the last ReLU mask, until the next save
        self.fused_masks = 0  # masks packed by the fused pass in the last forward
        self._shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __enter__(self) -> ActivationCodec:
        self._check_dropped()
        self.fused_masks = 0
        super().__enter__()
        return self

    def _check_dropped(self) -> None:
        """0 bits (not stored) is only sound for a frozen conv/linear unit: checked here,
        before the forward, since autograd cannot drop a save once it is taken."""
        for unit, mod in self._modules.items():
            if self.plan.bits_of(unit, self._kinds[unit]) != 0:
                continue
            if self._kinds[unit] not in ("conv", "linear"):
                raise ValueError(f"unit {unit!r} ({self._kinds[unit]}) cannot have 0 bits: "
                                 "only conv/linear inputs can be left unstored")
            if any(p.requires_grad for p in mod.parameters(recurse=False)):
                raise ValueError(f"unit {unit!r} has 0 bits but its parameters require "
                                 "grad: freeze it before the forward")

    def _pack(self, t: Tensor, site: SaveSite) -> object:
        packed = self._pack_one(t, site)
        if self._pending is not None and self._pending is not packed:
            self._settle_pending()  # this save did not take the last ReLU mask
        return packed

    def _settle_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.settle()

    def _pack_one(self, t: Tensor, site: SaveSite) -> object:
        enc = self.plan.encoding(site.role, site.unit, t.element_size(),
                                 self._kinds.get(site.unit, ""), t.numel(),
                                 t.is_floating_point(), site.input_of)
        if enc == NARROW and (narrow := narrow_dtype(t)) is not None:
            return self._store(t, enc, site, lambda: PackedInt(t.detach().to(narrow), t.dtype))
        if enc in (DENSE, NARROW):
            self.ledger.storage_index(t, site)
            return t
        if enc == MASK:
            if site.band != RELU_BAND or t.dtype != torch.float32:
                return self._store(t, enc, site, lambda: PackedMask.encode(t, site.band))
            self._settle_pending()
            key = self._key(t, MASK)
            if native_masks(t.dtype, t.device):
                mask = self._store(t, enc, site, lambda: ReluMask(t, key, (t.numel() + 7) // 8))
                self._pending = mask if mask.mask is None else None  # type: ignore[union-attr]
            else:
                mask = self._store(t, enc, site, lambda: PackedMask.encode(t, site.band))
            self._relu_masks[key] = mask  # type: ignore[assignment]
            return mask
        if isinstance(enc, Quant):
            return self._store(t, enc, site, lambda: self._quantize(t, enc))
        if isinstance(enc, Centred):
            dims = self._norm_dims(site.unit, t)
            return self._store(t, enc, site, lambda: CentredPruned.encode(
                t, enc.keep, dims, self.plan.sample))
        return self._store(t, enc, site,
                           lambda: PackedPruned.encode(t, float(enc), self.plan.sample))

    def _norm_dims(self, unit: str, t: Tensor) -> tuple[int, ...]:
        """The dims a norm unit normalises over: LN its last ones, BN all but channels; GN
        its spatial dims (means per sample and channel: finer than its groups' own, so
        every group mean is kept as well)."""
        mod = self._modules[unit]
        if isinstance(mod, nn.LayerNorm):
            return tuple(range(t.dim() - len(mod.normalized_shape), t.dim()))
        if isinstance(mod, nn.GroupNorm):
            return tuple(range(2, t.dim()))
        return tuple(d for d in range(t.dim()) if d != 1)

    def _quantize(self, t: Tensor, enc: Quant) -> object:
        """encode_quant(t, enc); with the pending ReLU mask of this very tensor, both from
        one fused pass (bit-identical to the separate passes: tta_kernels' tests)."""
        pending = self._pending
        if pending is None or not enc.bits or pending.key != self._key(t, MASK):
            return encode_quant(t, enc)
        flat, perm = memory_order(t.detach())
        qt, bits = quantize_pack_mask(flat, enc.bits, enc.group, RELU_BAND)
        pending.mask, pending.t, self._pending = PackedMask(bits, t.shape, perm, t.dtype,
                                                            0.0, 1.0), None, None
        self.fused_masks += 1
        return PackedQuant(qt, t.shape, perm, t.dtype, enc.bits, enc.group)

    def _store(self, t: Tensor, enc: Encoding, site: SaveSite, encode: Callable[[], object]
               ) -> object:
        """The encoding of t made earlier in this forward, or a new one (counted)."""
        hit = self._lookup(t, enc)
        if hit is not None:
            return hit
        packed = encode()
        self._cache[self._key(t, enc)] = (StorageWeakRef(t.untyped_storage()), packed)
        self.ledger.add(packed.nbytes, site)  # type: ignore[attr-defined]
        if isinstance(packed, PackedQuant):
            self._share_relu_decode(t, packed)
        return packed

    def _share_relu_decode(self, t: Tensor, packed: PackedQuant) -> None:
        """Link a quantized save to the ReLU mask of the very same tensor, if this forward
        made one (and it is not linked yet): both then unpack to one _ReluDecode."""
        mask = self._relu_masks.get(self._key(t, MASK))
        if mask is None or mask in self._shared or self._lookup(t, MASK) is not mask \
                or packed.dtype != torch.float32:
            return
        bits = mask.settle().bits if isinstance(mask, ReluMask) else mask.bits
        shared = _ReluDecode(packed.qt, packed.bits, packed.group, bits, packed.shape,
                             packed.perm)
        self._shared[mask] = self._shared[packed] = shared

    @staticmethod
    def _key(t: Tensor, enc: Encoding) -> tuple:
        return (t.data_ptr(), tuple(t.shape), t.stride(), t._version, enc)

    def _lookup(self, t: Tensor, enc: Encoding) -> object | None:
        """The encoding made earlier in this forward of this very tensor, if any."""
        hit = self._cache.get(self._key(t, enc))
        if hit is None or hit[0].expired():
            return None
        return hit[1]

    def _unpack(self, packed: object) -> Tensor:
        if isinstance(packed, PackedMask | PackedQuant | ReluMask):
            shared = self._shared.get(packed)
            if shared is not None:
                return shared.take()
        if isinstance(packed, PackedMask | ReluMask | PackedPruned | PackedQuant | Dropped
                      | PackedInt | CentredPruned):
            return packed.decode()
        return packed  # type: ignore[return-value]

    def _keep_ratios(self) -> dict[str, float]:
        """Per unit: the keep ratio, or bits / 32 for a DAF-quantized unit (analytic_kept)."""
        out = {}
        for u in self.scope.unit_names:
            bits = self.plan.bits_of(u, self._kinds[u])
            out[u] = self.plan.keep_of(u) if bits is None else bits / 32
        return out

    def _clear_batch(self) -> None:
        self._settle_pending()
        self._cache.clear()
        self._relu_masks.clear()
