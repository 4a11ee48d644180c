"""The gated master of ElasticDNN: FBS channel gates on its convs (Eq. 2).

A gate reads the input of its conv, ``g = ReLU(fc2(ReLU(fc1(avgpool(|x|)))))`` (the
authors' code: abs before pooling, a two-layer bottleneck, fc2's bias initialised to 1), and
keeps per sample only the top ``ceil((1 - sparsity) * C)`` channels (winner-take-all), the
rest set to 0.

Scope "block" (the default): only block-internal convs are gated (torchvision BasicBlock:
conv1; Bottleneck: conv1 and conv2; tta's SmallResNet blocks: conv1), so every residual sum
keeps its shape and a surrogate can drop the gated channels physically
(tta_core.elasticdnn.surrogate). Any other model (a user's own factory) is traced with
torch.fx and gated where the graph shows the same pattern: a dense conv whose BatchNorm
feeds exactly one dense conv through channel-wise functions only (activations, dropout),
each value read once (`traced_sites`). A conv that feeds a depthwise or grouped conv is
recognised and left ungated under scope "block" (its channels would have to be cut from
the depthwise conv too); scope "all" gates depthwise convs followed by a BatchNorm like
any other (masks, not slices). Scope "all" gates, as the authors' code does, every conv
followed by a BatchNorm: also the stem, the convs whose outputs enter a residual sum and
the downsample convs (`extra_sites`). Those extra gates zero channels of a residual branch
or shortcut; the channels stay in the sum, so a surrogate keeps them dense and holds the
gate values of its sample as fixed scales (`fold_extra_gates`): no smaller network, only
the masks. `sites` stays the sliceable block-internal ones under either scope.

Where the gate multiplies: on the output of the conv's BatchNorm, i.e. ``g * BN(conv(x))``
before the block's ReLU. Since ``g >= 0``, ``ReLU(g * y) = g * ReLU(y)``: the same as gating
after BN+ReLU, and ``g * (gamma * x_hat + beta) = (g * gamma) * x_hat + g * beta`` folds a
fixed gate into the BN's gamma and beta exactly, in eval and in train mode alike (the gate
scales after the normalisation). A gate of 0 makes the channel exactly 0 for the next conv,
so dropping it from the surrogate changes nothing.

The gates are attached with forward hooks (the conv's hook computes the gate from the conv's
input, the BN's hook multiplies), so ``base`` keeps its own module names and state_dict keys
(``base.<name>``; gates under ``gates.<name with _>``) and a plain copy of ``base`` without
the hooks is the dense network the surrogate is cut from.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import safetensors.torch
import torch
import torch.fx
from torch import Tensor, nn
from torchvision.models import resnet as tv_resnet

from tta_core.model import zoo
from tta_core.model.source import ModelCard, load_source, save_card
from tta_core.model.weights import SAFETENSORS_SUFFIX

SHARE_TOLERANCE = 1e-6  # 1 - (1 - 0.3) is 0.30000000000000004: ceil must not round it up


def kept_count(share: float, channels: int) -> int:
    """Channels kept of `channels` for a kept share (>= 1): ceil(share * C), tolerant of
    float error in `share`."""
    return min(channels, max(1, math.ceil(share * channels - SHARE_TOLERANCE)))


def winner_take_all(g: Tensor, sparsity: float) -> Tensor:
    """`g` (N, C) with all but each row's top ceil((1 - sparsity) * C) values set to 0;
    ties go to the lower channel index on every device (a stable sort: topk breaks them
    differently on CPU and CUDA, and a fresh master's gates are all tied at 1)."""
    k = kept_count(1.0 - sparsity, g.shape[1])
    if k >= g.shape[1]:
        return g
    top = torch.sort(g, dim=1, descending=True, stable=True).indices[:, :k]
    mask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, top, True)
    return torch.where(mask, g, torch.zeros_like(g))


def check_sparsity(s: float) -> float:
    """`s` as a float; ValueError naming it unless 0 <= s < 1."""
    s = float(s)
    if not 0.0 <= s < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {s}")
    return s


class ChannelGate(nn.Module):
    """FBS channel saliency gate of one conv (Eq. 2), with winner-take-all sparsity."""

    def __init__(self, in_channels: int, out_channels: int, reduction: int = 4) -> None:
        super().__init__()
        if reduction < 1:
            raise ValueError(f"reduction must be >= 1, got {reduction}")
        hidden = max(4, out_channels // reduction)
        self.fc1 = nn.Linear(in_channels, hidden)
        self.fc2 = nn.Linear(hidden, out_channels)
        # fc2 weight 0 and bias 1: every gate starts at exactly 1, so a freshly gated model
        # computes what the source computed (the warm-up starts from the source's accuracy)
        nn.init.zeros_(self.fc2.weight)
        nn.init.ones_(self.fc2.bias)
        self.sparsity = 0.0

    def saliency(self, x: Tensor) -> Tensor:
        """Gate values before winner-take-all, (N, C_out), >= 0; `x` is the conv's input."""
        pooled = x.abs().mean(dim=(2, 3))
        return torch.relu(self.fc2(torch.relu(self.fc1(pooled))))

    def forward(self, x: Tensor) -> Tensor:
        """Gate values after winner-take-all at this gate's sparsity, (N, C_out)."""
        return winner_take_all(self.saliency(x), self.sparsity)


@dataclass(frozen=True)
class GateSite:
    """One gated conv: its name in the base model, its BatchNorm, the conv reading it."""

    conv: str
    bn: str
    next_conv: str


def _block_sites(name: str, block: nn.Module) -> list[GateSite]:
    """The gate sites of one residual block (empty when it is not a known block)."""
    if isinstance(block, tv_resnet.Bottleneck):
        return [GateSite(f"{name}.conv1", f"{name}.bn1", f"{name}.conv2"),
                GateSite(f"{name}.conv2", f"{name}.bn2", f"{name}.conv3")]
    if isinstance(block, tv_resnet.BasicBlock | zoo.BasicBlock):
        return [GateSite(f"{name}.conv1", f"{name}.bn1", f"{name}.conv2")]
    return []


# modules and functions between a gated conv's BatchNorm and the conv reading it that act
# on each channel alone (a channel zeroed by its gate stays zero through them)
CHANNELWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.SiLU, nn.Hardswish, nn.GELU, nn.LeakyReLU,
                       nn.ELU, nn.Mish, nn.Hardtanh, nn.Dropout, nn.Dropout2d, nn.Identity)
CHANNELWISE_FUNCTIONS = ("relu", "relu6", "silu", "hardswish", "gelu", "leaky_relu", "elu",
                         "mish", "hardtanh", "dropout", "relu_")


def _channelwise(node: torch.fx.Node, mods: dict[str, nn.Module]) -> bool:
    """Whether `node` applies a per-channel elementwise function (activation, dropout)."""
    if node.op == "call_module":
        return isinstance(mods.get(str(node.target)), CHANNELWISE_MODULES)
    if node.op in ("call_function", "call_method"):
        name = getattr(node.target, "__name__", str(node.target))
        return name in CHANNELWISE_FUNCTIONS
    return False


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _dense_conv(m: nn.Module | None) -> bool:
    return isinstance(m, nn.Conv2d) and m.groups == 1


def _chain_site(conv: torch.fx.Node, mods: dict[str, nn.Module],
                calls: dict[str, int]) -> tuple[GateSite | None, str]:
    """The site `conv` heads in the traced graph: conv -> affine BN of its width -> only
    channel-wise functions -> a dense conv reading its channels, each value read once and
    every module called once; (None, why not) otherwise. A depthwise conv at the end is
    recognised and not sliced (its channels would have to be cut with the gated conv's)."""
    name = str(conv.target)
    bn = _only_user(conv)
    bn_mod = mods.get(str(bn.target)) if bn is not None and bn.op == "call_module" else None
    if not isinstance(bn_mod, nn.BatchNorm2d) or not bn_mod.affine \
            or bn_mod.num_features != mods[name].out_channels:
        return None, "no affine BatchNorm2d of its width reads it alone"
    node = _only_user(bn)
    while node is not None and _channelwise(node, mods):
        node = _only_user(node)
    nxt = mods.get(str(node.target)) if node is not None and node.op == "call_module" else None
    if not isinstance(nxt, nn.Conv2d):
        return None, "its BatchNorm does not feed one conv through activations only"
    if nxt.groups != 1:
        return None, "it feeds a grouped or depthwise conv"
    if nxt.in_channels != mods[name].out_channels:
        return None, "the next conv reads another width"
    if any(calls.get(str(n), 0) != 1 for n in (name, bn.target, node.target)):
        return None, "a module on the chain is called more than once"
    return GateSite(name, str(bn.target), str(node.target)), ""


def traced_sites(model: nn.Module) -> tuple[GateSite, ...]:
    """The sliceable convs of any model that torch.fx traces (module doc): every dense conv
    whose BatchNorm feeds exactly one dense conv through channel-wise functions only, in
    execution order; ValueError naming the model when it does not trace."""
    what = type(model).__name__
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as exc:  # whatever stops the trace: the finder cannot see the graph
        raise ValueError(f"make_gated: {what} is no known ResNet and torch.fx cannot trace "
                         f"it to find its convs ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]})") from None
    mods = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    sites = []
    for node in graph.nodes:
        if node.op == "call_module" and _dense_conv(mods.get(str(node.target))):
            site, _ = _chain_site(node, mods, calls)
            if site is not None:
                sites.append(site)
    return tuple(sites)


def find_sites(model: nn.Module) -> tuple[GateSite, ...]:
    """The block-internal convs of `model` to gate, in execution order: those of
    torchvision's and tta's ResNet blocks, else for any other model those its traced
    graph shows to be sliceable (`traced_sites`); ValueError naming the model when it has
    none or one cannot be sliced (grouped conv, BN without affine)."""
    what = type(model).__name__
    if isinstance(model, GatedModel):
        raise ValueError(f"make_gated: {what} is already gated")
    sites = [s for name, m in model.named_modules() for s in _block_sites(name, m)]
    if not sites:
        sites = list(traced_sites(model))
    if not sites:
        raise ValueError(f"make_gated: {what} has no conv to gate and slice: none is a "
                         "dense conv whose BatchNorm feeds one dense conv through "
                         "activations only (convs feeding depthwise convs, as in MobileNet "
                         "blocks, are not sliced)")
    mods = dict(model.named_modules())
    for s in sites:
        conv, bn, nxt = mods[s.conv], mods[s.bn], mods[s.next_conv]
        if conv.groups != 1 or nxt.groups != 1:
            raise ValueError(f"make_gated: {what} has grouped convs ({s.conv} or "
                             f"{s.next_conv}, e.g. ResNeXt): slicing them is not supported")
        if not isinstance(bn, nn.BatchNorm2d) or not bn.affine:
            raise ValueError(f"make_gated: {what}.{s.bn} is not an affine BatchNorm2d")
    return tuple(sites)


GATE_SCOPES = ("block", "all")


def extra_sites(model: nn.Module, block: tuple[GateSite, ...]) -> tuple[GateSite, ...]:
    """The convs scope "all" gates beyond the block-internal `block` ones: every Conv2d whose
    next module with parameters is an affine BatchNorm2d of its width (stem, residual
    outputs, downsample); `next_conv` empty (their outputs are not sliced)."""
    inner = {s.conv for s in block}
    mods = [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Conv2d | nn.modules.batchnorm._BatchNorm | nn.Linear)]
    out = []
    for (name, m), (nxt_name, nxt) in itertools.pairwise(mods):
        if (isinstance(m, nn.Conv2d) and name not in inner and isinstance(nxt, nn.BatchNorm2d)
                and nxt.affine and nxt.num_features == m.out_channels):
            out.append(GateSite(name, nxt_name, ""))
    return tuple(out)


def check_scope(scope: str) -> str:
    """`scope`; ValueError naming it unless one of GATE_SCOPES."""
    if scope not in GATE_SCOPES:
        raise ValueError(f"gate scope {scope!r} is not one of {GATE_SCOPES}")
    return scope


def gate_key(conv: str) -> str:
    """ModuleDict key of a gated conv's gate ('layer1.0.conv1' -> 'layer1_0_conv1')."""
    return conv.replace(".", "_")


class GatedModel(nn.Module):
    """The master: `base` with a ChannelGate on each block-internal conv (`sites`), and with
    scope "all" on every other conv followed by a BatchNorm too (`extra`); `gated`: all
    gated convs in module order."""

    def __init__(self, base: nn.Module, reduction: int = 4, scope: str = "block") -> None:
        super().__init__()
        self.sites = find_sites(base)
        self.scope = check_scope(scope)
        self.extra = extra_sites(base, self.sites) if scope == "all" else ()
        self.base = base
        order = {n: i for i, (n, _) in enumerate(base.named_modules())}
        every = sorted(self.sites + self.extra, key=lambda s: order[s.conv])
        self.gated: tuple[str, ...] = tuple(s.conv for s in every)
        self.reduction = reduction
        mods = dict(base.named_modules())
        self.gates = nn.ModuleDict({
            gate_key(s.conv): ChannelGate(mods[s.conv].in_channels, mods[s.conv].out_channels,
                                          reduction) for s in every})
        self._values: dict[str, Tensor] = {}  # last forward: gate values after WTA
        self._saliency: dict[str, Tensor] = {}  # last forward: before WTA
        self._hooks: list[tuple[str, str, int]] = []  # (module name, kind, handle id)
        for s in every:
            h1 = mods[s.conv].register_forward_hook(partial(self._gate_hook, s.conv))
            h2 = mods[s.bn].register_forward_hook(partial(self._scale_hook, s.conv))
            self._hooks += [(s.conv, "fwd", h1.id), (s.bn, "fwd", h2.id)]

    def _gate_hook(self, name: str, module: nn.Module, inputs: tuple, output: Tensor) -> None:
        gate = self.gates[gate_key(name)]
        sal = gate.saliency(inputs[0])
        self._saliency[name] = sal
        self._values[name] = winner_take_all(sal, gate.sparsity)

    def _scale_hook(self, name: str, module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
        return output * self._values[name][:, :, None, None].to(output.dtype)

    def forward(self, x: Tensor) -> Tensor:
        self._values, self._saliency = {}, {}
        return self.base(x)

    @property
    def sparsity(self) -> float:
        """The sparsity every gate applies (set_sparsity)."""
        return next(iter(self.gates.values())).sparsity

    def set_sparsity(self, s: float) -> None:
        """Every gate keeps the top ceil((1 - s) * C) channels per sample; 0 <= s < 1."""
        s = check_sparsity(s)
        for gate in self.gates.values():
            gate.sparsity = s

    @contextmanager
    def sparsity_set_to(self, s: float) -> Iterator[None]:
        """Run with sparsity `s`, then restore the previous one."""
        old = self.sparsity
        self.set_sparsity(s)
        try:
            yield
        finally:
            self.set_sparsity(old)

    def last_gates(self) -> dict[str, Tensor]:
        """Gate values (after WTA, with their graph) of the last forward, per gated conv."""
        return dict(self._values)

    @torch.no_grad()
    def gate_values(self, x: Tensor, saliency: bool = False) -> dict[str, Tensor]:
        """Per gated conv, the (N, C_out) gate values on `x` at the current sparsity (with
        `saliency`: before winner-take-all); no gradients, the model's mode unchanged."""
        return self.gates_on(x)[1 if saliency else 0]

    @torch.no_grad()
    def gates_on(self, x: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(gate values, saliencies before winner-take-all) per gated conv on `x`, both from
        one forward (a surrogate cut needs both: one master forward instead of two)."""
        self(x)
        return dict(self._values), dict(self._saliency)

    def plain_base(self) -> nn.Module:
        """A deep copy of `base` without the gate hooks: the dense network, ungated."""
        base = copy.deepcopy(self.base, memo={id(self): self})
        mods = dict(base.named_modules())
        for name, _, hook_id in self._hooks:
            mods[name]._forward_hooks.pop(hook_id, None)
        return base


def make_gated(model: nn.Module, reduction: int = 4, scope: str = "block") -> GatedModel:
    """`model` wrapped as a gated master (gates start at 1: same outputs as `model`) with
    gates on its block-internal convs, or with scope "all" on every conv followed by a
    BatchNorm; ValueError naming the model when it is not a supported ResNet."""
    return GatedModel(model, reduction, scope)


@torch.no_grad()
def fold_extra_gates(master: GatedModel, model: nn.Module, sample: Tensor,
                     sparsity: float) -> None:
    """Scope "all": fix the extra gates (not sliced) of a surrogate `model` cut from
    `master` at their values on `sample` (1, C, H, W) at `sparsity`, folded into each
    gated conv's BatchNorm (g * BN(x) = (g * gamma) x_hat + g * beta): the surrogate then
    computes what the master computes on `sample`. No-op for scope "block"."""
    if not master.extra:
        return
    was_training = master.training
    master.eval()
    try:
        with master.sparsity_set_to(check_sparsity(sparsity)):
            values = master.gate_values(sample)
    finally:
        master.train(was_training)
    mods = dict(model.named_modules())
    for site in master.extra:
        bn, g = mods[site.bn], values[site.conv][0]
        bn.weight.mul_(g.to(bn.weight.dtype))
        bn.bias.mul_(g.to(bn.bias.dtype))


GATED_FACTORY = "tta_core.elasticdnn.card:gated_master"


def save_gated(master: GatedModel, path: str | Path, source_card: ModelCard,
               clean_accuracy: float = float("nan"),
               metadata: dict[str, str] | None = None) -> Path:
    """Write `<path>.safetensors` and the model card `<path>.json` (returned): the card names
    the factory tta_core.elasticdnn.card:gated_master with the base arch and the gate settings
    (``gate_scope`` when not "block"; ``base_factory`` when the source card names a
    factory: a user's model), so `load_source` / `tta bench --model-card` build the
    gated master like any model."""
    path = Path(path)
    weights = path.with_suffix(SAFETENSORS_SUFFIX)
    weights.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in master.state_dict().items()}
    safetensors.torch.save_file(state, str(weights), metadata=dict(metadata or {}))
    card = replace(source_card, arch=f"gated_{source_card.arch}", factory=GATED_FACTORY,
                   kwargs={"base_arch": source_card.arch, "num_classes": source_card.num_classes,
                           "base_kwargs": source_card.kwargs,
                           "reduction": master.reduction}
                   | ({"gate_scope": master.scope} if master.scope != "block" else {})
                   | ({"base_factory": source_card.factory} if source_card.factory else {}),
                   checkpoint=weights.name, clean_accuracy=clean_accuracy,
                   name=path.name)
    save_card(card, path.with_suffix(".json"))
    return path.with_suffix(".json")


def load_gated(card_path: str | Path, device: str | torch.device = "cpu") -> GatedModel:
    """The gated master a card written by `save_gated` describes (eval mode); ValueError
    naming the card when its model is not a gated master."""
    model, _ = load_source(card_path, device)
    if not isinstance(model, GatedModel):
        raise ValueError(f"model card {card_path} is not a gated master (its model is a "
                         f"{type(model).__name__}; make one with `tta train-elastic`)")
    return model
