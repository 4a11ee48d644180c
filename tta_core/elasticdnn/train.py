"""Offline training of the gated master (EdgeTailor / ElasticDNN recipe, CPU minutes).

Starts from a trained source checkpoint with fresh gates (all exactly 1: the source's
outputs), then

1. gate warm-up: the base frozen, only the gates train;
2. joint training in stages of growing maximum sparsity (0.2 -> 0.5 -> 0.8);

each step by the sandwich rule: the same batch at sparsity 0, two random sparsities in
(0, max) and the max; the full network learns from the labels, the three sparser ones from
the full network's (detached) predictions as well (in-place distillation, slimmable
networks), plus an L1 penalty on the gate outputs.

The domain knowledge Θ* (tta_core.elasticdnn.knowledge, §III-B1 Eq. 1), K_i = ceil(`knowledge`
· N_i) matrices per layer, is fitted to the source's filters at the start (gauge
`knowledge_init`, "similarity" by default: w wᵀ the filters' Gram matrix) and trained with
the paper's second loss, `tie` x Σ_i Σ_j ‖θ_ij − Σ_k w_i(j,k) θ*_ik‖², added to every step
(plain SGD, `knowledge_lr`): the filters are pulled towards their combinations (rank K_i)
while the task loss trains them, and Θ*, w follow the filters. At the end Θ* is solved by
least squares for the trained relevances and the filters set to their combinations
(`retie(project=True)`: the loss 0, "minimized to 0" in §III-B1), before the BN statistics
are re-estimated. `knowledge_only` skips the training: Θ* is fitted to an existing gated
master's filters (orthonormal gauge, the loss's optimum for fixed filters: a checkpoint
written before Θ* existed, converted).

`gate_scope` "all" gates every conv (tta_core.elasticdnn.gates); `teacher` mixes the
ungated source's soft predictions into every pass's label loss (distillation from the
source: its extra gates start at 1, the source's function); `final_decay` anneals the base
lr over the last stage; `checkpoint_dir` keeps the master after each phase, and
`init_checkpoint` resumes from one (e.g. the warm-up's, with `warmup_epochs` 0).
`hard_tie_epochs` adds a last phase that holds the tie exact after every step (Θ* solved,
the filters projected: projected gradient descent at rank K): the soft tie leaves a
residual of about 1 % of the filters' norm, and projecting that away at the end alone cost
the scope-"all" master most of its accuracy (BN rescales what the residual carried), so the
master has to train at rank K before it ends there.

BatchNorm trains with batch statistics (as the test-time adaptation that serves the master
and its surrogates normalises); only the sparsity-0 pass updates the running statistics, so
the master in eval mode is the full network. Training with the source's running statistics
frozen (eval-mode BN) was tried first: the sparse passes' losses then diverged (at the
higher rate) or stayed high (at the lower one), since a BN after a sparsified conv sees a
much smaller input than its statistics expect.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import make_signs
from tta_core.elasticdnn.gates import GatedModel, check_scope, load_gated, make_gated
from tta_core.elasticdnn.knowledge import KNOWLEDGE_GAUGES, attach_knowledge, knowledge_of
from tta_core.model.source import ModelCard, _augment, accuracy, load_card, load_source

VAL_SEED_OFFSET = 10_000  # the held-out signs of train_source: seed + 10000


@dataclass
class ElasticTrainConfig:
    """Gated-master training (defaults: the small net on the shipped synthetic signs; a
    user's own images come as `ElasticData`, the sample counts then unused)."""

    source_card: Path = Path("checkpoints/small_resnet_signs32.json")
    warmup_epochs: int = 1
    stage_epochs: int = 2  # per stage of max sparsity
    stages: tuple[float, ...] = (0.2, 0.5, 0.8)
    train_samples: int = 8000
    val_samples: int = 1000
    batch_size: int = 128
    lr: float = 0.005  # base weights (SGD, momentum 0.9)
    gate_lr: float = 1e-3  # gates (Adam)
    l1: float = 1e-3  # weight of the mean gate output
    clip: float = 5.0  # gradient norm clip (the first sparse passes' losses are ~3-4)
    distill: float = 0.5  # share of the sub-networks' loss from the full net's soft labels
    reduction: int = 4
    seed: int = 0
    threads: int = 2  # torch threads (0: torch default)
    pad: int = 2  # random translations, as train-source
    calibration_samples: int = 2048  # BN running statistics re-estimated at the end
    eval_sparsities: tuple[float, ...] = (0.0, 0.2, 0.5, 0.7, 0.8)
    knowledge: float = 0.25  # Θ* share: K_i = ceil(share * N_i); 0: no Θ*
    tie: float = 1.0  # weight of the second loss (master-knowledge tie)
    knowledge_lr: float = 0.1  # Θ* and relevances (plain SGD)
    knowledge_init: str = "similarity"  # gauge Θ* starts in (knowledge.KNOWLEDGE_GAUGES)
    knowledge_only: bool = False  # source_card is a gated master: fit Θ* to it, no training
    gate_scope: str = "block"  # gates.GATE_SCOPES: block-internal convs or every conv
    teacher: float = 0.0  # share of every pass's label loss from the ungated source's output
    final_decay: bool = False  # base lr cosine-annealed to 0 over the last stage
    checkpoint_dir: str = ""  # the master's state after each phase (safetensors) when set
    init_checkpoint: str = ""  # start from such a state (same scope and share) when set
    hard_tie_epochs: int = 0  # then at the last stage's sparsity with the tie held exact

    def validate(self) -> None:
        """ValueError naming the first bad value."""
        for name in ("warmup_epochs", "stage_epochs", "hard_tie_epochs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("train_samples", "val_samples", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.stages or any(not 0 < s < 1 for s in self.stages):
            raise ValueError(f"stages must be sparsities in (0, 1), got {self.stages}")
        if not 0 <= self.distill <= 1:
            raise ValueError(f"distill must be in [0, 1], got {self.distill}")
        if not 0 <= self.knowledge <= 1:
            raise ValueError(f"knowledge must be a share in (0, 1] (0: none), got "
                             f"{self.knowledge}")
        if self.tie < 0 or self.knowledge_lr <= 0:
            raise ValueError(f"tie must be >= 0 and knowledge_lr > 0, got {self.tie}, "
                             f"{self.knowledge_lr}")
        if 2 * self.tie * self.knowledge_lr >= 1:  # SGD on Θ* would overshoot the tie
            raise ValueError(f"tie x knowledge_lr must be < 0.5, got {self.tie} x "
                             f"{self.knowledge_lr}")
        if self.knowledge_only and self.knowledge == 0:
            raise ValueError("knowledge_only needs knowledge > 0")
        if not 0 <= self.teacher <= 1:
            raise ValueError(f"teacher must be in [0, 1], got {self.teacher}")
        check_scope(self.gate_scope)
        if self.knowledge_init not in KNOWLEDGE_GAUGES:
            raise ValueError(f"knowledge_init must be one of {KNOWLEDGE_GAUGES}, got "
                             f"{self.knowledge_init!r}")


@dataclass
class ElasticData:
    """Model-ready training and held-out images of the master's training: by default the
    shipped signs (`signs_data`); for a user's model its own labelled images, clean and
    under the training corruptions (made by the caller, e.g. `tta train-elastic --data`)."""

    x: Tensor
    y: Tensor
    val_x: Tensor
    val_y: Tensor
    source: dict = field(default_factory=dict)  # where the images came from (the record)


def signs_data(card: ModelCard, cfg: ElasticTrainConfig, progress: bool = False) -> ElasticData:
    """The shipped synthetic signs: `train_samples` for training (seed `seed`), the held-out
    ones of `tta train-source` (`validation_set`)."""
    train = make_signs(cfg.train_samples, card.image_size, seed=cfg.seed, progress=progress)
    xva, yva = validation_set(card, cfg)
    return ElasticData(images_to_tensor(train.images, card.mean, card.std),
                       torch.from_numpy(train.labels), xva, yva, {"kind": "signs"})


@dataclass
class ElasticTrainResult:
    """What training produced: the master, its card's base, accuracies, time."""

    master: GatedModel
    card: ModelCard
    source_accuracy: float  # the source checkpoint on the held-out signs
    accuracy: dict[float, float] = field(default_factory=dict)  # sparsity -> accuracy
    batch_accuracy: dict[float, float] = field(default_factory=dict)  # BN batch statistics
    seconds: float = 0.0
    steps: int = 0
    tie_loss: float = float("nan")  # the second loss at the end (NaN: no Θ*)


def _label_loss(logits: Tensor, y: Tensor, teacher: Tensor | None,
                cfg: ElasticTrainConfig) -> Tensor:
    """Cross-entropy on the labels, with `teacher` probabilities (the ungated source's) a
    `cfg.teacher` share of it as soft labels."""
    ce = nn.functional.cross_entropy(logits, y)
    if teacher is None or cfg.teacher == 0:
        return ce
    kd = -(teacher * torch.log_softmax(logits, 1)).sum(1).mean()
    return (1 - cfg.teacher) * ce + cfg.teacher * kd


def sandwich_loss(master: GatedModel, x: Tensor, y: Tensor, s_max: float,
                  cfg: ElasticTrainConfig, gen: torch.Generator,
                  teacher: Tensor | None = None) -> float:
    """Backpropagate the sandwich rule's four losses on one batch (sparsity 0, two random
    in (0, s_max), s_max), the label loss mixed with `teacher` probabilities when given;
    returns their sum."""
    u = torch.rand(2, generator=gen).tolist()
    total, soft = 0.0, None
    bns = [m for m in master.base.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momentum = [bn.momentum for bn in bns]
    for s in (0.0, u[0] * s_max, u[1] * s_max, s_max):
        master.set_sparsity(s)
        for bn, mom in zip(bns, momentum, strict=True):  # only the full pass updates stats
            bn.momentum = mom if s == 0.0 else 0.0
        logits = master(x)
        gates = master.last_gates().values()
        loss = cfg.l1 * torch.stack([g.mean() for g in gates]).mean()
        if soft is None:
            loss = loss + _label_loss(logits, y, teacher, cfg)
            soft = torch.softmax(logits.detach(), 1)
        else:
            kd = -(soft * torch.log_softmax(logits, 1)).sum(1).mean()
            loss = loss + cfg.distill * kd + (1 - cfg.distill) * _label_loss(
                logits, y, teacher, cfg)
        loss.backward()
        total += float(loss.detach())
    master.set_sparsity(0.0)
    for bn, mom in zip(bns, momentum, strict=True):
        bn.momentum = mom
    return total


def _optimizers(master: GatedModel, cfg: ElasticTrainConfig, warmup: bool
                ) -> list[torch.optim.Optimizer]:
    """Adam for the gates (their inputs' scale varies by layer: plain SGD diverged at
    lr 0.05), SGD with momentum for the base after the warm-up (frozen during it), plain
    SGD for Θ* and the relevances when the master has them."""
    for p in master.base.parameters():
        p.requires_grad_(not warmup)
    opts: list[torch.optim.Optimizer] = [
        torch.optim.Adam(master.gates.parameters(), lr=cfg.gate_lr)]
    if not warmup:
        opts.append(torch.optim.SGD(master.base.parameters(), lr=cfg.lr, momentum=0.9,
                                    nesterov=True))
    kn = knowledge_of(master)
    if kn is not None:
        kn.requires_grad_(True)
        # plain SGD: near the tie's optimum Adam's normalised steps undo it (measured)
        opts.append(torch.optim.SGD(kn.parameters(), lr=cfg.knowledge_lr))
    return opts


def _phases(cfg: ElasticTrainConfig) -> list[tuple[str, float, int]]:
    """(name, max sparsity, epochs) of each training phase."""
    phases = [("warm-up", cfg.stages[0], cfg.warmup_epochs)]
    phases += [(f"max {s:g}", s, cfg.stage_epochs) for s in cfg.stages]
    phases.append(("hard tie", cfg.stages[-1], cfg.hard_tie_epochs))
    return [p for p in phases if p[2] > 0]


def train_master(cfg: ElasticTrainConfig, progress: bool = True,
                 data: ElasticData | None = None) -> ElasticTrainResult:
    """Train a gated master and its Θ* from `cfg.source_card`'s checkpoint, or with
    `knowledge_only` fit Θ* to the gated master it names; see the module doc. `data`: the
    images to train and measure on (default: the shipped signs, `signs_data`)."""
    cfg.validate()
    t0 = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if cfg.knowledge_only:
        return fit_knowledge(cfg, t0, data)
    source, card = load_source(cfg.source_card)
    if data is None:
        data = signs_data(card, cfg, progress)
    xtr, ytr, xva, yva = data.x, data.y, data.val_x, data.val_y
    source_acc = accuracy(source, xva, yva)
    teacher = copy.deepcopy(source).eval() if cfg.teacher > 0 else None
    master = make_gated(source, cfg.reduction, cfg.gate_scope)
    if cfg.knowledge > 0:
        attach_knowledge(master, cfg.knowledge, gauge=cfg.knowledge_init)
    if cfg.init_checkpoint:
        import safetensors.torch

        master.load_state_dict(safetensors.torch.load_file(cfg.init_checkpoint))
    steps = _train_phases(master, xtr, ytr, cfg, progress, teacher)
    for p in master.parameters():
        p.requires_grad_(True)
    tie = retie(master, project=True)
    recalibrate_bn(master, xtr[:cfg.calibration_samples], cfg.batch_size)
    return ElasticTrainResult(
        master=master, card=card, source_accuracy=source_acc, steps=steps,
        accuracy=sparsity_accuracy(master, xva, yva, cfg.eval_sparsities),
        batch_accuracy=sparsity_accuracy(master, xva, yva, cfg.eval_sparsities, True),
        seconds=time.perf_counter() - t0, tie_loss=tie)


def _train_phases(master: GatedModel, xtr: Tensor, ytr: Tensor, cfg: ElasticTrainConfig,
                  progress: bool, teacher: nn.Module | None = None) -> int:
    """Warm-up and the sparsity stages (module doc); each step the sandwich rule's losses
    (soft labels from `teacher` too when given) plus `tie` x the second loss when the
    master has Θ*. Returns the step count."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(cfg.seed)
    per_epoch = -(-len(ytr) // cfg.batch_size)
    phases = _phases(cfg)
    steps = 0
    with tqdm(total=per_epoch * sum(p[2] for p in phases), desc="train-elastic",
              unit="step", disable=not progress) as bar:
        for i_phase, (name, s_max, epochs) in enumerate(phases):
            opts = _optimizers(master, cfg, warmup=name == "warm-up")
            sched = None
            if cfg.final_decay and i_phase == len(phases) - 1 and name != "warm-up":
                sched = torch.optim.lr_scheduler.CosineAnnealingLR(opts[1], epochs * per_epoch)
            master.train()  # batch statistics (module doc)
            for _ in range(epochs):
                perm = torch.randperm(len(ytr), generator=gen)
                for i in range(0, len(ytr), cfg.batch_size):
                    idx = perm[i:i + cfg.batch_size]
                    loss = _step(master, _augment(xtr[idx], cfg.pad, gen), ytr[idx], s_max,
                                 cfg, gen, opts, teacher, hard=name == "hard tie")
                    if sched is not None:
                        sched.step()
                    steps += 1
                    bar.update(1)
                    bar.set_postfix_str(f"{name} loss {loss:.3f}")
            _checkpoint(master, cfg, f"{i_phase}_{name.replace(' ', '_')}")
    return steps


def _step(master: GatedModel, x: Tensor, y: Tensor, s_max: float, cfg: ElasticTrainConfig,
          gen: torch.Generator, opts: list[torch.optim.Optimizer],
          teacher: nn.Module | None, hard: bool = False) -> float:
    """One training step on a batch: sandwich losses, the tie, clipping, every optimizer;
    with `hard` the filters are then projected onto their combinations (Θ* solved for w:
    projected gradient descent, the tie exact). Returns the loss."""
    kn = knowledge_of(master)
    master.zero_grad(set_to_none=True)
    probs = None
    if teacher is not None:
        with torch.no_grad():
            probs = torch.softmax(teacher(x), 1)
    loss = sandwich_loss(master, x, y, s_max, cfg, gen, probs)
    if kn is not None and cfg.tie > 0:
        tie = cfg.tie * kn.tie_loss(master.base)
        tie.backward()
        loss += float(tie.detach())
    nn.utils.clip_grad_norm_(
        [p for n, p in master.named_parameters() if not n.startswith("knowledge.")], cfg.clip)
    for opt in opts:
        opt.step()
    if hard and kn is not None:
        with torch.no_grad():
            kn.solve(master.base)
            kn.project(master.base)
    return loss


def _checkpoint(master: GatedModel, cfg: ElasticTrainConfig, tag: str) -> None:
    """The master's state as `<checkpoint_dir>/<tag>.safetensors` (nothing when unset)."""
    if not cfg.checkpoint_dir:
        return
    import safetensors.torch

    out = Path(cfg.checkpoint_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in master.state_dict().items()}
    safetensors.torch.save_file(state, str(out / f"{tag}.safetensors"))


def retie(master: GatedModel, project: bool = False) -> float:
    """Solve Θ* by least squares for the master's relevances and filters (the tie's
    optimum for fixed w), freeze Θ*; with `project` the filters are then set to their
    combinations (the tie exact, rank K_i: a change of the master, BN to recalibrate).
    Returns the second loss after (NaN: no Θ*)."""
    kn = knowledge_of(master)
    if kn is None:
        return float("nan")
    kn.requires_grad_(False)
    kn.solve(master.base)
    if project:
        kn.project(master.base)
    with torch.no_grad():
        return float(kn.tie_loss(master.base))


def fit_knowledge(cfg: ElasticTrainConfig, t0: float,
                  data: ElasticData | None = None) -> ElasticTrainResult:
    """`knowledge_only`: the gated master of `cfg.source_card` with Θ* fitted to its
    filters (share `cfg.knowledge`), its weights unchanged; the result's card is the base
    card `save_gated` expects. Accuracy on `data`'s held-out images (default: the signs')."""
    master = load_gated(cfg.source_card)
    gated = load_card(cfg.source_card)
    attach_knowledge(master, cfg.knowledge)
    base = replace(gated, arch=str(gated.kwargs["base_arch"]),
                   factory=str(gated.kwargs.get("base_factory", "")),
                   kwargs=dict(gated.kwargs.get("base_kwargs") or {}),
                   name=gated.name.removesuffix("_elastic"))
    xva, yva = validation_set(base, cfg) if data is None else (data.val_x, data.val_y)
    acc = sparsity_accuracy(master, xva, yva, cfg.eval_sparsities)
    return ElasticTrainResult(
        master=master, card=base, source_accuracy=acc[cfg.eval_sparsities[0]], accuracy=acc,
        batch_accuracy=sparsity_accuracy(master, xva, yva, cfg.eval_sparsities, True),
        seconds=time.perf_counter() - t0, tie_loss=retie(master))


@torch.no_grad()
def recalibrate_bn(master: GatedModel, x: Tensor, batch: int) -> None:
    """The BN running statistics of the full network (sparsity 0), re-estimated as the
    plain average over `x` in batches (the momentum average lags the trained weights);
    the master is left in eval mode."""
    bns = [m for m in master.base.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momentum = [bn.momentum for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average
    master.train()
    with master.sparsity_set_to(0.0):
        for i in range(0, len(x), batch):
            master(x[i:i + batch])
    for bn, mom in zip(bns, momentum, strict=True):
        bn.momentum = mom
    master.eval()


def validation_set(card: ModelCard, cfg: ElasticTrainConfig) -> tuple[Tensor, Tensor]:
    """The held-out clean signs of `tta train-source` (seed + 10000), model-ready."""
    val = make_signs(cfg.val_samples, card.image_size, seed=cfg.seed + VAL_SEED_OFFSET)
    return images_to_tensor(val.images, card.mean, card.std), torch.from_numpy(val.labels)


def sparsity_accuracy(master: GatedModel, x: Tensor, y: Tensor,
                      sparsities: tuple[float, ...], batch_stats: bool = False
                      ) -> dict[float, float]:
    """Top-1 accuracy of the master at each sparsity (its sparsity restored); eval mode
    (the full network's running statistics) or, with `batch_stats`, BN on batches of 128
    (how test-time adaptation normalises)."""
    out = {}
    for s in sparsities:
        with master.sparsity_set_to(s):
            out[float(s)] = (_batch_stat_accuracy(master, x, y) if batch_stats
                             else accuracy(master, x, y))
    master.eval()
    return out


@torch.no_grad()
def _batch_stat_accuracy(model: nn.Module, x: Tensor, y: Tensor, batch: int = 128) -> float:
    """Top-1 accuracy with BN on each batch's statistics (running statistics restored)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    hits = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
               for i in range(0, len(y), batch))
    model.load_state_dict(state)
    return hits / max(len(y), 1)
