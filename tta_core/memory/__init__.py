"""Memory-budgeted adaptation: measured saved-activation accounting and a saved-tensor codec.

accounting: SavedActivationCounter (bytes autograd saves per unit, deduplicated by storage),
peak RSS / CUDA helpers. codec: ActivationCodec + CodecPlan (exact 1-bit activation masks,
per-unit magnitude pruning of conv/linear inputs). predict: a plan's bytes from a profile.
"""

from tta_core.memory.accounting import (
    MemoryPeaks,
    SavedActivationCounter,
    memory_peaks,
    peak_rss_bytes,
    refuse_compile,
    reset_peaks,
)
from tta_core.memory.codec import DENSE, ActivationCodec, CodecPlan
from tta_core.memory.ledger import SavedBytes
from tta_core.memory.predict import PredictedBytes, SaveProfile, predicted_bytes, profile_saves

__all__ = [
    "DENSE", "ActivationCodec", "CodecPlan", "MemoryPeaks", "PredictedBytes",
    "SaveProfile", "SavedActivationCounter", "SavedBytes", "memory_peaks", "peak_rss_bytes",
    "predicted_bytes", "profile_saves", "refuse_compile", "reset_peaks",
]
