"""DARDA's online phase as the paper builds it (§4.4-4.6), from an offline bundle.

The darda method runs this when `bundle_path` names a bundle (`tta train-darda`). Per batch:

1. corruption signature: the encoder h's projections of the samples (through the
   extractor g; Table 2's "no_extractor" uses the encoder trained without it), their
   normalised mean c;
2. shift: c's cosine to the running signature of the ongoing corruption falls below
   `shift_cos`, or the shift test (tta_core.domain.detector.ShiftTest, `shift`) confirms a
   change of the batch embedding (the darda method reads it in the forward: input moments,
   corruption residual, the first BN layer's input, none of which the swapped state
   touches), or the first batch; on a shift the sub-network closest to c by Eq. 10
   (S^i . c, S^i = S(F^i) of the bootstrapped fingerprints) is copied into the model, and
   C_cur becomes the nearest corruption centroid, and the memory bank drops its samples
   below `min_similarity` to it (the previous corruption's);
3. the batch is predicted forward-only; its samples are offered to the memory bank
   (Algorithm 1, tta_core.darda.corruption_memory) with their projections;
4. once after each shift, when the bank holds `min_bank` samples and its cosine variance
   to C_cur is below `phi_thresh` (or `max_wait` batches after the shift): context-aware
   BN (Eq. 15: one forward of the bank's samples, running statistics moved with
   momentum `context_momentum`), then one adaptation (`steps` SGD steps, one by
   default) of the BN affine and the final dense layer on Eq. 16, exp(-S . C_bar), with
   S computed from the fingerprint of the current model on the fixed noise and C_bar the
   bank's mean projection; the batch is predicted again by the updated model.

Table 2 variants (`variant`): full; no_extractor; no_bn_adapt (the bootstrapped
sub-network only); bn_only (Eq. 15 without the step); bn_entropy (Eq. 15 + one entropy step
on the bank's samples instead of Eq. 16).

Robot extension (`learn_domains`, not in the paper): a corruption whose signature is
farther than `novelty_cos` from every training centroid is learnt: after its one
adaptation its state and running signature are banked (at most `max_domains`, LRU), and a
later batch that matches it (cosine >= `novelty_cos`) loads that state instead of a
bootstrapped one, with no backward pass. The darda method saves and loads them in its
`bank_path` (tta_core.darda.method: PaperDarda).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tta_core.darda.bn import refreshing
from tta_core.darda.corruption_memory import CorruptionMemory
from tta_core.darda.offline import Offline
from tta_core.darda.subnet import adaptation_loss, closest_index, fingerprint
from tta_core.domain.bank import adapted_tensors, last_linear
from tta_core.domain.detector import ShiftConfig, ShiftTest
from tta_core.model.robust_bn import batch_norm_layers
from tta_core.runtime import losses

VARIANTS = ("full", "no_extractor", "no_bn_adapt", "bn_only", "bn_entropy")


@dataclass
class PaperConfig:
    """Online settings of the paper's DARDA (fed by DardaConfig)."""

    variant: str = "full"
    shift_cos: float = 0.9
    track: float = 0.2  # EMA rate of the running signature
    phi_thresh: float = 0.02
    max_wait: int = 3
    min_bank: int = 1
    context_momentum: float = 0.5
    lr: float = 1e-3
    steps: int = 1  # gradient steps of the one adaptation (the paper: one)
    source_guard: bool = False  # keep the source's state when the pick predicts the bank worse
    memory_capacity: int = 64
    min_similarity: float = 0.0
    learn_domains: bool = False
    novelty_cos: float = 0.95
    max_domains: int = 16
    shift: ShiftConfig | None = None  # the shift test on batch embeddings (None: none)

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        if self.shift is not None:
            self.shift.validate()
        if self.variant not in VARIANTS:
            raise ValueError(f"darda variant {self.variant!r} not in {VARIANTS}")
        for name in ("shift_cos", "novelty_cos", "min_similarity"):
            if not -1.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"darda {name}={getattr(self, name)} not in [-1, 1]")
        if not 0 < self.track <= 1 or not 0 <= self.context_momentum <= 1:
            raise ValueError(f"darda track {self.track} (in (0, 1]) or context_momentum "
                             f"{self.context_momentum} (in [0, 1]) out of range")
        if min(self.max_wait, self.memory_capacity, self.max_domains, self.steps) < 1:
            raise ValueError(f"darda max_wait {self.max_wait}, memory_capacity "
                             f"{self.memory_capacity}, max_domains {self.max_domains}, "
                             f"paper_steps {self.steps} must be >= 1")


@dataclass
class Learnt:
    """A corruption learnt online (the robot extension): signature and adapted state."""

    signature: Tensor
    state: dict[str, Tensor]


class PaperOnline:
    """The per-batch machinery of the module docstring (no TTAMethod plumbing here)."""

    def __init__(self, model: nn.Module, off: Offline, cfg: PaperConfig) -> None:
        cfg.validate()
        self.model, self.off, self.cfg = model, off, cfg
        self.live = adapted_tensors(model)
        self.source_state = {k: t.detach().clone() for k, t in self.live.items()}
        self.kept_source = 0  # adaptations where the source guard kept the source's state
        raw = cfg.variant == "no_extractor"
        self.encoder = off.raw_encoder if raw else off.encoder
        self.s = off.raw_s if raw else off.s
        self.centroids = off.raw_centroids if raw else off.centroids
        with torch.no_grad():
            self.signatures = self.s(off.fingerprints)
        # Eq. 10 picks the sub-network whose signature S(F^i) is closest to the batch's;
        # a bundle whose S was trained with Eq. 9 as printed (i != j) pulls S(F^i) away
        # from its own centroid, so its sub-network is picked by the nearest centroid
        self.pick_by_centroid = off.config.get("cm_pairs") == "off_diagonal"
        self.noise = off.noise
        self.bns = list(batch_norm_layers(model).values())
        self.params = [t for k, t in self.live.items() if k.endswith((".weight", ".bias"))]
        self.opt = torch.optim.SGD(self.params, lr=cfg.lr)
        classes = int(model.get_submodule(last_linear(model)).out_features)
        self.memory = CorruptionMemory(cfg.memory_capacity, classes, cfg.min_similarity)
        self.learnt: OrderedDict[str, Learnt] = OrderedDict()
        self.shift_test = ShiftTest(cfg.shift) if cfg.shift is not None else None
        self.fresh()

    def fresh(self) -> None:
        """Forget the ongoing corruption, the memory bank and the learnt domains."""
        self.running: Tensor | None = None
        self.shift_score = math.nan  # the shift test's score of the last batch
        if self.shift_test is not None:
            self.shift_test.fresh()
        self.center = self.centroids[0]
        self.domain, self.pending, self.waited, self.novel = "", False, 0, False
        self.backward_passes, self.shifts, self.next_id, self.kept_source = 0, 0, 0, 0
        self.memory.clear()
        self.learnt.clear()
        self.opt.state.clear()

    def signature(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(per-sample projections [B, dim], the batch's unit signature c)."""
        with torch.no_grad():
            proj = self.encoder(x)
        return proj, F.normalize(proj.mean(0), dim=0)

    def observe(self, c: Tensor, e: Tensor | None = None, w: Tensor | None = None) -> bool:
        """Shift detection and bootstrapping (steps 2 of the module doc) from the batch's
        signature `c` and, for the shift test, its embedding `e` (`w`: within-batch
        spread); True on a shift. What a shift decides is computed with the cosine to the
        running signature and read with it in one transfer."""
        test = self.shift_test if e is not None else None
        decided = test.observe(e, w) if test is not None else None
        self.shift_score = decided.score if decided is not None else math.nan
        confirmed = decided is not None and decided.shift
        k = torch.argmax(self.centroids @ c).reshape(1)
        pieces = [k, closest_index(self.signatures, c).reshape(1)]
        tracking = self.running is not None
        if tracking:
            pieces.append((self.running @ c).reshape(1))
        if self.cfg.learn_domains:  # the nearest centroid's cosine, each learnt one's
            pieces.append((self.centroids.index_select(0, k)[0] @ c).reshape(1))
            pieces += [(d.signature @ c).reshape(1) for d in self.learnt.values()]
        v = torch.cat([t.double() for t in pieces]).tolist()
        if tracking and v[2] >= self.cfg.shift_cos and not confirmed:  # the same corruption
            self.running = F.normalize((1 - self.cfg.track) * self.running
                                       + self.cfg.track * c, dim=0)
            return False
        if test is not None and not confirmed:  # the cosine rule decided: a new segment
            test.restart()
        self.running, self.shifts = c.clone(), self.shifts + 1
        self.center = self.centroids[int(v[0])]
        sims = v[3 if tracking else 2:]  # learn_domains: the cosines
        self.novel = self.cfg.learn_domains and sims[0] < self.cfg.novelty_cos
        hit = self._learnt_match(sims[1:]) if self.novel else ""
        if hit:
            self.domain, self.pending = hit, False
            self.learnt.move_to_end(hit)
            self._load(self.learnt[hit].state)
        else:
            i = int(v[0] if self.pick_by_centroid else v[1])
            self.domain, self.pending, self.waited = self.off.names[i], True, 0
            self._load(self.off.states[self.off.names[i]])
        self.memory.retarget(self.center)
        self.opt.state.clear()
        return True

    def _learnt_match(self, sims: list[float]) -> str:
        """The learnt corruption most similar to the batch (`sims`: cosines of the learnt
        signatures, in order), '' when none reaches novelty_cos."""
        best, name = -2.0, ""
        for n, sim in zip(self.learnt, sims, strict=True):
            if sim > best:
                best, name = sim, n
        return name if best >= self.cfg.novelty_cos else ""

    def _load(self, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for k, t in self.live.items():
                t.copy_(state[k])

    def remember(self, x: Tensor, logits: Tensor, proj: Tensor,
                 extra: Tensor | None = None) -> list[float]:
        """Offer the batch to the memory bank (Algorithm 1); `extra` (1-D) is read to the
        host with the admission's inputs, its values returned."""
        return self.memory.add_reading(x, logits.argmax(1), proj, self.center, extra)[1]

    def ready(self) -> bool:
        """Whether the one adaptation of the ongoing corruption runs on this batch."""
        if not self.pending or self.cfg.variant == "no_bn_adapt" or len(self.memory) < 2:
            return False
        self.waited += 1
        return (len(self.memory) >= self.cfg.min_bank
                and self.memory.similarity_variance(self.center) <= self.cfg.phi_thresh) \
            or self.waited >= self.cfg.max_wait

    def adapt(self) -> bool:
        """Eq. 15 from the bank, then `steps` steps (Eq. 16, or entropy); True if a backward
        ran."""
        xs = self.memory.samples()
        self.pending = False
        if self.cfg.source_guard:
            self._guard(xs)
        else:
            self._refresh(xs)
        backward = self.cfg.variant in ("full", "no_extractor", "bn_entropy")
        if backward:
            for _ in range(self.cfg.steps):
                self.opt.zero_grad(set_to_none=True)
                with torch.enable_grad():
                    loss = self._loss(xs)
                    loss.backward()
                self.opt.step()
            self.backward_passes += self.cfg.steps
        if self.novel:
            self._bank()
        return backward

    def _refresh(self, xs: Tensor) -> None:
        """Eq. 15: one forward of the bank's samples moves the running statistics."""
        with torch.no_grad(), refreshing(self.bns, self.cfg.context_momentum):
            self.model(xs)

    def _guard(self, xs: Tensor) -> None:
        """Eq. 15 on the picked sub-network and on the source's state; keep the one whose
        predictions of the bank's samples have the lower mean entropy. The nearest training
        corruption's sub-network can be worse than the source's own state on an unseen
        corruption the source already handles; this is the unsupervised check."""
        scores, states = [], []
        picked = {k: t.detach().clone() for k, t in self.live.items()}
        for state in (picked, self.source_state):
            self._load(state)
            self._refresh(xs)
            with torch.no_grad():
                scores.append(float(losses.entropy_loss(self.model(xs))))
            states.append({k: t.detach().clone() for k, t in self.live.items()})
        keep = int(scores[1] < scores[0])
        self.kept_source += keep
        self._load(states[keep])

    def calibrate(self) -> float:
        """Milliseconds of one adaptation on a full bank of noise (state restored): the
        cost a deadline must leave room for before the first real one is measured."""
        n = self.memory.quota * self.memory.num_classes
        xs = self.noise.repeat(-(-n // len(self.noise)), 1, 1, 1)[:n]
        saved = {k: t.detach().clone() for k, t in self.live.items()}
        t0 = time.perf_counter()
        with torch.no_grad(), refreshing(self.bns, self.cfg.context_momentum):
            self.model(xs)
        with torch.enable_grad():
            self.s(fingerprint(self.model, self.noise)).sum().backward()
        ms = (time.perf_counter() - t0) * 1e3
        self.opt.zero_grad(set_to_none=True)
        self._load(saved)
        return ms

    def _loss(self, xs: Tensor) -> Tensor:
        if self.cfg.variant == "bn_entropy":
            return losses.entropy_loss(self.model(xs))
        s = self.s(fingerprint(self.model, self.noise))
        return adaptation_loss(s, self.memory.mean_projection())

    def _bank(self) -> None:
        """Robot extension: keep the adapted state of a novel corruption."""
        if len(self.learnt) >= self.cfg.max_domains:
            self.learnt.popitem(last=False)
        name = f"learnt{self.next_id}"
        self.next_id += 1
        self.learnt[name] = Learnt(self.running.clone(),
                                   {k: t.detach().clone() for k, t in self.live.items()})
        self.domain = name
