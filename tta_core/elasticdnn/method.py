"""ElasticDNN serving: a gated master served whole or as a smaller surrogate, whichever fits
the batch's deadline, adapted filter by filter.

Zhang et al. (ElasticDNN, IEEE TC 2024, seed 001): a master network with channel gates
(tta_core.elasticdnn.gates, made by `tta train-elastic`) is cut into dense surrogates keeping a
share of the filters of every gated conv, chosen for the current domain from one sample
(tta_core.elasticdnn.surrogate). This method serves every batch with the largest size whose
predicted forward fits what is left of the batch's deadline (tta_core.elasticdnn.serving: the
deadline modes are AdaShadow's, DeadlineConfig), the full master when it fits and back up
as soon as a larger size fits again; a fleet scheduler may pin a size instead
(`set_size`, api.Resizable). When the forward and an update fit (always without a deadline)
the served network adapts: only the filters holding `mass` of the BN-gradient score of
SHOT's information-maximisation loss train (tta_core.elasticdnn.filter_update); the
prediction is that forward's (no reforward). No smaller size is served to make room for
an update: on the shipped stream updates did not raise accuracy (README, elastic section).

Re-derivation: the surrogates are cut again from the master, after the ones that adapted
updated it (`master_update`: the paper's Eqs. 3-4 through the domain knowledge Θ*, by
default; the averaging of the authors' group's code; or none), when the
served batches' mean entropy jumps (`entropy_jump` nats, per size: a new domain, the
paper's trigger) or every `rederive_every` batches (a domain that drifts without a jump,
and the master's own updates reach the surrogates). It runs after the batch's answer, only
when its predicted time still fits the deadline, or regardless once 2 x `rederive_every`
batches have passed since the last cut (one late batch then, rather than surrogates that
never follow the domain).
The representative sample is the batch's highest-entropy sample under the served network
(the paper: under the master; the same when the master serves, and no extra master
forward when it does not fit). Filter masks are chosen on the first batch each size
adapts on after a derivation (one probe, its cost budgeted like an update's).

Warm-up (`warm_up`, before the first frame): the surrogates are cut from the warm-up batch
(noise, in a node and in `tta bench`) and kept, every size's forward and update and the
batch's fixed cost are timed, and the weights are put back; the first real batch then pays
for nothing but itself. Which sample the filters are cut from barely matters for the trained
gates: on the shipped stream (small net, no update) a cut on noise, on the first real batch
and on every domain's first batch serve within noise of each other at every size. So a
re-cut that nothing adapted before (no write-back, the master unchanged) is not worth a late
batch: it runs only when it fits; the overdue rule forces only a re-cut that writes back.

Size 1.0 is the master itself (its gates evaluated per sample at sparsity 0): it adapts
in place, filter by filter like the surrogates, and needs no write-back. With
`master_in_place` False every size, 1.0 too, is a surrogate cut from the master (at 1.0
every filter kept, the gates fixed at the sample's values), and the master changes only
through the surrogates' write-back (the paper's serving path: Eqs. 3-4 through Θ*).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from tta_core.api import PhaseClock, StepResult, mean_entropy
from tta_core.elasticdnn.filter_update import (
    MASTER_UPDATES,
    check_master_update,
    filter_optimizer,
    filter_scores,
    im_loss,
    mask_gradients,
    select_filters,
    write_back,
)
from tta_core.elasticdnn.gates import GatedModel, load_gated
from tta_core.elasticdnn.knowledge import absorb, require_knowledge
from tta_core.elasticdnn.serving import (
    DEFAULT_SIZES,
    Decision,
    EntropyWatch,
    ServingPlan,
    check_sizes,
)
from tta_core.elasticdnn.surrogate import Surrogate, extract_surrogate, highest_entropy_sample
from tta_core.model.norms import set_bn_mode
from tta_core.registry import register_factory
from tta_core.runtime.deadline import DeadlineConfig, apply_settings
from tta_core.runtime.fixed_costs import MARGIN_WARMUP
from tta_core.runtime.method import MethodConfig, TTAMethod
from tta_core.runtime.options import option
from tta_core.runtime.phases import Phases

REP_ALPHA = 0.1  # EMA weight of the newest batch in the domain representation


@dataclass
class ElasticConfig(MethodConfig, DeadlineConfig):
    """Elastic serving settings: the sizes served, the filter-update mass, when surrogates
    are re-derived, the time predictor's EMA weight; the deadline fields (DeadlineConfig,
    "sigma": no deadline, the master serves and adapts every batch)."""

    sizes: tuple[float, ...] = option(DEFAULT_SIZES, "sizes served: shares of filters kept "
                                      "per gated conv, each in (0, 1]; 1.0: the master",
                                      low=0.0, high=1.0)
    # api.Resizable.set_size: a fleet scheduler pins the size through it at run time
    keep: float | None = option(None, "serve this size (one of sizes); None: the largest "
                                "whose predicted forward fits the deadline", low=0.0,
                                high=1.0)
    mass: float = option(0.8, "filters trained: the fewest holding this share of the "
                         "score; in (0, 1]", low=0.0, high=1.0)
    adapt: bool = option(True, "adapt the served network (False: serve only)")
    master_update: str = option("knowledge", "how an adapted surrogate updates the master "
                                "at a re-cut: knowledge (the paper's Eqs. 3-4 through "
                                "Θ*), averaging (master += change / 2), none",
                                choices=MASTER_UPDATES)
    master_card: str = option("", "gated master card (`tta train-elastic`, `tta prepare`) "
                              "served instead of the model given (a plain source: other "
                              "methods of a bench or a node run on that); '': the model "
                              "given is the master", path="read", runtime=False)
    master_in_place: bool = option(True, "size 1.0 is the gated master adapting in place "
                                   "(its drift absorbed into Θ* at a re-cut); False: a "
                                   "keep-1.0 surrogate cut like the others, the master "
                                   "changed only through write-back (the paper)")
    rederive_every: int = option(100, "re-derive the surrogates every this many batches "
                                 "(0: only on an entropy jump)", low=0)
    entropy_jump: float = option(0.3, "re-derive when the served batches' mean entropy "
                                 "(EMA) jumps by this many nats (0: off)", low=0.0)
    time_alpha: float = option(0.2, "EMA weight of the newest batch in the time "
                               "predictions; in (0, 1]", low=0.0, high=1.0)
    update_prior: float = option(4.0, "update / forward time before an update was measured "
                                 "(> 0)", low=0.0)
    retrain_steps: int = option(20, "update steps a retraining on a new domain takes (the "
                                "fleet's T per size: this many x the measured step time)",
                                low=1)
    warmup_runs: int = option(2, "forwards per size timed at a new batch size (the fastest "
                              "counts; more: steadier times on a shared machine)", low=0)
    # surrogates cut from a blank sample: a size's time does not depend on which filters
    # it keeps
    warmup_batch: int = option(4, "batch sizes 1..warmup_batch are timed when the method "
                               "is built (with input_shape); others at their first batch",
                               low=0)

    def validate(self) -> None:
        """ValueError naming the first bad value (deadline fields included)."""
        DeadlineConfig.validate(self)
        self.sizes = check_sizes(self.sizes)
        check_master_update(self.master_update)
        if not 0.0 < self.mass <= 1.0:
            raise ValueError(f"mass must be in (0, 1], got {self.mass!r}")
        if (isinstance(self.retrain_steps, bool) or not isinstance(self.retrain_steps, int)
                or self.retrain_steps < 1):
            raise ValueError(f"retrain_steps must be an integer >= 1, got "
                             f"{self.retrain_steps!r}")
        for name in ("rederive_every", "warmup_runs", "warmup_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not (math.isfinite(self.entropy_jump) and self.entropy_jump >= 0):
            raise ValueError(f"entropy_jump must be >= 0 nats, got {self.entropy_jump!r}")
        if not 0.0 < self.time_alpha <= 1.0:
            raise ValueError(f"time_alpha must be in (0, 1], got {self.time_alpha!r}")
        if not (math.isfinite(self.update_prior) and self.update_prior > 0):
            raise ValueError(f"update_prior must be > 0, got {self.update_prior!r}")
        if self.keep is not None and float(self.keep) not in self.sizes:
            raise ValueError(f"keep {self.keep!r} is not one of the sizes {self.sizes}")


@dataclass
class Served:
    """One size's network, its filter masks' hooks and optimizer once chosen, and whether
    it adapted since it was cut (then it is written back at the next derivation)."""

    surrogate: Surrogate
    masks: dict[str, Tensor] = field(default_factory=dict)  # selected filters per gated conv
    hooks: list = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    adapted: bool = False

    def release(self) -> None:
        """Remove the gradient-mask hooks (the master's stay on its own parameters)."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.optimizer = None


def master_surrogate(master: GatedModel) -> Surrogate:
    """The master as a size-1.0 'surrogate': its own (gated) base, every filter kept, so
    the filter-update functions train it in place."""
    mods = dict(master.base.named_modules())
    kept = {s.conv: torch.arange(mods[s.conv].out_channels, device=mods[s.conv].weight.device)
            for s in master.sites}
    return Surrogate(model=master.base, keep=1.0, kept=kept, sites=master.sites,
                     scale={c: torch.ones(len(i), device=i.device) for c, i in kept.items()})


class Elastic(TTAMethod):
    """Load-adaptive serving of a gated master (module doc).

    Capabilities (tta_core.api): DeadlineTunable, Resizable, Retrains."""

    config_cls = ElasticConfig
    config: ElasticConfig
    model: GatedModel

    def configure_model(self) -> None:
        if not isinstance(self.model, GatedModel):
            raise ValueError(f"elastic: {type(self.model).__name__} is not a gated master; "
                             "make one with `tta train-elastic` and pass its model card")
        self.config.validate()
        if self.config.master_update == "knowledge":
            require_knowledge(self.model, "elastic: the master")  # converts an old one
        super().configure_model()
        self.model.set_sparsity(0.0)
        cfg = self.config
        self.plan = ServingPlan(cfg, cfg.sizes, cfg.time_alpha, cfg.update_prior)
        self.plan.set_size(cfg.keep)  # pinned from the start (None: the deadline chooses)
        self.watch = EntropyWatch(jump=cfg.entropy_jump)
        self.served: dict[float, Served] = {}
        self.since_derive = 0  # batches since the surrogates were cut
        self.pending = False  # a re-derivation is due
        self.representation: Tensor | None = None  # EMA of mean penultimate features
        if len(cfg.input_shape) == 3 and cfg.warmup_batch > 0:
            self._warm_up_blank(tuple(cfg.input_shape))

    def _warm_up_blank(self, shape: tuple[int, ...]) -> None:
        """Time every size at batch sizes 1..warmup_batch on surrogates cut from a blank
        sample (the real ones are cut at the first batch), then forget those."""
        device = next(self.model.parameters()).device
        self._derive(torch.zeros((1, *shape), device=device))
        for n in range(1, self.config.warmup_batch + 1):
            self._warm_up(torch.randn((n, *shape), device=device))
        for served in self.served.values():
            served.release()
        self.served = {}

    def collect_params(self) -> list:
        return []  # every size has its own optimizer over its selected filters

    def setup_optimizer(self) -> None:
        return None

    # ------------------------------------------------------------ Resizable
    def sizes(self) -> tuple[float, ...]:
        """The sizes served, largest first (1.0: the master)."""
        return self.plan.sizes

    def set_size(self, keep: float | None) -> None:
        """Serve `keep` from the next batch on; None: the deadline's choice again."""
        self.plan.set_size(keep)
        self.config.keep = keep  # a rebuild keeps it

    def size_forward_ms(self) -> dict[float, float]:
        """Predicted forward per size at the last batch size (before any batch: the
        largest warmed-up one; empty when none was timed yet)."""
        times = self.plan.times
        n = times.last_n or max((b for _, b in times.base), default=0)
        return self.plan.forward_ms(n) if n else {}

    # ------------------------------------------------------------ Retrains
    def size_retrain_ms(self) -> dict[float, float]:
        """T per size (ms): retrain_steps x (forward + update) predicted at the last batch
        size from the update steps measured on that size (warm-up or served batches); NaN
        for a size whose update was never measured (e.g. lr 0: serve only)."""
        times, steps = self.plan.times, self.config.retrain_steps
        return {k: steps * f * (1.0 + times.update_ratio[k]) if k in times.update_ratio
                else math.nan for k, f in self.size_forward_ms().items()}

    def domain_representation(self) -> np.ndarray | None:
        """The current domain's representation (Eq. 5): EMA (weight REP_ALPHA) over served
        batches of the served network's mean penultimate feature vector (the input of its
        last Linear layer); None before the first batch."""
        r = self.representation
        return None if r is None else r.double().cpu().numpy()

    def _observe_domain(self, feats: list[Tensor]) -> None:
        if not feats:
            return
        mean = feats[-1].detach().float().flatten(1).mean(0)
        old = self.representation
        self.representation = mean if old is None or old.shape != mean.shape else (
            (1.0 - REP_ALPHA) * old + REP_ALPHA * mean)

    # ------------------------------------------------------------ DeadlineTunable
    def set_deadline(self, **settings: object) -> None:
        """New deadline settings (DeadlineConfig fields) from the next batch on; ValueError
        naming a bad one (nothing is changed then)."""
        apply_settings(self.config, settings)

    def set_speed(self, speed_mps: float | None) -> None:
        """The vehicle's speed for "speed" deadlines (None: unknown, the shortest)."""
        self.plan.set_speed(speed_mps)

    def set_lateness(self, late_ms: float) -> None:
        """The next batches start `late_ms` after their newest frame arrived."""
        self.plan.set_lateness(late_ms)

    # ------------------------------------------------------------ the batch
    def forward_and_adapt(self, x: Tensor) -> StepResult:
        """Choose the size (plan phase), serve it with or without a filter-grained update,
        re-cut the surrogates when due (plan phase). Set-up that happens once (the first
        cut, timing a new batch size) counts to the plan phase but not to what the
        serving plan learns a batch costs."""
        phases, n = Phases.for_tensor(x), int(x.shape[0])
        if not self.served:
            with phases("plan"):
                self._derive(highest_entropy_sample(self.model, x))
            self.plan.observe_rederive(phases.ms["plan"])
        with phases("plan"):
            if not self.plan.times.measured(n):
                self._warm_up(x)
        setup_ms = phases.ms["plan"]
        with phases("plan"):
            d = self.plan.decide(n, self.config.adapt and self.config.lr > 0)
            served = self.served[d.keep]
            if d.adapt and served.optimizer is None and not self.plan.room_for(
                    d, self.plan.times.update_ms(d.keep, n)):
                d = self.plan.without_update(d, n)  # no room to choose its filters first
        loss, probe_ms = math.nan, 0.0
        feats: list[Tensor] = []  # the served forward's penultimate features
        hook = _head(served.surrogate.model).register_forward_hook(
            lambda _m, inp, _o: feats.append(inp[0].detach()))
        try:
            if d.adapt:
                logits, loss, probe_ms = self._adapt(served, x, phases)
            else:
                with phases("forward"), torch.no_grad():
                    logits = served.surrogate.model(x)
        finally:
            hook.remove()
        self._observe_domain(feats)
        busy = phases.ms["forward"] + phases.ms["backward"] - probe_ms
        self.plan.observe(d, n, busy, phases.ms["plan"] - setup_ms + probe_ms + busy)
        entropy = mean_entropy(logits)
        with phases("plan"):
            rederived = self._maybe_rederive(d, x, logits, entropy)
        return StepResult(logits=logits.detach(), times=phases.times(), loss=loss,
                          mean_entropy=entropy, adapted=d.adapt, budget_ms=d.deadline_ms,
                          stats={"size": d.keep, "adapted": d.adapt, "rederived": rederived,
                                 "pinned": d.pinned, "predicted_ms": d.predicted_ms,
                                 "margin_ms": d.margin_ms})

    def _adapt(self, served: Served, x: Tensor, phases: Phases) -> tuple[Tensor, float, float]:
        """Choose the filters when this size has none yet (probe, timed as backward work),
        then one forward with gradients (the answer), the information-maximisation loss
        and a step on the selected filters. (logits, loss, probe ms)."""
        before = phases.ms["backward"]
        with phases("backward"):
            if served.optimizer is None:
                served.masks = select_filters(filter_scores(served.surrogate, x),
                                              self.config.mass)
                served.hooks = mask_gradients(served.surrogate, served.masks)
                served.optimizer = filter_optimizer(served.surrogate, self.config.lr,
                                                    self.config.momentum)
        probe_ms = phases.ms["backward"] - before
        for group in served.optimizer.param_groups:
            group["lr"] = self.effective_lr(int(x.shape[0]))
        with phases("forward"), torch.enable_grad():
            logits = served.surrogate.model(x)
            loss = im_loss(logits)
        with phases("backward"):
            served.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            served.optimizer.step()
        served.adapted = True
        self.optimizer = served.optimizer  # what a report reads the running rate from
        return logits.detach(), float(loss.detach()), probe_ms

    def effective_lr(self, batch: int) -> float:
        """lr * batch / lr_ref_batch (lr itself when lr_ref_batch is 0): every size's
        optimizer steps with it (MethodConfig)."""
        ref = self.config.lr_ref_batch
        return self.config.lr * batch / ref if ref else self.config.lr

    def warm_up(self, x: Tensor, steps: int = MARGIN_WARMUP) -> None:
        """Before the first real batch (api.WarmsUp: a node at start, a benchmark before its
        stream): cut the surrogates from x's highest-entropy sample (timed: the re-cut's
        cost), time every size on x, time `steps` updates of every size (its update
        cost) and `steps` planned batches (the margin, active from the first real batch
        with MARGIN_WARMUP of them); then put the master, the cut
        surrogates, BN statistics, masks, optimizers and entropy watch back as they were.
        The cut surrogates stay, so no real batch pays for cutting: surrogates cut on
        noise served the trained small net's stream within 0.2 points of ones cut on its
        first real batch or per domain (module doc); a re-cut follows when due and it fits."""
        master = _snapshot(self.model)
        clock = PhaseClock.for_tensor(x)
        self._derive(highest_entropy_sample(self.model, x))
        self.plan.observe_rederive(clock.mark())
        self._warm_up(x)
        cut = {k: _snapshot(s.surrogate.model) for k, s in self.served.items()}
        try:
            adapts = self.config.adapt and self.config.lr > 0
            for served in self.served.values() if adapts else ():
                for _ in range(steps):  # the update measured as a served batch's
                    phases = Phases.for_tensor(x)
                    *_, probe_ms = self._adapt(served, x, phases)
                    d = Decision(served.surrogate.keep, True, math.nan, 0.0, math.nan)
                    busy = phases.ms["forward"] + phases.ms["backward"] - probe_ms
                    self.plan.observe(d, len(x), busy, math.nan)
            for _ in range(steps):
                self.forward_and_adapt(x)
        finally:
            _put_back(self, master, cut)

    @torch.no_grad()
    def _warm_up(self, x: Tensor) -> None:
        """Time every size's forward on this batch (the fastest of warmup_runs, at least
        one): the base of its predictions at this batch size."""
        clock = PhaseClock.for_tensor(x)
        for keep, served in self.served.items():
            best = math.inf
            for _ in range(max(self.config.warmup_runs, 1)):
                clock.mark()
                served.surrogate.model(x)
                best = min(best, clock.mark())
            self.plan.times.set_base(keep, int(x.shape[0]), max(best, 1e-6))

    # ------------------------------------------------------------ re-derivation
    def _maybe_rederive(self, d: Decision, x: Tensor, logits: Tensor, entropy: float) -> bool:
        """Re-derive after this batch when due (entropy jump or rederive_every batches)
        and its predicted time fits what the deadline leaves, or regardless once
        2 x rederive_every batches have passed since the last cut if some size adapted
        since (without, a re-cut only re-picks filters from another sample: no late batch
        for that, module doc)."""
        self.since_derive += 1
        every = self.config.rederive_every
        jumped = self.watch.observe(d.keep, entropy)
        if jumped or (every and self.since_derive >= every):
            self.pending = True
        if not self.pending:
            return False
        overdue = (every and self.since_derive >= 2 * every
                   and any(s.adapted for s in self.served.values()))
        if not (overdue or self.plan.room_for(d, self.plan.rederive_ms)):
            return False
        clock = PhaseClock.for_tensor(x)
        i = int(torch.argmax(_entropies(logits)))
        self._derive(x[i:i + 1])
        self.plan.observe_rederive(clock.mark())
        return True

    def _derive(self, sample: Tensor) -> None:
        """Write the adapted surrogates back into the master, then cut every size afresh
        from it on `sample` (1, C, H, W); filter masks are chosen again when each adapts."""
        mode, in_place = self.config.master_update, self.config.master_in_place
        if mode == "knowledge" and any(s.adapted and s.surrogate.model is self.model.base
                                       for s in self.served.values()):
            absorb(self.model)  # the master adapted in place: its change into Θ* too
        for served in self.served.values():
            served.release()
            if served.adapted and served.surrogate.model is not self.model.base:
                write_back(self.model, served.surrogate, mode)
        self.served = {}
        for keep in self.plan.sizes:
            whole = keep >= 1.0 and in_place
            surrogate = (master_surrogate(self.model) if whole
                         else extract_surrogate(self.model, sample, keep))
            if not whole:
                set_bn_mode(surrogate.model, self.config.bn_mode)
                surrogate.model.requires_grad_(False)
            self.served[keep] = Served(surrogate)
        self.watch.clear()
        self.since_derive = 0
        self.pending = False

    # ------------------------------------------------------------ reset / close
    def reset_state(self) -> None:
        for served in self.served.values():
            served.release()
        self.served = {}
        self.plan.reset()
        self.watch.clear()
        self.since_derive, self.pending = 0, False
        self.optimizer = None
        self.representation = None

    def reset(self) -> None:
        """Restore the master bit for bit and forget surrogates, masks and the learnt
        times (warm-up times stay); the next batch cuts the surrogates again."""
        self.reset_state()
        self.model.load_state_dict(self._model_state)
        self.model.requires_grad_(False)

    def close(self) -> None:
        """Remove the gradient-mask hooks."""
        for served in self.served.values():
            served.release()


def _put_back(meth: Elastic, master: dict[str, Tensor], cut: dict[float, dict]) -> None:
    """What warm_up leaves: the master and every surrogate as snapshot (`master`, `cut`
    per size), no filter masks, optimizers, adaptation or entropy history."""
    meth.model.load_state_dict(master)
    for keep, served in meth.served.items():
        served.release()
        served.surrogate.model.load_state_dict(cut[keep])
        meth.served[keep] = Served(served.surrogate)
    meth.watch.clear()
    meth.since_derive, meth.pending, meth.optimizer = 0, False, None
    meth.representation = None


def _snapshot(model: torch.nn.Module) -> dict[str, Tensor]:
    """A copy of `model`'s state_dict (parameters and buffers), to put back bit for bit."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _head(model: torch.nn.Module) -> torch.nn.Module:
    """The network's last Linear layer (its classifier: its input is the penultimate
    feature vector)."""
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]


def _entropies(logits: Tensor) -> Tensor:
    """Per-sample entropy (nats) of softmax(logits)."""
    logp = torch.log_softmax(logits.detach().float(), dim=1)
    return -(logp.exp() * logp).sum(1)


@register_factory("elastic", Elastic)
def build_elastic(model: torch.nn.Module, config: ElasticConfig) -> Elastic:
    """Elastic on `model`, or with `master_card` on the gated master that card names, on
    `model`'s device; ValueError naming the card when its outputs are not `model`'s."""
    if not config.master_card:
        return Elastic(model, config)
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    master = load_gated(config.master_card, device)
    if len(config.input_shape) == 3:
        x = torch.zeros((1, *config.input_shape), device=device)
        with torch.no_grad():
            got, want = master.eval()(x).shape, model.eval()(x).shape
        if got != want:
            raise ValueError(f"elastic: master_card {config.master_card} outputs {tuple(got)}, "
                             f"the model {tuple(want)}")
    return Elastic(master, config)
