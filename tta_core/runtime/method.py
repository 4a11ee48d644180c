"""The method base class: it owns the adaptation loop (after mariodoebler/test-time-adaptation).

A method wraps a model; `step(x)` adapts on a batch and returns its predictions as an
`api.StepResult`; `reset()` restores the source weights, the optimizer and any method state
bit for bit. The base class runs every batch through one timed loop (`forward_and_adapt`):

    plan (prepare) -> forward + loss -> update (backward, step) -> post -> reforward (predict)

each phase timed by `runtime.phases.Phases`, the forward under the optional saved-activation
codec of a config with `MemoryOptions` (runtime.capabilities). Subclasses override the short
hooks they need: configure_model, collect_params, loss, and where a paper's step differs,
prepare / forward / update / post / predict (each takes the batch's `Step`), plus
reset_state for extra state. A method without an optimizer only predicts.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from tta_core.api import Plan, StepResult
from tta_core.model.memory_format import apply_memory_format
from tta_core.model.norms import NORM_NAMES, ROBUST_BN_METHODS, norm_affine_params, set_bn_mode
from tta_core.runtime import losses
from tta_core.runtime.capabilities import StepCodec, build_codec
from tta_core.runtime.graphs import GraphedForward
from tta_core.runtime.options import option
from tta_core.runtime.phases import Phases
from tta_core.runtime.precision import PRECISIONS, autocast_for, fp32_logits, precision_error


@dataclass
class MethodConfig:
    """Settings shared by every method; methods extend it with their own fields.

    `lr` is the SGD learning rate at batch size `lr_ref_batch` (64), not the rate a step
    runs with: each step uses lr * batch / lr_ref_batch (`effective_lr`), e.g. 5e-3 at
    batch 64 is 3.125e-4 at batch 4; `lr_ref_batch=0` uses `lr` as given at every batch.
    `input_shape` is one sample (C, H, W) at the model's input size (the model card's
    image_size); methods that decompose the model (AdaShadow) require it.
    `precision` and `cuda_graphs` apply where the method's served forward takes them
    (`TTAMethod.precisions`, `TTAMethod.graphs_serve`); a method that does not take a
    reduced precision refuses it at construction.
    """

    lr: float = option(5e-3, "SGD learning rate at batch size lr_ref_batch (AdaShadow §5.3.2); "
                       "each step runs at lr * batch / lr_ref_batch", low=0.0)
    # linear learning-rate scaling for small batches, as the EATA/SAR reference code does
    # (lr * batch / 64): with lr 5e-3 unscaled, Tent and EATA collapse below the source
    # model at batch 4 on the benchmark stream. 0 turns scaling off.
    lr_ref_batch: int = option(64, "batch size lr is meant at (linear scaling, as the EATA/SAR "
                               "code); 0: lr as given at every batch size", low=0)
    momentum: float = option(0.9, "SGD momentum", low=0.0)
    bn_mode: str = option("batch", "BN statistics: batch = the test batch's, source = the "
                          "running ones, robust = RoTTA's robust BN (methods that take it)",
                          choices=("batch", "source", "robust"))
    input_shape: tuple[int, ...] = option((), "one sample (C, H, W) at the model's input "
                                          "size, for model decomposition; () = not given "
                                          "(never assumed); from the model card",
                                          settable=False)
    arch: str | None = option(None, "architecture name of the model (its model card's)",
                              settable=False)
    memory_format: str = option("auto", "conv activations in NCHW (contiguous) or "
                                "channels_last; auto times both on input_shape at build and "
                                "keeps the faster (channels_last >= 10 % faster)",
                                choices=("auto", "contiguous", "channels_last"))
    precision: str = option("fp32", "forward precision (autocast): fp32, fp16 (CUDA only) "
                            "or bf16; BN statistics, losses and optimizer state stay fp32, "
                            "the returned logits are fp32; a method whose forward does not "
                            "take it refuses it", choices=PRECISIONS, runtime=False)
    cuda_graphs: bool = option(True, "replay the no-grad served forward from CUDA graphs, "
                               "one per batch shape (CUDA only; elsewhere, and where a "
                               "capture fails, eager, said once in the log)", runtime=False)


def check_serving(config: MethodConfig, method: str, precisions: tuple[str, ...],
                  device: torch.device | None) -> None:
    """ValueError (one line, naming the value) for a precision that is no choice, that
    `method` does not take (`precisions`) or that cannot run on `device`, and for a
    cuda_graphs that is not a bool."""
    if reason := precision_error(config.precision, device):
        raise ValueError(f"{method}: {reason}")
    if config.precision not in precisions:
        raise ValueError(f"{method}: precision={config.precision!r} is not taken by this "
                         f"method (it serves {', '.join(precisions)})")
    if not isinstance(config.cuda_graphs, bool):
        raise ValueError(f"{method}: cuda_graphs={config.cuda_graphs!r} must be true or false")


@dataclass
class Step:
    """One batch on its way through the loop; hooks read and fill it."""

    x: Tensor
    phases: Phases
    logits: Tensor | None = None  # the forward's output (with grad while adapting)
    loss: Tensor | None = None  # the adaptation objective; None: no update this batch
    loss_value: float = float("nan")  # the loss reported (default: float(loss))
    # the prediction's mean entropy, set with loss_value (NaN there: no loss) by a method
    # that read both with values of its own (one host read less); NaN: step_result reads it
    entropy_value: float = float("nan")
    adapted: bool = False  # an optimizer step ran
    out: Tensor | None = None  # the prediction returned
    stats: dict[str, float | int | bool] = field(default_factory=dict)


class TTAMethod:
    """Base class: no adaptation; subclasses override the hooks below."""

    name: ClassVar[str] = "base"
    config_cls: ClassVar[type] = MethodConfig
    #: the precisions this method's forwards take (config.precision; runtime.precision)
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    #: whether `serve` (the no-grad served forward) replays CUDA graphs (config.cuda_graphs):
    #: only where that forward is a pure function of its input
    graphs_serve: ClassVar[bool] = False

    def __init__(self, model: nn.Module, config: MethodConfig | None = None) -> None:
        self.model = model
        self.config = config if config is not None else self.config_cls()
        first = next(iter(model.parameters()), None)
        check_serving(self.config, self.name, self.precisions,
                      first.device if first is not None else None)
        self.graphs = self._graphed_forward()
        self.format = apply_memory_format(model, self.config.memory_format,
                                          tuple(self.config.input_shape),
                                          batch_stats=self.config.bn_mode in ("batch", "robust"))
        self.configure_model()
        self.codec: StepCodec | None = self.make_codec()
        self.params = self.collect_params()
        self.optimizer = self.setup_optimizer()
        self._lr_batch: int | None = None  # batch size the optimizer's lr is scaled for
        self._model_state = copy.deepcopy(self.model.state_dict())
        self._opt_state = (copy.deepcopy(self.optimizer.state_dict())
                           if self.optimizer is not None else None)

    @classmethod
    def make_config(cls, **cfg) -> MethodConfig:
        """config_cls(**cfg), with a ValueError naming unknown keys."""
        known = {f.name for f in dataclasses.fields(cls.config_cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for method {cls.name!r}; "
                             f"known: {sorted(known)}")
        return cls.config_cls(**cfg)

    # ------------------------------------------------------------ override points
    def configure_model(self) -> None:
        """Set train/eval modes and requires_grad. Default: BN mode from config, no grad."""
        if self.config.bn_mode == "robust" and self.name not in ROBUST_BN_METHODS:
            raise ValueError(f"bn_mode 'robust' is not supported by {self.name} (only by "
                             f"{', '.join(ROBUST_BN_METHODS)})")
        set_bn_mode(self.model, self.config.bn_mode)
        self.model.requires_grad_(False)

    def collect_params(self) -> list[nn.Parameter]:
        """Parameters the optimizer updates: those configure_model left trainable."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def setup_optimizer(self) -> torch.optim.Optimizer | None:
        """SGD over collect_params() (None when there is nothing to adapt)."""
        if not self.params:
            return None
        return torch.optim.SGD(self.params, lr=self.config.lr, momentum=self.config.momentum)

    def loss(self, logits: Tensor) -> Tensor:
        """Unsupervised adaptation loss; default Tent's entropy."""
        return losses.entropy_loss(logits)

    def forward_and_adapt(self, x: Tensor) -> StepResult:
        """The loop (module docstring): every phase timed, the result assembled here."""
        step = Step(x, Phases.for_tensor(x))
        with step.phases("plan"):
            self.prepare(step)  # what trains this batch, then the saves' widths under it
            if self.codec is not None and self.optimizer is not None:
                self.codec.before_forward(step.x)  # e.g. this batch's DAF widths
        with step.phases("forward"):
            self.forward(step)
        with step.phases("backward"):
            self.update(step)
        with step.phases("post"):
            self.post(step)
        with step.phases("reforward"):
            self.predict(step)
        return self.step_result(step)

    def prepare(self, step: Step) -> None:
        """Work before the forward that the update depends on (a plan); default none."""

    def forward(self, step: Step) -> None:
        """step.logits and step.loss: a recorded forward under the codec when the method
        adapts, else a plain no-grad forward (no loss)."""
        if self.optimizer is None:
            step.logits = self.serve(step.x)
            return
        with torch.enable_grad(), self.recording():
            with self.autocast(step.x):
                logits = self.model(step.x)
            step.logits = fp32_logits(logits)
            step.loss = self.loss(step.logits)

    def update(self, step: Step) -> None:
        """Backward and optimizer step on step.loss (none when it is None)."""
        if step.loss is None or self.optimizer is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        step.loss.backward()
        if self.codec is not None:
            self.codec.after_backward(self.model)
        self.optimizer.step()
        step.adapted = True

    def post(self, step: Step) -> None:
        """Work after the update, before the reforward (default none)."""

    def predict(self, step: Step) -> None:
        """step.out: the reforward of the updated model when the config asks for it and
        the batch adapted, else the forward's logits."""
        again = bool(getattr(self.config, "reforward", False)) and step.adapted
        step.out = self.reforward(step.x, step.logits, again)

    def units_updated(self, step: Step) -> int:
        """How many units the step updated (norm layers: a weight and a bias each)."""
        return len(self.params) // 2 if step.adapted else 0

    def step_result(self, step: Step) -> StepResult:
        """The StepResult of a finished step: its times, loss, prediction and stats."""
        out = step.out if step.out is not None else step.logits
        if not math.isnan(step.entropy_value):  # the method read both already
            loss, entropy = step.loss_value, step.entropy_value
        elif math.isnan(step.loss_value):
            loss, entropy = losses.loss_and_entropy(step.loss, out)
        else:  # the method read its loss already
            loss, entropy = step.loss_value, losses.loss_and_entropy(None, out)[1]
        res = StepResult(logits=out.detach(), times=step.phases.times(), loss=loss,
                         mean_entropy=entropy, adapted=step.adapted,
                         units_updated=self.units_updated(step))
        if self.codec is not None:
            res.stats.update(self.codec.stats())
        res.stats.update(step.stats)
        return res

    def reset_state(self) -> None:
        """Reset method state other than weights and optimizer (override when needed)."""

    def make_codec(self) -> StepCodec | None:
        """The saved-activation codec the adaptation forwards run under (after
        configure_model): the one a MemoryOptions config asks for (runtime.capabilities)."""
        return build_codec(self.model, self.config)

    # ------------------------------------------------------------ helpers for subclasses
    def recording(self) -> AbstractContextManager:
        """The context every recorded (adaptation) forward runs in: the codec, so that its
        saves are stored as the config asks (DAF widths), else a null context. A method
        with forwards of its own (SAR's second SAM pass, CoTTA's student) runs them in it."""
        return self.codec if self.codec is not None else nullcontext()

    def nothing_to_adapt(self, lacks: str) -> ValueError:
        """The one-line error for a model this method cannot adapt, e.g.
        `tent: MLP has no parameters: nothing to adapt` (raised at construction, so a
        bad model never reaches step() and fails there with an AttributeError)."""
        return ValueError(f"{self.name}: {type(self.model).__name__} has {lacks}: "
                          "nothing to adapt")

    def train_norm_affine(self, include: Callable[[str], bool] | None = None) -> None:
        """Make the affine params of the norm layers (`norm_affine_params`) trainable, as
        Tent/EATA/SAR adapt them; ValueError (`nothing_to_adapt`) when there are none."""
        params = norm_affine_params(self.model, include)
        if not params:
            skipped = include is not None and bool(norm_affine_params(self.model))
            where = " outside the skipped modules" if skipped else ""
            raise self.nothing_to_adapt(f"no {NORM_NAMES} layer with affine parameters{where}")
        for p in params:
            p.requires_grad_(True)

    def reforward(self, x: Tensor, logits: Tensor, enabled: bool) -> Tensor:
        """The batch's prediction after an update: a no-grad forward of the updated model
        when `enabled` (sequential mode), else the pre-update `logits`."""
        if not enabled:
            return logits
        return self.serve(x)

    def _graphed_forward(self) -> GraphedForward:
        """The served forward's graphs: on where the method and config.cuda_graphs say so
        (it still runs eagerly off CUDA), else off with the reason."""
        graphs = GraphedForward(self._served_forward,
                                enabled=self.config.cuda_graphs and self.graphs_serve,
                                name=f"{self.name} served forward")
        if self.config.cuda_graphs and not self.graphs_serve:
            graphs.fallback_reason = f"{self.name} serves eagerly (its forward is not graphed)"
        return graphs

    def autocast(self, x: Tensor, cache_enabled: bool = True) -> AbstractContextManager:
        """The context a forward of x runs in at config.precision (runtime.precision:
        autocast; a null context at fp32)."""
        return autocast_for(x.device, self.config.precision, cache_enabled=cache_enabled)

    def _served_forward(self, x: Tensor) -> Tensor:
        """The model's no-grad forward of x at config.precision (what graphs capture; the
        autocast weight cache off, so nothing cached outlives a capture)."""
        with torch.no_grad(), self.autocast(x, cache_enabled=False):
            return fp32_logits(self.model(x))

    def serve(self, x: Tensor) -> Tensor:
        """The no-grad served forward of x: at config.precision, replayed from a CUDA graph
        per batch shape where the method takes them (`graphs_serve`, config.cuda_graphs,
        a CUDA device; `self.graphs` says why not), fp32 logits."""
        return fp32_logits(self.graphs(x))

    # ------------------------------------------------------------ public
    def step(self, x: Tensor) -> StepResult:
        """Adapt on batch x (N, C, H, W) and return its predictions."""
        return self._step(x, None)

    def _step(self, x: Tensor, plan: Plan | None) -> StepResult:
        if x.ndim != 4:
            raise ValueError(f"expected a batch [N, C, H, W], got shape {tuple(x.shape)}")
        self.finish()  # an update in flight runs at the rate it was started with
        self._scale_lr(int(x.shape[0]))
        return self.forward_and_adapt(x) if plan is None else self.forward_and_adapt(x, plan=plan)

    def finish(self) -> None:
        """Wait for adaptation work still in flight (none unless the method adapts in the
        background: AdaShadow's parallel mode)."""

    def close(self) -> None:
        """Release hooks, threads and CUDA graphs; the method is unusable afterwards."""
        self.finish()
        self.graphs.clear()

    def set_lr(self, lr: float) -> None:
        """Change the learning rate (at the reference batch size) from the next step on."""
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        self.finish()
        self.config.lr = float(lr)
        self._lr_batch = None

    def effective_lr(self, batch: int) -> float | None:
        """The SGD rate a step on `batch` samples runs with: lr * batch / lr_ref_batch (lr
        itself when lr_ref_batch is 0); None when the method has no optimizer."""
        if self.optimizer is None:
            return None
        ref = self.config.lr_ref_batch
        return self.config.lr * batch / ref if ref else self.config.lr

    def _scale_lr(self, batch: int) -> None:
        if self.optimizer is None or batch == self._lr_batch:
            return
        lr = self.effective_lr(batch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._lr_batch = batch

    def reset(self) -> None:
        """Restore source weights, optimizer and method state bit for bit."""
        self.finish()
        self.reset_state()
        self.model.load_state_dict(self._model_state)
        self._lr_batch = None
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(self._opt_state))
            self.optimizer.zero_grad(set_to_none=True)
