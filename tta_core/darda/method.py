"""DARDA: domain-aware adaptation with a bank of per-domain states.

After "DARDA: Domain-Aware Real-Time Dynamic Neural Network Adaptation" (seed 004), the
online part: the batch embedding is the channel moments of the first BatchNorm inputs plus
the fixed-kernel corruption residual of the input (DARDA §4.1's two downsamplings), and
optionally DARDA's learnt corruption encoder (`encoder_path`; tta_core.domain.embedding,
tta_core.domain.encoder), read inside the forward. In the pre-hook of the last embedded
layer (before any adapted layer runs) the detector assigns the batch to a known domain or
a new one (hysteresis, novelty, a confident first-batch switch), and on a switch the bank
copies that domain's state (upper BN affine [+ running stats], final linear layer) into
the live tensors: the batch is already predicted by the right state, with no extra pass.
A new domain starts from the nearest known domain's state. The detection, bank and gate
are tta_core.domain.switch's DomainSwitch (shared with adashadow's `domain_bank`).

Adaptation (Tent's entropy, SGD on the upper BN affine [+ the classifier with
`adapt_fc`]) runs only after a perceived shift: a domain switch or a shift the shift test
(tta_core.domain.detector.ShiftTest) confirms inside the active domain, `per_shift`
backward passes each (`gate_policy` "shift", tta_core.domain.gate; "stable": until the
domain's entropy settles); then batches are served forward-only. SGD momentum is reset on
every switch (not banked: see tta_core.domain.bank). With bn_mode "bank" the upper BN
layers normalise with the domain's running statistics (robust BN) and are refreshed from
a label-balanced memory of recent samples (DARDA Eq. 15), once per perceived shift when
the memory is half full. The bank is saved and loaded with `save_bank` / `load_bank`
(safetensors, tta_core.darda.store).

Deadline (DeadlineConfig fields, as AdaShadow's; `tta bench --stream-hz` sets camera
mode): an owed backward pass runs on a batch only if the time spent + the predicted
adapted step (the most of its last ADAPT_WINDOW measured costs; before one is measured
ADAPT_FACTOR x the forward-only step, or `warm_up`'s measurement on noise) + the learnt
timing margin fit what is left of the deadline; otherwise the batch is served
forward-only and the pass stays owed (`deferred`) until a batch where it fits or the next
shift (`skipped`). The Eq. 15 refresh waits the same way. `StepResult.stats` of every
batch: `shift` (perceived here), `reason` (why its backward pass ran: "new_domain",
"shift", "drift"; "" none), `deferred`.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from tta_core.api import StepResult
from tta_core.darda.bn import BANK_BN_MODES, configure, refreshing
from tta_core.darda.bundle import expect_for as bundle_expect
from tta_core.darda.bundle import load_bundle
from tta_core.darda.memory import BalancedMemory
from tta_core.darda.paper import VARIANTS, Learnt, PaperConfig, PaperOnline
from tta_core.darda.store import clean_stale_temps, load_bank, model_fingerprint, save_bank
from tta_core.domain.bank import SOURCE, StateBank, adapted_tensors, last_linear
from tta_core.domain.detector import Detection, DetectorConfig, DomainDetector, ShiftConfig
from tta_core.domain.embedding import DomainEmbedder, EmbeddingConfig
from tta_core.domain.gate import NEW_DOMAIN, POLICIES, SHIFT, AdaptGate, DomainGate, GateConfig
from tta_core.domain.switch import DomainSwitch, SwitchConfig, embedder_for, shift_dims
from tta_core.errors import InputError, one_line
from tta_core.model.robust_bn import RobustBN, batch_norm_layers
from tta_core.registry import register_factory
from tta_core.runtime import losses
from tta_core.runtime.deadline import (
    DEADLINE_MODES,
    DeadlineBudget,
    DeadlineConfig,
    apply_settings,
)
from tta_core.runtime.fixed_costs import FixedCosts
from tta_core.runtime.method import MethodConfig, Step, TTAMethod
from tta_core.runtime.options import option

log = logging.getLogger(__name__)


#: measured costs of the one adaptation kept to predict the next one (their maximum)
ADAPT_WINDOW = 4
#: before an adapted step was measured: its cost in forward-only steps (forward with
#: grad + backward + reforward)
ADAPT_FACTOR = 3.0
#: measured forward-only steps (without their detection) and detection costs kept to
#: predict whether a batch has room for its detection (the most of the former, the median
#: of the latter)
SERVE_WINDOW = 8


@dataclass
class DardaConfig(MethodConfig, DeadlineConfig):
    """DARDA settings; detector defaults measured in benchmarks/domains/bench_domain.py, the shift
    test's and the gate's in benchmarks/domains/bench_darda_realtime.py. The deadline fields
    (DeadlineConfig): an owed backward pass (or the paper's one adaptation) waits for a
    batch where it fits."""

    embed_layers: int = option(3, "BN inputs in the domain embedding (the layers up to "
                               "them stay frozen)", low=1)
    per_sample: bool = option(True, "embedding: mean of per-sample log-variances (else the "
                              "log of the pooled variance)")
    residual: bool = option(True, "add the corruption residual features to the embedding "
                            "(tta_core.domain.embedding)")
    encoder_path: str = option("", "learnt corruption encoder added to the embedding (`tta "
                               "train-corruption-encoder`; '': none)", path="read")
    hysteresis: int = option(2, "detector: consecutive batches away from the active domain "
                             "before a switch", low=1)
    confident: float = option(0.8, "detector: no hysteresis when the nearest domain is "
                              "within this times the threshold (0: never); in [0, 1)",
                              low=0.0, high=1.0)
    novelty_quantile: float = option(0.5, "detector: quantile of the within-domain distances "
                                     "that sets the novelty threshold; in (0, 1]",
                                     low=0.0, high=1.0)
    novelty_margin: float = option(1.5, "detector: a batch farther than this times the "
                                   "threshold from every domain is novel (> 0)", low=0.0)
    max_domains: int = option(32, "detector: most domains kept in the bank", low=2)
    gate_policy: str = option("shift", "gate: 'shift' = per_shift backward passes after "
                              "each perceived shift (DARDA: adapt once per perceived "
                              "corruption), 'stable' = until the domain's entropy settles "
                              "(min_adapt / max_adapt)", choices=POLICIES)
    per_shift: int = option(1, "gate: backward passes after each perceived shift", low=1)
    shift_threshold: float = option(3.0, "shift test: a batch whose mean standardised "
                                    "square distance to its segment exceeds this is away "
                                    "(tta_core.domain.detector.ShiftTest)", low=0.0)
    shift_confirm: int = option(2, "shift test: away batches in a row that make a shift",
                                low=1)
    min_adapt: int = option(6, "gate 'stable': batches a domain adapts at least", low=1)
    max_adapt: int = option(16, "gate 'stable': batches a domain adapts at most (>= "
                            "min_adapt)", low=1)
    stable_tol: float = option(0.1, "gate: a domain is stable when its entropy moves less "
                               "than this", low=0.0)
    drift_tol: float = option(0.25, "gate: a stable domain adapts again when its entropy "
                              "drifts more than this", low=0.0)
    adapt_fc: bool = option(False, "adapt the classifier too (it is banked either way)")
    init_from: str = option("nearest", "state of a new domain: the nearest known one, or "
                            "the source", choices=("nearest", SOURCE))
    bn_mode: str = option("bank", "upper BN layers: the domain's running statistics (bank) "
                          "or the batch's (batch)", choices=BANK_BN_MODES)
    bn_momentum: float = option(0.05, "robust BN momentum (bn_mode bank)", low=0.0,
                                high=1.0)
    refresh: bool = option(False, "refresh the statistics from the memory bank (Eq. 15, "
                           "bn_mode bank; gate 'shift': once per perceived shift)")
    refresh_momentum: float = option(0.5, "refresh: momentum of the refreshed statistics",
                                     low=0.0, high=1.0)
    refresh_every: int = option(4, "refresh: every this many batches", low=1)
    memory_capacity: int = option(64, "samples in the class-balanced memory bank", low=1)
    reforward: bool = option(True, "predict with the updated model")
    bank_path: str = option("", "domain bank file: loaded at start when it exists (a bad "
                            "file: warning, fresh start); '': not kept", path="write")
    # the paper's online phase (tta_core.darda.paper), used when bundle_path is set
    bundle_path: str = option("", "offline bundle (`tta train-darda`): run the paper's "
                              "online phase from it; '': the online-learnt domain bank",
                              path="read")
    variant: str = option("full", "paper: Table 2 variant", choices=VARIANTS)
    shift_cos: float = option(0.9, "paper: a batch signature below this cosine to the "
                              "running one is a corruption shift at once (the shift test "
                              "perceives the others)", low=-1.0, high=1.0)
    phi_thresh: float = option(0.02, "paper: Eq. 15 runs once the memory bank's cosine "
                               "variance to the centroid is below this", low=0.0)
    max_wait: int = option(3, "paper: ... or this many batches after the shift", low=1)
    min_bank: int = option(1, "paper: ... and the bank holds at least this many samples "
                           "of the ongoing corruption", low=1)
    context_momentum: float = option(0.5, "paper: Eq. 15 momentum m", low=0.0, high=1.0)
    paper_lr: float = option(1e-3, "paper: SGD rate of the Eq. 16 steps", low=0.0)
    paper_source_guard: bool = option(
        False, "paper + guard: after Eq. 15 keep the source's state instead of the picked "
        "sub-network when it predicts the memory bank with the lower mean entropy")
    paper_steps: int = option(1, "paper: SGD steps of the one adaptation after a shift "
                              "(the paper: one)", low=1)
    learn_domains: bool = option(False, "paper + robot extension: learn and bank a "
                                 "corruption far from every training one")
    novelty_cos: float = option(0.95, "extension: a signature below this cosine to every "
                                "training centroid is novel", low=-1.0, high=1.0)
    deadline_mode: str = option(
        "sigma", "what a batch's deadline is (an owed backward pass or adaptation waits for "
        "a batch where it fits): sigma = none, fixed = deadline_ms, camera = the batch's "
        "frames at camera_hz, speed = distance_per_decision_m at the vehicle's speed",
        choices=DEADLINE_MODES)

    def validate(self) -> None:
        """ValueError naming a bad field."""
        if self.bn_mode not in BANK_BN_MODES:
            raise ValueError(f"darda bn_mode {self.bn_mode!r} not in {BANK_BN_MODES}")
        if self.init_from not in ("nearest", SOURCE):
            raise ValueError(f"darda init_from {self.init_from!r} not in ('nearest', 'source')")
        if self.embed_layers < 1 or self.memory_capacity < 1 or self.refresh_every < 1:
            raise ValueError(f"darda embed_layers {self.embed_layers}, memory_capacity "
                             f"{self.memory_capacity}, refresh_every {self.refresh_every} "
                             "must be >= 1")
        if self.gate_policy not in POLICIES:
            raise ValueError(f"darda gate_policy {self.gate_policy!r} not in {POLICIES}")
        DeadlineConfig.validate(self)

    def shift_config(self, dims: int = 0) -> ShiftConfig:
        """The shift test these settings make (reading the embedding's first `dims`)."""
        return ShiftConfig(threshold=self.shift_threshold, confirm=self.shift_confirm,
                           dims=dims)


class Darda(TTAMethod, DeadlineBudget):
    """Domain bank TTA: detect, swap, adapt after a perceived shift. Capabilities:
    ReportsDomain, DeadlineTunable, WarmsUp (tta_core.api). The method `darda` builds
    this class, or PaperDarda (the paper's online phase) when `bundle_path` is set
    (`build_darda`)."""

    config_cls = DardaConfig
    config: DardaConfig

    #: the time source of the deadline decisions (seconds; tests inject a fake one)
    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(self, model: nn.Module, config: DardaConfig | None = None) -> None:
        super().__init__(model, config)
        self.bank_error = ""
        if self.config.bank_path:
            clean_stale_temps(self.config.bank_path)
        if self.config.bank_path and Path(self.config.bank_path).is_file():
            try:
                self.load_bank(self.config.bank_path)
            except InputError as exc:
                self.bank_error = str(exc)
                log.warning("%s; starting with an empty domain bank", exc)

    def _deadline_state(self) -> None:
        """What the deadline decisions learn (both variants)."""
        self.fixed = FixedCosts()
        self.adapt_seen: deque[float] = deque(maxlen=ADAPT_WINDOW)
        self.plain_seen: deque[float] = deque(maxlen=SERVE_WINDOW)  # steps less detection
        self.detect_seen: deque[float] = deque(maxlen=SERVE_WINDOW)  # detection costs
        self.deferred = self.skipped = self.undetected = 0
        self._t0, self._predicted = 0.0, math.nan

    def configure_model(self) -> None:
        c = self.config
        c.validate()
        if len(c.input_shape) != 3:
            raise ValueError(f"darda needs input_shape, one sample (C, H, W), got "
                             f"{tuple(c.input_shape)}")
        self.embedder = embedder_for(self.model, c.input_shape,
                                     EmbeddingConfig(c.embed_layers, True, c.per_sample,
                                                     c.residual, c.encoder_path))
        upper = configure(self.model, self.embedder.layer_names, c.bn_mode)
        bns = batch_norm_layers(self.model)
        self._upper = [bns[n] for n in upper]
        for bn in self._upper:
            for p in (bn.weight, bn.bias):
                if p is not None:
                    p.requires_grad_(True)
        fc = last_linear(self.model)
        if c.adapt_fc and fc:
            self.model.get_submodule(fc).requires_grad_(True)
        self.num_classes = int(self.model.get_submodule(fc).out_features) if fc else 0
        if not any(p.requires_grad for p in self.model.parameters()):
            raise self.nothing_to_adapt("no BatchNorm affine after the embedding layers")
        # lagged (normalise, then move the statistics, in one read of the input): an
        # upper layer costs what an eval-mode BN does
        self._rbn = RobustBN(self._upper, c.bn_momentum, lag=True) \
            if c.bn_mode == "bank" else None
        keep = set(upper)
        self._live = adapted_tensors(self.model, skip=lambda n: n not in keep)
        self._source = {k: v.detach().clone() for k, v in self._live.items()}
        self.fingerprint = model_fingerprint(self.model, self._live)
        self.switch = DomainSwitch(self.embedder, self._live, SwitchConfig(
            DetectorConfig(hysteresis=c.hysteresis, confident=c.confident,
                           novelty_quantile=c.novelty_quantile,
                           novelty_margin=c.novelty_margin, max_domains=c.max_domains),
            GateConfig(c.min_adapt, c.max_adapt, tol=c.stable_tol, drift_tol=c.drift_tol,
                       policy=c.gate_policy, per_shift=c.per_shift),
            c.init_from, c.shift_config(shift_dims(self.model, self.embedder,
                                                    c.input_shape[0]))),
            source=self._source, on_switch=self._on_switch)
        self._deadline_state()
        self.refresh_seen: deque[float] = deque(maxlen=ADAPT_WINDOW)
        self._fresh()

    def _fresh(self) -> None:
        c = self.config
        self.switch.fresh()
        use_memory = c.bn_mode == "bank" and c.refresh and self.num_classes >= 2
        self.memory = BalancedMemory(c.memory_capacity, self.num_classes) if use_memory else None
        self.backward_passes, self._since_refresh = 0, 0
        self._refresh_owed = False
        self.deferred = self.skipped = self.undetected = 0

    @property
    def detector(self) -> DomainDetector:
        """The domain detector (tta_core.domain.switch)."""
        return self.switch.detector

    @property
    def bank(self) -> StateBank:
        """Per-domain states."""
        return self.switch.bank

    @property
    def gate(self) -> AdaptGate:
        """When to adapt."""
        return self.switch.gate

    @property
    def shift_policy(self) -> bool:
        """Backward passes (and the Eq. 15 refresh) owed per perceived shift."""
        return self.gate.shift_policy

    def _on_switch(self, _det: Detection | None) -> None:
        """Inside the forward, after a swap or a shift inside the domain: reset what is not
        banked; the Eq. 15 refresh is owed to the new segment."""
        if self.optimizer is not None:
            self.optimizer.state.clear()  # momentum reset, not banked
        if self.memory is not None:
            self.memory.clear()
        self._since_refresh = 0
        self._refresh_owed = self.shift_policy and self.memory is not None

    @contextmanager
    def _quiet(self) -> Iterator[None]:
        """Forwards that are not the batch's own: no detection, no robust-BN update; both
        flags are given back as they were."""
        saved = self.embedder.enabled, self._rbn.enabled if self._rbn is not None else None
        self.embedder.enabled = False
        if self._rbn is not None:
            self._rbn.enabled = False
        try:
            yield
        finally:
            self.embedder.enabled = saved[0]
            if self._rbn is not None:
                self._rbn.enabled = bool(saved[1])

    def current_domain(self) -> str:
        """The active domain's name ('' before the first batch)."""
        return self.detector.current_name

    # ------------------------------------------------------------ the deadline
    def set_deadline(self, **settings: object) -> None:
        """New deadline settings (DeadlineConfig fields) from the next batch on; ValueError
        naming a bad one (nothing is changed then)."""
        apply_settings(self.config, settings)

    def elapsed_ms(self) -> float:
        """Time spent on the batch so far (`clock`)."""
        return (self.clock() - self._t0) * 1e3

    def fits(self, step: Step, cost_ms: float) -> bool:
        """Whether work predicted at `cost_ms` still fits this batch's deadline after the
        time spent so far and the learnt margin (always without a deadline)."""
        deadline, margin = self.budget_ms(len(step.x))
        return math.isnan(deadline) or self.elapsed_ms() + cost_ms + margin <= deadline

    def predicted_step_ms(self) -> float:
        """An adapted step's predicted cost (ms): the most of the last measured ones,
        else ADAPT_FACTOR forward-only steps (0 before any batch)."""
        if self.adapt_seen:
            return max(self.adapt_seen)
        return ADAPT_FACTOR * self.predicted_serve_ms()

    def predicted_serve_ms(self) -> float:
        """A forward-only step's predicted cost with its detection (ms): the most of the
        last measured steps less their detection + the median detection cost (NaN before
        any batch: no prediction, and no margin learnt from it)."""
        if not self.plain_seen:
            return math.nan
        detect = sorted(self.detect_seen)[len(self.detect_seen) // 2] \
            if self.detect_seen else 0.0
        return max(self.plain_seen) + detect

    def detection_fits(self, step: Step) -> bool:
        """Whether this batch's deadline has room for a forward with detection (a batch
        without: served by the active state, its detection skipped, `undetected`); yes
        before any step was measured (the stream's first batch finds its domain)."""
        if not self.plain_seen or self.fits(step, self.predicted_serve_ms()):
            return True
        self.undetected += 1
        step.stats["undetected"] = True
        return False

    def forward_and_adapt(self, x: Tensor) -> StepResult:
        """The base loop, timed whole on `clock`: the step costs and the deadline margin."""
        self._t0, self._predicted = self.clock(), math.nan
        res = super().forward_and_adapt(x)
        total = (self.clock() - self._t0) * 1e3
        if not math.isnan(self._predicted):
            self.fixed.update_total(self._predicted, total, res.times.forward_ms)
        self._measured(res, total)
        return res

    def _measured(self, res: StepResult, total_ms: float) -> None:
        """Fold a finished step's cost into the predictions (extension)."""
        if res.adapted:
            self.adapt_seen.append(total_ms)
        elif not res.stats.get("refreshed"):
            detect = float(res.stats.get("detect_ms", 0.0))
            self.plain_seen.append(max(total_ms - detect, 0.0))
            if res.stats.get("detected", True):
                self.detect_seen.append(detect)

    def warm_up(self, x: Tensor) -> None:
        """Measure an adapted step on `x` (noise; twice, the first pays one-time set-up)
        for the deadline's first prediction; weights, statistics, optimizer, detector and
        gate are left as they were."""
        if self.optimizer is None:
            return
        state = copy.deepcopy(self.model.state_dict())
        opt = copy.deepcopy(self.optimizer.state_dict())
        ms = 0.0
        for _ in range(2):
            t0 = self.clock()
            with self._quiet(), torch.enable_grad():
                loss = self.loss(self.model(x))
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                with torch.no_grad():
                    self.model(x)
            ms = (self.clock() - t0) * 1e3
        self.model.load_state_dict(state)
        self.optimizer.load_state_dict(opt)
        self.optimizer.zero_grad(set_to_none=True)
        self.adapt_seen.append(ms)

    # ------------------------------------------------------------------ one batch
    def forward(self, step: Step) -> None:
        """The forward that also embeds the batch and recognises its domain (the switch
        may swap the banked state in); recorded only when the gate wants a backward and
        the adapted step fits the deadline (else `deferred`). A batch whose deadline has
        no room for the detection either is served by a plain forward (`undetected`): the
        active state as it is, nothing moved (no detection, no robust-BN statistics update:
        a batch without room serves only, so it costs no more than a frozen model's)."""
        if not self.detection_fits(step):  # served by the active state, nothing owed runs
            self.switch.skip()
            self._predicted = max(self.plain_seen, default=math.nan)
            if self.gate.wants_backward():
                step.stats["deferred"] = True
                self.deferred += 1
            with torch.no_grad(), self._quiet():
                step.logits = self.model(step.x)
            return
        self._predicted = self.predicted_serve_ms()
        grad = self.optimizer is not None and self.gate.wants_backward()
        if grad:
            cost = self.predicted_step_ms()
            if not self.fits(step, cost):
                grad = False
                step.stats["deferred"] = True
                self.deferred += 1
            else:
                self._predicted = cost
        owed = self.gate.skipped
        self.switch.begin()
        with torch.set_grad_enabled(grad):
            step.logits = self.model(step.x)
        self.switch.take()  # RuntimeError if the embedding layers did not run
        self.skipped += self.gate.skipped - owed
        if grad and self.gate.wants_backward():  # a switch may have made it stable
            step.loss = self.loss(step.logits)
            step.stats["reason"] = self.gate.reason
        elif grad:
            self._predicted = self.predicted_serve_ms()

    def update(self, step: Step) -> None:
        super().update(step)
        if step.adapted:
            self.backward_passes += 1

    def post(self, step: Step) -> None:
        """The gate's record, memory bank admission and the Eq. 15 refresh, their inputs
        read from the device in one transfer (with the loss when the forward's logits are
        the prediction: no reforward)."""
        logits = step.logits.detach()
        logp = torch.log_softmax(logits.float(), dim=1)
        entropy = -(logp.exp() * logp).sum(1).mean()  # as mean_entropy and entropy_loss
        pieces = [entropy.reshape(1).double()]
        served = not (self.config.reforward and step.adapted)
        if served and step.loss is not None:
            pieces.append(step.loss.detach().reshape(1).double())
        admit = self.memory is not None and (self._refresh_owed or not self.shift_policy)
        if admit:
            pred, unc = self.memory.labels(logits)
            pieces += [pred.double(), unc.double()]
        values = torch.cat(pieces).tolist()
        self.gate.record(values[0], step.adapted)
        loss = values[1] if served and step.loss is not None else math.nan
        if served:  # the prediction is the forward's: step_result reads nothing more
            step.loss_value, step.entropy_value = loss, values[0]
        if admit:  # gate 'shift': only while the Eq. 15 refresh is owed
            n = len(step.x)
            rest = values[len(values) - 2 * n:]
            self._remember(step, [int(c) for c in rest[:n]], rest[n:])

    def predict(self, step: Step) -> None:
        with self._quiet():
            super().predict(step)

    def step_result(self, step: Step) -> StepResult:
        res = super().step_result(step)
        res.domain = self.detector.current_name
        res.stats = {**self.switch.stats(step.adapted), **res.stats}
        res.stats.setdefault("reason", "")
        res.stats.setdefault("deferred", False)
        return res

    def _remember(self, step: Step, pred: list[int], uncertainty: list[float]) -> None:
        """Memory bank admission (the batch's predicted classes and uncertainties, read)
        and the Eq. 15 refresh (bn_mode 'bank'): gate 'shift', once per perceived shift when
        the memory is half full and the refresh fits the deadline (the refresh before the
        reforward's: reforward_ms is this batch's forward again); gate 'stable', every
        refresh_every adapted batches."""
        if self.memory is None:
            return
        self.memory.admit(step.x.detach(), pred, uncertainty)
        self._since_refresh += 1
        if len(self.memory) < self.memory.capacity // 2:
            return
        if self.shift_policy:
            if not self._refresh_owed:
                return
            per_sample = step.phases.ms["forward"] / max(len(step.x), 1)
            cost = max(self.refresh_seen, default=per_sample * len(self.memory))
            if step.adapted and self.config.reforward:
                cost += step.phases.ms["forward"]
            if not self.fits(step, cost):
                step.stats["refresh_deferred"] = True
                return
        elif not step.adapted or self._since_refresh < self.config.refresh_every:
            return
        t0 = self.clock()
        xs = self.memory.samples()
        with self._quiet(), torch.no_grad(), refreshing(self._upper, self.config.refresh_momentum):
            self.model(xs)
        self.refresh_seen.append((self.clock() - t0) * 1e3)
        step.stats["refreshed"] = True
        self._since_refresh, self._refresh_owed = 0, False

    def reset_state(self) -> None:
        self._fresh()

    def close(self) -> None:
        """Remove the embedding and robust-BN hooks."""
        super().close()
        self.switch.close()
        if self._rbn is not None:
            self._rbn.close()

    # ------------------------------------------------------------------ persistence
    def _expect(self) -> dict:
        """Metadata a bank file must match to be loaded into this model."""
        return {"fingerprint": self.fingerprint,
                "adapted": {k: list(v.shape) for k, v in self._live.items()},
                "embedding": {"keys": self.embedder.keys, "dim": self.embedder.dim,
                              "per_sample": self.config.per_sample},
                "bn_mode": self.config.bn_mode}

    def save_bank(self, path: str | Path) -> None:
        """Write detector statistics, every domain's state and the gate records."""
        self.finish()
        self.bank.store_active()
        det_t, det_m = self.detector.state()
        tensors = {f"detector/{k}": v for k, v in det_t.items()}
        for name in self.bank.names:
            for k, v in self.bank.get(name).items():
                tensors[f"state/{name}/{k}"] = v
        meta = {**self._expect(), "detector": det_m, "domains": self.bank.names,
                "gates": {n: g.to_json() for n, g in self.gate.domains.items()},
                "arch": type(self.model).__name__, "backward_passes": self.backward_passes}
        save_bank(path, tensors, meta)

    def load_bank(self, path: str | Path) -> None:
        """Replace the bank by a file's; InputError (one line) when it does not fit. The
        saved active domain becomes live."""
        tensors, meta = load_bank(path, self._expect())
        try:
            det = DomainDetector(self.embedder.dim, self.detector.config)
            det.load_state({k[9:]: v for k, v in tensors.items() if k.startswith("detector/")},
                           meta["detector"])
            if sorted(meta["domains"]) != sorted(det.names):
                raise ValueError(f"banked states {meta['domains']} do not match the "
                                 f"detector's domains {det.names}")
            bank = StateBank(self._live, self.config.max_domains, source=self._source)
            for name in meta["domains"]:
                bank.load(name, {k: tensors[f"state/{name}/{k}"] for k in self._live})
            gates = {n: DomainGate.from_json(g) for n, g in meta["gates"].items()}
        except KeyError as exc:
            raise InputError(f"domain bank {path}: missing entry {exc}") from None
        except (ValueError, TypeError) as exc:
            raise InputError(f"domain bank {path}: {one_line(exc)}") from None
        self._fresh()
        self.switch.detector, self.switch.bank, self.gate.domains = det, bank, gates
        if det.current_name:
            self.bank.activate(det.current_name)
            self.gate.switch(det.current_name)
        else:  # nothing active yet: the live tensors go back to the source state
            with torch.no_grad():
                for k, t in self._live.items():
                    t.copy_(self._source[k])

# ---------------------------------------------------------------------- the paper's online phase
# The method `darda` builds PaperDarda when `config.bundle_path` is set (`build_darda`,
# below); the registry name stays "darda". Phases of one batch: forward = signature, then
# inside the forward (the first BN layer's pre-hook, before any sub-network tensor is
# read) shift detection and bootstrapping (Eq. 10), the forward-only prediction and the
# memory bank admission (Algorithm 1); backward = the one adaptation after a shift (Eq. 15
# + Eq. 16) when its trigger fires; reforward = the updated model's prediction of that
# batch. All BN layers normalise with the sub-network's running statistics (eval mode);
# the BN affine and the final dense layer are adapted. The machinery is
# tta_core.darda.paper.


class PaperDarda(Darda):
    """DARDA from an offline bundle (see the module docstring).

    Shift: the signature's cosine rule (`shift_cos`) or the shift test (ShiftTest on the
    state-independent embedding: input moments, corruption residual, the first BN layer's
    input; read by hooks in the same forward).

    Deadline (DeadlineConfig fields, as AdaShadow's; `set_deadline`, `set_speed`,
    `set_lateness`): the one adaptation after a shift cannot be split, so it runs on the
    first batch whose slack holds it: time spent so far + its predicted cost (the most of
    its last ADAPT_WINDOW measured costs, calibrated at build) + the reforward (this
    batch's forward) + the margin FixedCosts learnt from the scatter of whole batches
    around their prediction <= what is left of the deadline. Until then it is deferred
    (the batch is served forward-only); a shift before it ran skips it (`skipped`).
    Capabilities (tta_core.api): DeadlineTunable, WarmsUp."""

    def __init__(self, model: nn.Module, config: DardaConfig | None = None) -> None:
        """With `bank_path`: the corruptions learnt by the extension are loaded from it
        (a bad file: warning, none learnt)."""
        TTAMethod.__init__(self, model, config)
        self.bank_error = ""
        path = self.config.bank_path
        if path:
            clean_stale_temps(path)
        if path and Path(path).is_file():
            try:
                self.load_bank(path)
            except InputError as exc:
                self.bank_error = str(exc)
                log.warning("%s; starting with no learnt corruption", exc)

    def configure_model(self) -> None:
        c = self.config
        if len(c.input_shape) != 3:
            raise ValueError(f"darda needs input_shape, one sample (C, H, W), got "
                             f"{tuple(c.input_shape)}")
        DeadlineConfig.validate(c)
        self.model.eval().requires_grad_(False)
        self._bundle_expect = bundle_expect(self.model)
        off = load_bundle(c.bundle_path, self.model)
        if tuple(off.noise.shape[1:]) != tuple(c.input_shape):
            raise ValueError(f"darda bundle {c.bundle_path}: noise of shape "
                             f"{tuple(off.noise.shape[1:])}, the model takes "
                             f"{tuple(c.input_shape)}")
        self.paper = PaperOnline(self.model, off, PaperConfig(
            variant=c.variant, shift_cos=c.shift_cos, phi_thresh=c.phi_thresh,
            max_wait=c.max_wait, min_bank=c.min_bank, context_momentum=c.context_momentum,
            lr=c.paper_lr, steps=c.paper_steps, source_guard=c.paper_source_guard,
            memory_capacity=c.memory_capacity, learn_domains=c.learn_domains,
            novelty_cos=c.novelty_cos, max_domains=c.max_domains, shift=c.shift_config()))
        for p in self.paper.params:
            p.requires_grad_(True)
        # the shift test's embedding: read in the first BN layer's pre-hook, where the
        # shift is decided and a sub-network swapped in before any of its tensors is used
        self.embedder = DomainEmbedder(self.model, c.input_shape,
                                       EmbeddingConfig(1, True, c.per_sample, True),
                                       on_ready=self._on_embedding)
        self.embedder.enabled = False
        self._c: Tensor | None = None
        self._switched: bool | None = None
        self._observe_ms = 0.0
        self.backward_passes = 0
        self._deadline_state()
        if c.has_deadline:
            self._calibrate()

    def _calibrate(self) -> None:
        """Time the adaptation on noise (twice: the first pays one-time set-up)."""
        self.paper.calibrate()
        self.adapt_seen.append(self.paper.calibrate())

    def warm_up(self, x: Tensor) -> None:
        """Time the adaptation afresh (the process is warm now): its first prediction."""
        self.adapt_seen.clear()
        self._calibrate()

    # ------------------------------------------------------------ DeadlineTunable
    def set_deadline(self, **settings: object) -> None:
        """New deadline settings (DeadlineConfig fields) from the next batch on; ValueError
        naming a bad one (nothing is changed then)."""
        apply_settings(self.config, settings)
        if self.config.has_deadline and not self.adapt_seen:
            self._calibrate()

    def predicted_adapt_ms(self, forward_ms: float) -> float:
        """The one adaptation's predicted cost with its reforward (ms)."""
        return max(self.adapt_seen, default=0.0) + forward_ms

    def collect_params(self) -> list[nn.Parameter]:
        """None for the base optimizer: the one step uses PaperOnline's own SGD."""
        return []

    def current_domain(self) -> str:
        """The sub-network (training corruption) or learnt domain in use."""
        return self.paper.domain

    def forward(self, step: Step) -> None:
        """Signature, then the forward in which the shift is decided (`_on_embedding`), the
        memory bank admission while an adaptation is owed. A batch whose deadline has no
        room for the detection is served by a plain forward of the current sub-network
        (`undetected`; the owed adaptation waits)."""
        step.stats["switched"] = step.stats["shift"] = False
        if not self.detection_fits(step):
            self._predicted = max(self.plain_seen, default=math.nan)
            if self.paper.pending:
                step.stats["deferred"] = True
                self.deferred += 1
            with torch.no_grad():
                step.logits = self.model(step.x)
            step.stats["plain"] = True
            return
        t0 = self.clock()
        self._predicted = self.predicted_serve_ms()
        proj, self._c = self.paper.signature(step.x)
        owed, self._switched = self.paper.pending, None
        t1 = self.clock()
        self.embedder.enabled = True
        try:
            with torch.no_grad():
                step.logits = self.model(step.x)
        finally:
            self.embedder.enabled = False
        if self._switched is None:
            raise RuntimeError("the shift test's embedding layer did not run in the forward")
        t2 = self.clock()
        step.stats["switched"] = step.stats["shift"] = self._switched
        self.skipped += int(owed and self._switched)  # its adaptation never ran
        if self.paper.pending:  # Algorithm 1's bank feeds the owed adaptation only
            # the mean entropy a forward-only batch reports, read with the admission's
            # inputs (an adapted batch's reforward drops it: update)
            entropy = losses.entropy_loss(step.logits.detach())
            step.entropy_value = self.paper.remember(step.x, step.logits, proj,
                                                     entropy.reshape(1))[0]
        # the detection's cost: the signature, the hooks' moments and the shift decision,
        # the admission (the forward itself is what a plain batch costs)
        step.stats["detect_ms"] = ((t1 - t0) + (self.clock() - t2)) * 1e3 + \
            self.embedder.take_ms() + self._observe_ms

    def _on_embedding(self, vec: Tensor, within: Tensor | None) -> None:
        """Inside the batch's forward, before the first BN layer: shift and bootstrap."""
        t0 = self.clock()
        self.embedder.enabled = False
        assert self._c is not None
        self._switched = self.paper.observe(self._c, vec, within)
        self._observe_ms = (self.clock() - t0) * 1e3

    def _measured(self, res: StepResult, total_ms: float) -> None:
        """The forward-only steps' costs (the adaptation's is measured in `update`)."""
        if res.adapted:
            return
        detect = float(res.stats.get("detect_ms", 0.0))
        self.plain_seen.append(max(total_ms - detect, 0.0))
        if not res.stats.get("plain"):
            self.detect_seen.append(detect)

    def update(self, step: Step) -> None:
        """The one adaptation after a shift when its trigger fires, unless it would miss
        the deadline (class docstring: deferred to a later batch); none on a batch served
        plain."""
        if step.stats.get("plain"):
            return
        t0 = self.clock()
        forward_ms = step.phases.ms["forward"]
        if self.paper.pending and not self.fits(step, self.predicted_adapt_ms(forward_ms)):
            step.stats["deferred"] = True
            self.deferred += 1
            return
        if self.paper.ready():
            self._predicted = (t0 - self._t0) * 1e3 + self.predicted_adapt_ms(forward_ms)
            step.stats["refreshed"] = True
            reason = NEW_DOMAIN if self.paper.novel else SHIFT
            step.adapted = self.paper.adapt()
            if step.adapted:
                step.stats["reason"] = reason
            self.backward_passes = self.paper.backward_passes
            self.adapt_seen.append((self.clock() - t0) * 1e3)
            with torch.no_grad():
                step.out = self.model(step.x)
            step.entropy_value = math.nan  # of the forward's logits, not the reforward's

    def post(self, step: Step) -> None:
        """Nothing: the memory bank took the batch in the forward."""

    def predict(self, step: Step) -> None:
        if step.out is None:
            step.out = step.logits

    def step_result(self, step: Step) -> StepResult:
        res = TTAMethod.step_result(self, step)  # not Darda's: no online detector here
        res.domain = self.paper.domain
        res.stats.update({"backward": step.adapted, "shifts": self.paper.shifts,
                          "memory": len(self.paper.memory),
                          "learnt": len(self.paper.learnt), "deferrals": self.deferred,
                          "skipped": self.skipped, "shift_score": self.paper.shift_score,
                          "kept_source": self.paper.kept_source})
        res.stats.setdefault("reason", "")
        return res

    def units_updated(self, step: Step) -> int:
        return len(self.paper.params) if step.adapted else 0

    def reset_state(self) -> None:
        self.paper.fresh()
        self.backward_passes = self.deferred = self.skipped = 0

    def close(self) -> None:
        """Remove the shift test's embedding hooks."""
        self.embedder.close()

    def save_bank(self, path: str | Path) -> None:
        """Write the corruptions the extension learnt (signature + adapted state each)."""
        tensors = {}
        for name, d in self.paper.learnt.items():
            tensors[f"learnt/{name}/signature"] = d.signature
            tensors.update({f"learnt/{name}/state/{k}": v for k, v in d.state.items()})
        meta = {**self._bundle_expect, "kind": "paper", "learnt": list(self.paper.learnt),
                "next_id": self.paper.next_id, "dim": int(self.paper.centroids.shape[1])}
        save_bank(path, tensors, meta)

    def load_bank(self, path: str | Path) -> None:
        """Replace the learnt corruptions by a file's; InputError (one line) when it does
        not fit this model or bundle."""
        expect = {**self._bundle_expect, "kind": "paper",
                  "dim": int(self.paper.centroids.shape[1])}
        tensors, meta = load_bank(path, expect)
        try:
            learnt = {n: Learnt(tensors[f"learnt/{n}/signature"],
                                {k: tensors[f"learnt/{n}/state/{k}"] for k in self.paper.live})
                      for n in meta["learnt"]}
            next_id = int(meta["next_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"domain bank {path}: missing or bad entry {exc}") from None
        self.paper.fresh()
        self.paper.learnt.update(learnt)
        self.paper.next_id = next_id


@register_factory("darda", Darda)
def build_darda(model: nn.Module, config: DardaConfig | None = None) -> Darda:
    """The method `darda` on `model`: the paper's online phase from an offline bundle
    (PaperDarda) when `config.bundle_path` is set, else the online-learnt domain bank
    (Darda). One config (DardaConfig) for both."""
    c = config if config is not None else DardaConfig()
    return PaperDarda(model, c) if c.bundle_path else Darda(model, c)
