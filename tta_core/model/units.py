"""Decompose a classifier into AdaShadow *units* (parameterised layers) and *stages*.

Units are the granularity of layer-selective updates (AdaShadow §3.2: Conv, BN, Linear,
LayerNorm, attention projections); stages are the reuse boundaries of the reforward
(§4: the reforward restarts from the cached input of the first updated unit's stage).
Per-unit MACs and bytes give eta_l = compute time / memory time of the latency predictor.
Stages follow the model's blocks: per family for ResNet, MobileNetV2 and ViT; cut from
the torch.fx graph for any other model (`fx_stages`; one stage where it does not trace).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn
from torchvision.models import MobileNetV2, ResNet, VisionTransformer
from torchvision.ops import StochasticDepth

from tta_core.model import fx_stages
from tta_core.model.zoo import SmallResNet

log = logging.getLogger(__name__)

#: a stage's input: one tensor, or (fx stages) the tuple of the values crossing its cut
StageInput = Tensor | tuple[Tensor, ...]

DEFAULT_FLOPS = 1e11  # MAC/s used for eta (paper: delta_c = 1/F)
DEFAULT_CACHE_BW = 2e10  # bytes/s (paper: delta_m = 1/b_cache)
_BYTES = 4

_FAMILY = {
    "small_resnet": "resnet", "resnet18_cifar": "resnet", "resnet18_cifar_w32": "resnet",
    "resnet18_cifar_w16": "resnet", "resnet18": "resnet", "resnet34": "resnet",
    "resnet50": "resnet", "resnet101": "resnet", "mobilenet_v2": "mobilenet",
    "vit_b_16": "vit", "vit_b_32": "vit", "vit_l_16": "vit",
}
#: unit kinds of normalisation layers (their affine is what trainable "norm" adapts)
NORM_UNIT_KINDS = ("bn", "ln", "gn")


@dataclass
class Unit:
    """One parameterised layer: the unit of selective update."""

    index: int
    name: str
    # "conv" | "linear" | "bn" | "ln" | "gn" | "attn" | "scale" (a module's own raw
    # per-channel parameters, ConvNeXt's layer_scale: an elementwise multiply)
    kind: str
    stage: int
    module: nn.Module = field(repr=False, compare=False)
    params: int
    macs_fwd: int
    macs_dx: int
    macs_dw: int
    bytes_moved: int
    eta: float
    tensors: list[nn.Parameter] = field(default_factory=list, repr=False, compare=False)
    # the unit whose output is this unit's input, unchanged (_producers): the reforward
    # from this unit replays that output instead of running the producer (§4)
    producer: int | None = None
    # its output can stand in for running it (StagedModel.restart_start): the module runs
    # once per forward, returns one tensor and nothing modifies that tensor in place later
    replayable: bool = False

    def parameters(self) -> list[nn.Parameter]:
        """The model parameters this unit owns (what is updated when it is selected)."""
        return list(self.tensors)


@dataclass
class Stage:
    """A reuse boundary: a module whose input is cached during the forward."""

    index: int
    name: str
    module: nn.Module
    first_unit: int
    n_units: int


@dataclass
class StagedModel:
    """A model split into stages whose composition equals model(x)."""

    arch: str
    model: nn.Module
    stages: list[Stage]
    units: list[Unit]
    input_shape: tuple[int, ...] = ()  # one sample, as given to decompose
    # per unit: where its module sits in its parents (forward_from's replay), found once
    _slots: dict[int, list[tuple[nn.Module, str]]] = field(default_factory=dict, repr=False,
                                                          compare=False)
    _stand_ins: dict[int, _Replay] = field(default_factory=dict, repr=False, compare=False)

    def stage_start(self) -> np.ndarray:
        """Per unit: index of the first unit of its stage."""
        return np.array([self.stages[u.stage].first_unit for u in self.units], dtype=np.int64)

    def restart_start(self) -> np.ndarray:
        """Per unit d: where a reforward from d starts counting (the cost model's reuse
        boundary, `stage_start` of the planner): the last b <= d such that every unit of
        d's stage before b replays its output from the forward (`Unit.replayable`).
        `forward_from(..., replay)` with those outputs runs only the units from b on (and
        the cheap ops between them): d itself where all of its stage before it replay,
        else from the first unit that cannot (a BN whose output an in-place ReLU
        overwrote runs again, and counts). Non-decreasing, as the planner needs."""
        out = self.stage_start()
        for u in self.units:
            first = int(out[u.index])
            stuck = [v.index for v in self.units[first:u.index] if not v.replayable]
            out[u.index] = stuck[0] if stuck else u.index
        return out

    def forward_from(self, stage: int, x: StageInput,
                     replay: Mapping[int, Tensor] | tuple[int, Tensor] | None = None
                     ) -> Tensor:
        """Run stages[stage:] on x (x is the input of that stage: a tuple where several
        values cross into an fx stage, as `stage_input_hooks` shows it). `replay` {unit: output}
        (or one (unit, output) pair): those units' modules return their output from the
        forward instead of computing it (AdaShadow §4 reuse: the layers before the first
        updated one)."""
        if not 0 <= stage < len(self.stages):
            raise ValueError(f"stage {stage} out of range 0..{len(self.stages) - 1}")
        if isinstance(replay, tuple):
            replay = {replay[0]: replay[1]}
        with self._replaying(replay or {}):
            for st in self.stages[stage:]:
                x = st.module(x)
        return x

    def _slots_of(self, unit: int) -> list[tuple[nn.Module, str]]:
        """Where the unit's module sits in its parents (found once, re-found if moved)."""
        mod = self.units[unit].module
        slots = self._slots.get(unit, [])
        if not slots or any(parent._modules.get(name) is not mod for parent, name in slots):
            # wrapper stages (stem, head pieces) hold the model's modules themselves
            parents = {id(p): p for st in self.stages if isinstance(st.module, _StageWrapper)
                       for p in st.module.modules()}
            parents.update((id(p), p) for p in self.model.modules())
            slots = self._slots[unit] = [
                (parent, name) for parent in parents.values()
                for name, child in parent._modules.items() if child is mod]
        return slots

    @contextmanager
    def _replaying(self, replay: Mapping[int, Tensor]) -> Iterator[None]:
        swapped = []
        for u, out in replay.items():
            stand_in = self._stand_ins.get(u)
            if stand_in is None:  # one per unit, made once (building a Module is slow)
                stand_in = self._stand_ins[u] = _Replay()
            stand_in.__dict__["out"] = out  # a plain attribute: no Module bookkeeping
            swapped += [(parent, name, self.units[u].module, stand_in)
                        for parent, name in self._slots_of(u)]
        for parent, name, _mod, stand_in in swapped:
            parent._modules[name] = stand_in
        try:
            yield
        finally:
            for parent, name, mod, stand_in in swapped:
                parent._modules[name] = mod
                stand_in.__dict__["out"] = None  # the forward's tensor is not held


class _Replay(nn.Module):
    """Stands in for a module during a reforward: returns its output from the forward
    (`out`, set by StagedModel._replaying)."""

    def __init__(self) -> None:
        super().__init__()
        self.__dict__["out"] = None

    def forward(self, *_args: object, **_kwargs: object) -> Tensor:
        return self.out


# ---------------------------------------------------------------- stage wrappers
class _StageWrapper(nn.Module):
    """A stage made of pieces of the model: model.forward never calls it as a module."""


class _ResNetStem(_StageWrapper):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu = m.conv1, m.bn1, m.relu
        self.maxpool = getattr(m, "maxpool", nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))


class _ResNetHead(_StageWrapper):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.avgpool, self.fc = m.avgpool, m.fc

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.avgpool(x), 1))


class _MobileNetHead(_StageWrapper):
    def __init__(self, m: MobileNetV2) -> None:
        super().__init__()
        self.classifier = m.classifier

    def forward(self, x: Tensor) -> Tensor:
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))


class _ViTStem(_StageWrapper):
    def __init__(self, m: VisionTransformer) -> None:
        super().__init__()
        self.vit = [m]  # list: keep the parent out of this module's parameters

    def forward(self, x: Tensor) -> Tensor:
        m = self.vit[0]
        x = m._process_input(x)
        x = torch.cat([m.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return m.encoder.dropout(x + m.encoder.pos_embedding)


class _ViTHead(_StageWrapper):
    def __init__(self, m: VisionTransformer) -> None:
        super().__init__()
        self.ln, self.heads = m.encoder.ln, m.heads

    def forward(self, x: Tensor) -> Tensor:
        return self.heads(self.ln(x)[:, 0])


class _FxStage(_StageWrapper):
    """A piece of the model's torch.fx graph (fx_stages.split); `taps`: per value crossing
    the cut before it, the module and hook kind (pre: its input; else its output; the
    model itself for its input) that show it in model.forward, the last one at the cut;
    `owners`: the module paths it runs. Its input is one tensor, or the tuple of the
    values crossing (a segmentation head's skip feature, the model's input)."""

    def __init__(self, seg: fx_stages.Segment, model: nn.Module) -> None:
        super().__init__()
        self.piece = seg.module
        taps = [(model.get_submodule(t.path), t.pre) for t in seg.taps]
        self.__dict__["taps"] = taps  # plain attributes: the model's, not this stage's
        self.__dict__["owners"] = frozenset(seg.owners)

    @property
    def tap(self) -> tuple[nn.Module, bool] | None:
        """The tap at the cut (None for the first stage)."""
        return self.taps[-1] if self.taps else None

    def forward(self, x: StageInput) -> object:
        return fx_stages.run_piece(self.piece, x)


def _generic_stages(model: nn.Module, owners: dict[str, nn.Module], records: list[_Record],
                    input_shape: tuple[int, ...]) -> tuple[list[tuple[str, nn.Module]],
                                                           list[int]]:
    """Stages of a model of no known family, cut from its fx graph at block boundaries
    (fx_stages), and each record's stage; one stage, the whole model, where the split
    does not trace, does not check out on a forward or splits a unit's runs."""
    leaves = {id(m) for m in owners.values() if _kind(m) != "scale"}
    leaves |= {id(m) for m in model.modules() if isinstance(m, StochasticDepth)}
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        segments = fx_stages.split(model, leaves)
        p = next(model.parameters())
        x = torch.randn(2, *input_shape, generator=torch.Generator().manual_seed(0),
                        dtype=p.dtype).to(p.device)
        bad = fx_stages.check_split(model, segments, x) if segments else [0]
        if segments and bad and 0 not in bad:  # without the cuts model(x) does not show
            segments = fx_stages.split(model, leaves, frozenset(segments[s].cut for s in bad))
            bad = fx_stages.check_split(model, segments, x) if segments else [0]
    finally:
        for m, mode in modes.items():
            m.training = mode
    whole = [("model", model)], [0] * len(records)
    if bad:
        log.debug("%s: its fx stages do not chain to its forward: one stage",
                  type(model).__name__)
        return whole
    stages = [(seg.name, _FxStage(seg, model)) for seg in segments]
    of = [next((s for s, (_n, st) in enumerate(stages) if r.name in st.owners), -1)
          for r in records]
    if -1 in of or any(a > b for a, b in itertools.pairwise(of)):
        log.debug("%s: a unit outside its fx stages or out of their order: one stage",
                  type(model).__name__)
        return whole
    return stages, of


def _stages_for(family: str, model: nn.Module) -> list[tuple[str, nn.Module]]:
    if family == "resnet":
        blocks = [(f"{ln}.{i}", b) for ln in ("layer1", "layer2", "layer3", "layer4")
                  if hasattr(model, ln) for i, b in getattr(model, ln).named_children()]
        return [("stem", _ResNetStem(model)), *blocks, ("head", _ResNetHead(model))]
    if family == "mobilenet":
        feats = [(f"features.{i}", f) for i, f in model.features.named_children()]
        return [*feats, ("head", _MobileNetHead(model))]
    layers = [(f"encoder.layers.{i}", b) for i, b in model.encoder.layers.named_children()]
    return [("stem", _ViTStem(model)), *layers, ("head", _ViTHead(model))]


def _family(model: nn.Module, arch: str | None) -> str:
    """resnet, mobilenet (V2) or vit by type; any other model: generic (fx stages)."""
    by_type = ("resnet" if isinstance(model, (ResNet, SmallResNet)) else
               "mobilenet" if isinstance(model, MobileNetV2) else
               "vit" if isinstance(model, VisionTransformer) else "generic")
    if arch is not None and _FAMILY.get(arch, by_type) != by_type:
        raise ValueError(f"arch {arch!r} does not match model type {type(model).__name__}")
    return by_type


def stage_input_hooks(staged: StagedModel, callback: Callable[[int, StageInput], None]
                      ) -> list:
    """Hooks that call callback(s, input of stage s) during model(x), for s >= 1.

    Stages that are real submodules get a forward pre-hook; wrapper stages (stem/head
    pieces) get their input from a forward hook on the previous stage's output; an fx
    stage that several values cross into gets one hook per value and the callback, with
    their tuple, from the last (at the cut). Returns the handles (call .remove() on each).
    """
    handles = []
    for st in staged.stages[1:]:
        s = st.index
        if isinstance(st.module, _FxStage):
            handles += _fx_stage_hooks(s, st.module.taps, callback)
            continue
        if not isinstance(st.module, _StageWrapper):
            handles.append(st.module.register_forward_pre_hook(
                lambda _m, args, s=s: callback(s, args[0])))
            continue
        prev = staged.stages[s - 1].module
        if isinstance(prev, _StageWrapper):
            raise ValueError(f"stages {s - 1} and {s} are both wrappers: input not observable")
        handles.append(prev.register_forward_hook(lambda _m, _a, out, s=s: callback(s, out)))
    return handles


def _fx_stage_hooks(s: int, taps: list[tuple[nn.Module, bool]],
                    callback: Callable[[int, StageInput], None]) -> list:
    """The hooks showing fx stage s's input: per tap, its value; the last calls back."""
    if len(taps) == 1:
        mod, pre = taps[0]
        return [mod.register_forward_pre_hook(lambda _m, args: callback(s, args[0])) if pre
                else mod.register_forward_hook(lambda _m, _a, out: callback(s, out))]
    parts: list[Tensor | None] = [None] * len(taps)

    def seen(k: int, t: Tensor) -> None:
        parts[k] = t
        if k == len(taps) - 1:
            got = tuple(parts)
            parts[:] = [None] * len(taps)  # not held past the forward
            # a stage piece run on its own (a reforward from a cached stage input calls the
            # shared layers, not model(x)) shows the cut's tap only: not a stage input
            if all(p is not None for p in got):
                callback(s, got)  # type: ignore[arg-type]
    handles = []
    for k, (mod, pre) in enumerate(taps):
        handles.append(mod.register_forward_pre_hook(lambda _m, args, k=k: seen(k, args[0]))
                       if pre else
                       mod.register_forward_hook(lambda _m, _a, out, k=k: seen(k, out)))
    return handles


# ---------------------------------------------------------------- unit costs
def _kind(mod: nn.Module) -> str:
    if isinstance(mod, nn.MultiheadAttention):
        return "attn"
    if isinstance(mod, nn.Conv2d):
        return "conv"
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, nn.BatchNorm2d):
        return "bn"
    if isinstance(mod, nn.LayerNorm):
        return "ln"
    if isinstance(mod, nn.GroupNorm):
        return "gn"
    if all(sum(d > 1 for d in p.shape) <= 1 for p in mod.parameters(recurse=False)):
        return "scale"  # a block's own per-channel vector (layer_scale): x * p
    raise ValueError(f"unsupported parameterised module type {type(mod).__name__}")


def _macs(kind: str, mod: nn.Module, x: Tensor, y: Tensor, part: str) -> tuple[int, int, int]:
    """(fwd, dx, dw) MACs per sample."""
    if kind == "conv":
        k = mod.kernel_size[0] * mod.kernel_size[1]
        f = k * mod.in_channels // mod.groups * mod.out_channels * y.shape[-1] * y.shape[-2]
        return f, f, f
    if kind == "linear":
        tokens = y[0].numel() // mod.out_features
        f = mod.in_features * mod.out_features * tokens
        return f, f, f
    if kind in NORM_UNIT_KINDS:
        n = y[0].numel()
        return 2 * n, 2 * n, 2 * n
    if kind == "scale":  # one multiply per output value
        n = y[0].numel()
        return n, n, n
    tokens, e = x.shape[1], mod.embed_dim  # attn (batch_first, as in torchvision ViT)
    if part == "in":
        proj = 3 * e * e * tokens
        scores = 2 * tokens * tokens * e  # QK^T and AV: non-parameterised, on this path
        return proj + scores, proj + scores, proj
    f = e * e * tokens
    return f, f, f


@dataclass
class _Record:
    name: str
    module: nn.Module
    kind: str
    part: str  # "" | "in" | "out"
    x: Tensor
    y: Tensor
    versions: tuple[int, int] = (0, 0)  # of x and y when the hook saw them


def _trace(model: nn.Module, owners: dict[str, nn.Module], input_shape) -> list[_Record]:
    """Execution order and shapes of the parameter-owning modules (batch 1)."""
    records: list[_Record] = []
    handles = []

    def post(name: str, mod: nn.Module, part: str) -> Callable:
        def hook(m, args, out):
            y = out[0] if isinstance(out, tuple) else out
            records.append(_Record(name, mod, _kind(mod), part, args[0][:1], y[:1],
                                   (args[0]._version, y._version)))
        return hook

    def pre_attn(name: str, mod: nn.Module) -> Callable:
        def hook(m, args):  # in-projection happens first: record it at the start
            records.append(_Record(name, mod, "attn", "in", args[0][:1], args[0][:1]))
        return hook

    for name, mod in owners.items():
        try:
            _kind(mod)
        except ValueError as exc:
            raise ValueError(f"unsupported parameterised module {name!r}: {exc}") from None
        if isinstance(mod, nn.MultiheadAttention):
            handles.append(mod.register_forward_pre_hook(pre_attn(name, mod)))
            handles.append(mod.register_forward_hook(post(name, mod, "out")))
        else:
            handles.append(mod.register_forward_hook(post(name, mod, "")))
    modes = {m: m.training for m in model.modules()}  # per module: BN may train alone
    model.eval()
    try:
        with torch.no_grad():
            p = next(model.parameters())
            # batch 2: BN without running stats normalises by the batch, which needs > 1
            # value per channel; records keep sample 0, so shapes are per sample
            model(torch.zeros(2, *input_shape, dtype=p.dtype, device=p.device))
    finally:
        for m, mode in modes.items():
            m.training = mode
        for h in handles:
            h.remove()
    return records


def _owners(model: nn.Module, special: list[nn.Parameter]) -> dict[str, nn.Module]:
    """Modules that directly own parameters (recurse=False) other than `special` ones."""
    ids = {id(p) for p in special}
    return {n: m for n, m in model.named_modules()
            if any(id(p) not in ids for p in m.parameters(recurse=False))}


def _unit_tensors(rec: _Record, extra: list[nn.Parameter]) -> list[nn.Parameter]:
    if rec.kind == "attn" and rec.part == "in":
        return [p for n, p in rec.module.named_parameters(recurse=False)
                if not n.startswith("out_proj")]
    if rec.kind == "attn":
        return list(rec.module.out_proj.parameters())
    return list(rec.module.parameters(recurse=False)) + extra


def _make_unit(i: int, rec: _Record, stage: int, tensors: list[nn.Parameter],
               flops: float, bw: float) -> Unit:
    fwd, dx, dw = _macs(rec.kind, rec.module, rec.x, rec.y, rec.part)
    n_params = sum(p.numel() for p in tensors)
    bytes_moved = 3 * _BYTES * (n_params + rec.x.numel() + rec.y.numel())  # fwd, dx, dw
    eta = ((fwd + dx + dw) / flops) / (bytes_moved / bw)
    suffix = {"in": ".in_proj", "out": ".out_proj"}.get(rec.part, "")
    return Unit(i, rec.name + suffix, rec.kind, stage, rec.module, n_params,
                int(fwd), int(dx), int(dw), int(bytes_moved), float(eta), tensors)


def _stage_of(name: str, stage_names: list[tuple[str, nn.Module]]) -> int:
    for s, (sname, _smod) in enumerate(stage_names):
        if name == sname or name.startswith(sname + "."):
            return s
    heads = ("fc", "classifier", "heads", "encoder.ln")
    return len(stage_names) - 1 if name.split(".")[0] in heads or name.startswith(heads) else 0


def decompose(model: nn.Module, input_shape: tuple[int, ...], arch: str | None = None,
              flops: float = DEFAULT_FLOPS, cache_bw: float = DEFAULT_CACHE_BW) -> StagedModel:
    """Split `model` into units (forward order) and stages; every parameter in one unit.
    `input_shape` is one sample at the model's input size (no default: unit costs are
    traced at it, and a 32 px model traced at 224 px would be costed 49x too high)."""
    family = _family(model, arch)
    # ViT class token and position embedding are owned by the patch-embedding unit
    special = [model.class_token, model.encoder.pos_embedding] if family == "vit" else []
    owners = _owners(model, special)
    if "" in owners:
        raise ValueError(f"model {type(model).__name__} owns parameters outside any layer")
    stage_list = _stages_for(family, model) if family != "generic" else []
    records = _trace(model, owners, input_shape)
    if family == "generic":
        stage_list, stage_of = _generic_stages(model, owners, records, tuple(input_shape))
    else:
        stage_of = [_stage_of(rec.name, stage_list) for rec in records]
    units: list[Unit] = []
    for rec, stage in zip(records, stage_of, strict=True):
        tensors = _unit_tensors(rec, special if rec.name == "conv_proj" else [])
        units.append(_make_unit(len(units), rec, stage, tensors, flops, cache_bw))
    _check_coverage(model, units)
    for u, producer, replayable in zip(units, _producers(records), _replayable(records),
                                       strict=True):
        u.producer, u.replayable = producer, replayable
    stages = _build_stages(stage_list, units)
    return StagedModel(arch or family, model, stages, units, tuple(input_shape))


def _producers(records: list[_Record]) -> list[int | None]:
    """Per record: the one just before it in execution order when its output is this
    one's input, unchanged (same storage, shape and strides, not modified in place since:
    a conv feeding its BN); None otherwise, for a module that runs more than once and for
    a scale unit (not replayable)."""
    runs: dict[int, int] = {}
    for r in records:
        runs[id(r.module)] = runs.get(id(r.module), 0) + 1
    out: list[int | None] = [None] * len(records)
    for i, (prev, rec) in enumerate(itertools.pairwise(records), start=1):
        if (prev.part == rec.part == "" and runs[id(prev.module)] == 1 and prev.kind != "scale"
                and prev.y.data_ptr() == rec.x.data_ptr() and prev.y.shape == rec.x.shape
                and prev.y.stride() == rec.x.stride() and prev.versions[1] == rec.versions[0]):
            out[i] = i - 1
    return out


def _replayable(records: list[_Record]) -> list[bool]:
    """Per record: its module runs once, as one call (no attention halves), and its output
    was not modified in place after the call (by the end of the traced forward: an in-place
    ReLU or `out += identity` on it would make a replayed copy wrong). Not a scale unit:
    its module is a block whose fx stage runs its pieces, not the block."""
    runs: dict[int, int] = {}
    for r in records:
        runs[id(r.module)] = runs.get(id(r.module), 0) + 1
    return [r.part == "" and runs[id(r.module)] == 1 and r.y._version == r.versions[1]
            and r.kind != "scale" for r in records]


def _check_coverage(model: nn.Module, units: list[Unit]) -> None:
    seen: dict[int, str] = {}
    for u in units:
        for p in u.tensors:
            if id(p) in seen:
                raise ValueError(f"parameter in two units: {seen[id(p)]} and {u.name}")
            seen[id(p)] = u.name
    missing = [n for n, p in model.named_parameters() if id(p) not in seen]
    if missing:
        raise ValueError(f"parameters not covered by any unit (module never ran?): {missing}")


def _build_stages(stage_list: list[tuple[str, nn.Module]], units: list[Unit]) -> list[Stage]:
    if any(a.stage > b.stage for a, b in itertools.pairwise(units)):
        raise ValueError("unit stages are not in forward order")
    stages: list[Stage] = []
    for s, (name, mod) in enumerate(stage_list):
        idx = [u.index for u in units if u.stage == s]
        if idx and idx != list(range(idx[0], idx[0] + len(idx))):
            raise ValueError(f"stage {name!r} has non-contiguous units {idx}")
        first = idx[0] if idx else (stages[-1].first_unit + stages[-1].n_units if stages else 0)
        stages.append(Stage(s, name, mod, first, len(idx)))
    return stages
