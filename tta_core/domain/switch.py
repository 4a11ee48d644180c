"""The domain machinery one method needs: embedding hooks, detector, state bank, gate.

Below the paper rooms because two of them use it: the darda method and adashadow's
`domain_bank` option (a domain bank under AdaShadow's sparse update). The embedding is
read inside the forward; in the pre-hook of the last embedded layer (before any banked
layer runs) the detector assigns the batch to a known domain or a new one and, on a
switch, the bank copies that domain's state into the live tensors (O(state size)), so the
batch is already predicted by the recognised state. `on_switch(detection)` lets the
method reset what is not banked (optimizer momentum, a memory bank). A new domain starts
from the nearest known domain's state (`init_from="nearest"`) or the source state.

With a shift test (`SwitchConfig.shift`, tta_core.domain.detector.ShiftTest; darda's
default) the stream is also tested for a change inside the active domain: a shift between
two corruptions the table merges is perceived (the gate owes it its passes,
`on_switch(None)` resets the method). A batch *perceives a shift* (`stats["shift"]`) when
the detector switched domain or the test confirmed a shift, unless one was perceived fewer
than `confirm` batches before (the detector's hysteresis and the test's confirmation may
take the same shift on consecutive batches); a domain switch restarts the test's segment.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from tta_core.api import PhaseTimes, StepResult, mean_entropy
from tta_core.domain.bank import SOURCE, StateBank, adapted_tensors
from tta_core.domain.detector import (
    Detection,
    DetectorConfig,
    DomainDetector,
    ShiftConfig,
    ShiftDecision,
    ShiftTest,
)
from tta_core.domain.embedding import (
    RESIDUAL_FEATURES,
    RESIDUAL_SCALES,
    DomainEmbedder,
    EmbeddingConfig,
)
from tta_core.domain.gate import AdaptGate, GateConfig


@dataclass
class SwitchConfig:
    """What DomainSwitch builds (the darda / adashadow config fields feed it)."""

    detector: DetectorConfig
    gate: GateConfig
    init_from: str = "nearest"  # state of a new domain: "nearest" known one, or "source"
    shift: ShiftConfig | None = None  # the shift test inside a domain (None: none)

    def validate(self) -> None:
        """ValueError naming a bad field."""
        if self.init_from not in ("nearest", SOURCE):
            raise ValueError(f"init_from {self.init_from!r} not in ('nearest', 'source')")
        self.detector.validate()
        if self.shift is not None:
            self.shift.validate()


def embedder_for(model: nn.Module, input_shape: Sequence[int],
                 config: EmbeddingConfig) -> DomainEmbedder:
    """The embedding hooks a DomainSwitch will drive (its layer names tell the caller
    which BN layers the embedding passes through, before the banked tensors are chosen)."""
    return DomainEmbedder(model, input_shape, config)


def shift_dims(model: nn.Module, embedder: DomainEmbedder, channels: int,
               layers: int = 1) -> int:
    """Leading dimensions of `embedder`'s embedding that the shift test reads: the input's
    moments, the corruption residual, the learnt encoder (those it has) and the first
    `layers` BN inputs (the first one's input, conv1's output, is state-independent in both
    darda variants; measured in benchmarks/domains/bench_darda_realtime.py); `channels`: the
    input's."""
    c, c_in = embedder.config, int(channels)
    dims = (2 * c_in if c.include_input else 0) + \
        (RESIDUAL_SCALES * RESIDUAL_FEATURES * c_in if c.residual else 0) + \
        (embedder.encoder.config.dim if embedder.encoder is not None else 0)
    modules = dict(model.named_modules())
    return dims + sum(2 * int(modules[n].num_features) for n in embedder.layer_names[:layers])


class DomainSwitch:
    """Detect the domain of each batch inside the forward and swap the banked state."""

    def __init__(self, embedder: DomainEmbedder, live: dict[str, Tensor],
                 config: SwitchConfig, source: dict[str, Tensor] | None = None,
                 on_switch: Callable[[Detection | None], None] | None = None) -> None:
        """`embedder`: hooks on the model (`embedder_for` builds one; its `on_ready` is
        taken over); `live`: the tensors banked per domain (bank.adapted_tensors);
        `source`: their source values (default: a copy of the live values now)."""
        config.validate()
        self.config, self.on_switch = config, on_switch
        self.embedder = embedder
        embedder.on_ready = self._on_embedding
        self.live = live
        self.source = {k: (v if source is None else source[k]).detach().clone()
                       for k, v in live.items()}
        self.fresh()

    def fresh(self) -> None:
        """Forget every domain: empty detector, bank and gate records."""
        c = self.config
        self.detector = DomainDetector(self.embedder.dim, c.detector)
        self.bank = StateBank(self.live, c.detector.max_domains, source=self.source)
        self.gate = AdaptGate(c.gate)
        self.shift_test = ShiftTest(c.shift) if c.shift is not None else None
        self.last: Detection | None = None
        self.last_shift: ShiftDecision | None = None
        self.perceived = False  # the last batch perceived a shift
        self.undetected = False  # the last batch was served without detection (skip)
        self.perceived_total = 0
        self._since_shift = 1 << 30  # batches since the last perceived shift
        self.detect_ms = 0.0

    @property
    def current(self) -> str:
        """The active domain's name ('' before the first batch)."""
        return self.detector.current_name

    def begin(self) -> None:
        """Before a batch's forward: clear the last detection and the timers, arm the
        embedding for that forward (and no other: an adapter's reforward from a cached
        stage input runs only the later hooks)."""
        self.last, self.last_shift, self.perceived, self.detect_ms = None, None, False, 0.0
        self.undetected = False
        self.embedder.take_ms()
        self.embedder.enabled = True

    def skip(self) -> None:
        """Before a batch's forward: serve it without detection (its deadline has no room
        for it): the embedding is off, the active domain's state serves it."""
        self.last, self.last_shift, self.perceived, self.detect_ms = None, None, False, 0.0
        self.undetected = True
        self.embedder.enabled = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside the block are not the batch's (a memory profile running stages
        one by one): the embedding ignores them."""
        was, self.embedder.enabled = self.embedder.enabled, False
        try:
            yield
        finally:
            self.embedder.enabled = was

    def take(self) -> Detection:
        """The detection of the forward since `begin`; RuntimeError if none ran."""
        if self.last is None:
            raise RuntimeError("the domain embedding layers did not run in the forward")
        return self.last

    def _on_embedding(self, vec: Tensor, within: Tensor | None) -> None:
        """Inside the forward, before the banked layers: detect, swap on a switch."""
        t0 = time.perf_counter()
        self.embedder.enabled = False  # once per batch: not in reforwards of its tail
        det = self.detector.observe(vec, within)
        test = self.shift_test
        dec = test.observe(vec, within) if test is not None else None
        if det.evicted:
            if det.evicted in self.bank.states:
                self.bank.drop(det.evicted)
            self.gate.forget(det.evicted)
        gap = self.config.shift.confirm if self.config.shift is not None else 1
        recent = self._since_shift + 1 < gap  # a shift perceived within the merge window
        if det.switched:
            near = det.nearest if self.config.init_from == "nearest" else ""
            self.bank.activate(det.domain, near if near in self.bank.states else SOURCE)
            self.gate.switch(det.domain, det.created)
            if self.on_switch is not None:
                self.on_switch(det)
            if test is not None and dec is not None and not dec.shift and not recent:
                test.restart()  # (the test's own shift just before started this segment)
        elif dec is not None and dec.shift:
            self.gate.shift()
            if self.on_switch is not None:
                self.on_switch(None)
        self._since_shift += 1
        if det.switched or (dec is not None and dec.shift):
            self.perceived = not recent or self.detector.batches == 1
            self.perceived_total += self.perceived
            self._since_shift = 0
        self.last, self.last_shift = det, dec
        self.detect_ms += (time.perf_counter() - t0) * 1e3 + self.embedder.take_ms()

    def stats(self, backward: bool) -> dict:
        """StepResult.stats of the last batch (moments + detection + swap in detect_ms)."""
        if self.undetected:
            return {"backward": backward, "switched": False, "novel": False,
                    "created": False, "detect_ms": 0.0, "domains": len(self.detector.names),
                    "stable": not self.gate.wants_backward(), "shift": False,
                    "detected": False}
        det = self.take()
        out = {"backward": backward, "switched": det.switched, "novel": det.novel,
               "created": det.created, "distance": det.distance,
               "nearest_distance": det.nearest_distance, "threshold": det.threshold,
               "detect_ms": self.detect_ms, "domains": len(self.detector.names),
               "stable": not self.gate.wants_backward(), "shift": self.perceived,
               "detected": True}
        if self.last_shift is not None:
            out["shift_score"] = self.last_shift.score
        return out

    def close(self) -> None:
        """Remove the embedding hooks."""
        self.embedder.close()


def bank_switch(model: nn.Module, input_shape: Sequence[int], optimizer: Optimizer,
                config: SwitchConfig | None = None, embed_layers: int = 3) -> DomainSwitch:
    """A domain bank for an adapter that updates BatchNorm affine only (adashadow's
    `domain_bank`), set up as darda's: the embedding reads the input, its corruption
    residual and the first `embed_layers` BN inputs; the other BN layers' affine and
    running statistics and the classifier are banked. The caller must keep the embedded
    BN layers (`switch.embedder.layer_names`) frozen: they run before the swap (which is
    in the last one's pre-hook) and feed the embedding. With only the stem conv's output
    (embed_layers 1, nothing to freeze) corruptions split into several domains each (fog
    and contrast first). SGD momentum is reset on a switch (not banked)."""
    embedder = embedder_for(model, input_shape, EmbeddingConfig(layers=embed_layers))
    embedded = set(embedder.layer_names)
    cfg = config if config is not None else SwitchConfig(DetectorConfig(), GateConfig())
    return DomainSwitch(embedder, adapted_tensors(model, skip=embedded.__contains__), cfg,
                        on_switch=lambda _det: optimizer.state.clear())


def gated_step(switch: DomainSwitch, model: nn.Module, x: Tensor,
               adapt: Callable[[], StepResult]) -> StepResult:
    """One batch through `switch`: `adapt()` (the adapter's own step, whose forward runs
    the detection and swap) while the active domain is not stable, else a no-grad forward
    (served by the banked state). The result carries the domain and the switch's stats."""
    switch.begin()
    if switch.gate.wants_backward():
        res = adapt()
    else:
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = model(x)
        ms = (time.perf_counter() - t0) * 1e3
        res = StepResult(logits.detach(), PhaseTimes(forward_ms=ms, total_ms=ms),
                         mean_entropy=mean_entropy(logits))
    switch.take()
    switch.gate.record(res.mean_entropy, res.adapted)
    res.domain = switch.current
    res.stats.update(switch.stats(res.adapted))
    return res
