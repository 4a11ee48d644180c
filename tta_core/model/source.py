"""Train the source model and describe it with a model card.

Training data: the built-in clean synthetic signs, or a CIFAR-10-C layout folder's clean
splits (`TrainConfig.data = "cifar10c:DIR"`: DIR/train.npy and train_labels.npy to train
on, DIR/test.npy and test_labels.npy to measure the card's clean accuracy; what
`tta make-benchmark` writes). Training saves its whole state (weights, optimizer,
schedule, random generator) after every epoch to `<out>.train.safetensors`; a run started
again with the same configuration resumes after the last finished epoch, so a long run
can be stopped at any point. The state file is removed once the card is written.

The card (JSON next to the checkpoint) is what every consumer reads: architecture, classes,
input size and normalisation, clean accuracy, seed. The architecture is a tta arch, a
torchvision model name or a user's factory `package.module:function` with its kwargs
(tta_core.model.arch); `tta model-card` writes a card for a user's model and weights.
Checkpoints are plain state_dicts, always loaded with `torch.load(weights_only=True)`, or
`.safetensors` files (tta_core.model.weights).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import make_signs
from tta_core.errors import InputError, require_file
from tta_core.io.shipped import require_data_file
from tta_core.io.strict_json import dumps as json_dumps
from tta_core.model.arch import build_architecture, check_arch
from tta_core.model.weights import load_into, load_state_dict
from tta_core.model.zoo import build_model

__all__ = ["CARD_SCHEMA", "ModelCard", "TrainConfig", "build_card_model", "find_card",
           "load_card", "load_model", "load_source", "load_state_dict", "save_card",
           "train_source", "train_state_path", "training_data"]

CARD_SCHEMA = "tta.model_card/1"
TASKS: tuple[str, ...] = ("classification", "segmentation")


@dataclass
class ModelCard:
    """What a consumer needs to run a source checkpoint."""

    arch: str
    num_classes: int
    class_names: list[str]
    image_size: int
    mean: list[float]
    std: list[float]
    checkpoint: str  # weights file: relative to the card's folder, or absolute
    clean_accuracy: float = float("nan")  # segmentation cards: the clean val mIoU
    seed: int = 0
    epochs: int = 0
    train_samples: int = 0
    torch_version: str = torch.__version__
    name: str = ""
    schema: str = CARD_SCHEMA
    # '' (arch names a tta or torchvision model) or 'package.module:function' called with
    # `kwargs` exactly; arch then only names the architecture
    factory: str = ""
    kwargs: dict = field(default_factory=dict)  # JSON keyword arguments of the builder
    data: str = ""  # what it was trained on: '' (the built-in signs) or 'cifar10c:DIR'
    # classification: logits N x C; segmentation: N x C x H x W, class_names are train ids
    task: str = "classification"
    image_height: int = 0  # input rows when not square (image_size is then the width)

    def validate(self) -> None:
        """ValueError naming the first inconsistent field."""
        if self.schema != CARD_SCHEMA:
            raise ValueError(f"schema {self.schema!r}, expected {CARD_SCHEMA!r}")
        check_arch(self.arch, self.factory, self.kwargs)
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"class_names lists {len(self.class_names)} names for "
                             f"num_classes={self.num_classes}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError(f"mean/std must be 3 values, std > 0: {self.mean}, {self.std}")
        if self.image_size < 8 or 0 < self.image_height < 8 or self.image_height < 0:
            raise ValueError(f"image_size {self.image_size} / image_height "
                             f"{self.image_height} too small (>= 8; height 0: square)")
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r}: choose from {', '.join(TASKS)}")

    @property
    def input_hw(self) -> tuple[int, int]:
        """(rows, columns) the model reads."""
        return (self.image_height or self.image_size, self.image_size)


@dataclass
class TrainConfig:
    """Source training on CPU in minutes (defaults: small_resnet, 32 px, built-in signs).

    With `data` ('cifar10c:DIR') the sample counts cap the folder's splits (0: all rows)."""

    arch: str = "small_resnet"
    image_size: int = 32
    epochs: int = 6
    train_samples: int = 8000
    val_samples: int = 1000
    data: str = ""
    batch_size: int = 128
    lr: float = 0.05
    weight_decay: float = 5e-4
    seed: int = 0
    threads: int = 2  # torch threads (0: torch default)
    pad: int = 2  # random-translation augmentation (no test corruption is used)
    extra: dict = field(default_factory=dict)


def _augment(x: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    """Random translations by up to `pad` px (reflect padding); nothing else, so the test
    corruptions stay unseen (no flips either: they would swap turn_left and turn_right)."""
    if pad <= 0:
        return x
    n, _, h, w = x.shape
    xp = nn.functional.pad(x, (pad, pad, pad, pad), mode="reflect")
    dy = torch.randint(0, 2 * pad + 1, (n, 1, 1), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (n, 1, 1), generator=gen)
    rows = dy + torch.arange(h).view(1, h, 1)
    cols = dx + torch.arange(w).view(1, 1, w)
    return xp[torch.arange(n).view(n, 1, 1), :, rows, cols].permute(0, 3, 1, 2)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> float:
    """Top-1 accuracy of `model` (eval mode) on tensors x, y."""
    model.eval()
    hits = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
               for i in range(0, len(y), batch))
    return hits / max(len(y), 1)


Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]


def training_data(cfg: TrainConfig, progress: bool = False) -> Split:
    """(train images, labels, validation images, labels, class names) of `cfg`."""
    if not cfg.data:
        train = make_signs(cfg.train_samples, cfg.image_size, seed=cfg.seed, progress=progress)
        val = make_signs(cfg.val_samples, cfg.image_size, seed=cfg.seed + 10_000,
                         progress=progress)
        return train.images, train.labels, val.images, val.labels, train.class_names
    from tta_core.data.loaders import cifar_class_names
    from tta_core.data.sources import resize_images

    kind, _, root = cfg.data.partition(":")
    if kind != "cifar10c" or not root:
        raise InputError(f"--data {cfg.data!r}: expected cifar10c:DIR (a folder with "
                         "train.npy, train_labels.npy, test.npy, test_labels.npy)")
    folder = Path(root).expanduser()
    arrays = []
    for stem, cap in (("train", cfg.train_samples), ("test", cfg.val_samples)):
        imgs = _npy(folder / f"{stem}.npy", cfg.data)
        labs = _npy(folder / f"{stem}_labels.npy", cfg.data).astype(np.int64)
        if imgs.ndim != 4 or imgs.shape[-1] != 3 or imgs.dtype != np.uint8 \
                or len(imgs) != len(labs):
            raise InputError(f"--data {cfg.data!r}: {stem}.npy {imgs.shape} {imgs.dtype} with "
                             f"{len(labs)} labels; expected (N, H, W, 3) uint8 and N labels")
        take = len(labs) if cap <= 0 else min(cap, len(labs))
        arrays += [resize_images(np.array(imgs[:take]), cfg.image_size), labs[:take]]
    names = cifar_class_names(folder)
    top = int(max(arrays[1].max(), arrays[3].max()))
    if top >= len(names) or min(arrays[1].min(), arrays[3].min()) < 0:
        raise InputError(f"--data {cfg.data!r}: labels reach {top}, but {len(names)} class "
                         "names are known (meta.json's class_names, else CIFAR-10's)")
    return arrays[0], arrays[1], arrays[2], arrays[3], names


def _npy(path: Path, data: str) -> np.ndarray:
    if not path.is_file():
        raise InputError(f"--data {data!r}: {path.name} not found in {str(path.parent)!r}")
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _config_json(cfg: TrainConfig) -> str:
    return json.dumps(asdict(cfg), sort_keys=True)


def train_state_path(out: Path) -> Path:
    """Where `train_source(cfg, out)` keeps its per-epoch state."""
    return Path(out).with_suffix(".train.safetensors")


def _save_state(path: Path, cfg: TrainConfig, epoch: int, model: nn.Module,
                opt: torch.optim.Optimizer, sched: Any, gen: torch.Generator,
                history: list[dict]) -> None:
    """Weights, momentum buffers and generator state as tensors; the rest as metadata."""
    import safetensors.torch

    tensors = {f"model/{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt/{i}/{k}"] = v.contiguous()
    tensors["generator"] = gen.get_state()
    meta = {"config": _config_json(cfg), "epoch": str(epoch), "history": json.dumps(history),
            "scheduler": json.dumps(sched.state_dict()),
            "param_groups": json.dumps([{k: v for k, v in g.items() if k != "params"}
                                        for g in opt.state_dict()["param_groups"]])}
    tmp = path.with_name(path.name + ".tmp")
    safetensors.torch.save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def _load_state(path: Path, cfg: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer,
                sched: Any, gen: torch.Generator) -> tuple[int, list[dict]]:
    """Restore a saved state into the live objects; (epochs done, history)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("config") != _config_json(cfg):
        raise InputError(f"training state {str(path)!r} was made with another configuration "
                         f"({meta.get('config')}); delete it or write to another --out")
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model/")})
    state = opt.state_dict()
    for key, v in tensors.items():
        if key.startswith("opt/"):
            _, i, name = key.split("/", 2)
            state["state"].setdefault(int(i), {})[name] = v
    for group, saved in zip(state["param_groups"], json.loads(meta["param_groups"]),
                            strict=True):
        group.update(saved)
    opt.load_state_dict(state)
    sched.load_state_dict(json.loads(meta["scheduler"]))
    gen.set_state(tensors["generator"])
    return int(meta["epoch"]), json.loads(meta["history"])


def resume(out: Path, cfg: Any, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
           gen: torch.Generator, log: Callable[[str], None] | None = None
           ) -> tuple[Path, int, list[dict]]:
    """(state path, epochs done, history): the live objects restored from `out`'s training
    state when there is one (its folder made when not)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    state_path = train_state_path(out)
    if not state_path.is_file():
        return state_path, 0, []
    done, history = _load_state(state_path, cfg, model, opt, sched, gen)
    if log:
        log(f"resumed {state_path} after epoch {done} of {cfg.epochs}")
    return state_path, done, history


def _epoch(model: nn.Module, xtr: torch.Tensor, ytr: torch.Tensor, cfg: TrainConfig,
           opt: torch.optim.Optimizer, sched: Any, gen: torch.Generator,
           step_done: Callable[[float], object]) -> float:
    """One epoch of SGD over a fresh permutation; the mean training loss."""
    model.train()
    perm = torch.randperm(len(ytr), generator=gen)
    total = 0.0
    for i in range(0, len(ytr), cfg.batch_size):
        idx = perm[i:i + cfg.batch_size]
        loss = nn.functional.cross_entropy(model(_augment(xtr[idx], cfg.pad, gen)), ytr[idx])
        value = optimizer_step(loss, opt, sched)
        total += value * len(idx)
        step_done(value)
    return total / len(ytr)


def optimizer_step(loss: torch.Tensor, opt: torch.optim.Optimizer, sched: Any) -> float:
    """Backward, optimizer step and schedule step; the loss as a float."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def train_source(cfg: TrainConfig, out: Path, progress: bool = True,
                 log: Callable[[str], None] | None = None) -> ModelCard:
    """Train (resuming from `<out>.train.safetensors` when present), evaluate on the
    held-out split, save `<out>.pt` + `<out>.json`; return the card. `log` receives one
    line per finished epoch."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    images, labels, val_images, val_labels, names = training_data(cfg, progress)
    flat = images.reshape(-1, 3).astype(np.float64) / 255.0
    mean, std = flat.mean(0).tolist(), flat.std(0).tolist()
    xtr, ytr = images_to_tensor(images, mean, std), torch.from_numpy(labels)
    xva, yva = images_to_tensor(val_images, mean, std), torch.from_numpy(val_labels)
    model = build_model(cfg.arch, len(names))
    steps = cfg.epochs * -(-len(ytr) // cfg.batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, nesterov=True,
                          weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps)
    gen = torch.Generator().manual_seed(cfg.seed)
    out = Path(out)
    state_path, done, history = resume(out, cfg, model, opt, sched, gen, log)
    bar = _progress(steps, progress)
    bar.update(done * -(-len(ytr) // cfg.batch_size))
    for epoch in range(done, cfg.epochs):

        def tick(v: float, e: int = epoch + 1) -> None:
            bar.update(1)
            bar.set_postfix(epoch=e, loss=f"{v:.3f}")

        loss = _epoch(model, xtr, ytr, cfg, opt, sched, gen, tick)
        history.append({"epoch": epoch + 1, "loss": loss,
                        "val_accuracy": accuracy(model, xva, yva)})
        _save_state(state_path, cfg, epoch + 1, model, opt, sched, gen, history)
        if log:
            log(f"epoch {epoch + 1}/{cfg.epochs}: loss {history[-1]['loss']:.4f}, held-out "
                f"accuracy {history[-1]['val_accuracy']:.4f} (state in {state_path})")
    bar.close()
    card = ModelCard(arch=cfg.arch, num_classes=len(names), class_names=list(names),
                     image_size=cfg.image_size, mean=mean, std=std,
                     checkpoint=out.with_suffix(".pt").name,
                     clean_accuracy=accuracy(model, xva, yva), seed=cfg.seed,
                     epochs=cfg.epochs, train_samples=len(ytr),
                     name=out.stem if cfg.data else f"{cfg.arch}_signs{cfg.image_size}",
                     data=cfg.data)
    torch.save(model.state_dict(), out.with_suffix(".pt"))
    save_card(card, out.with_suffix(".json"))
    state_path.unlink(missing_ok=True)
    return card


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="train-source", unit="step", disable=not enabled)


def save_card(card: ModelCard, path: Path) -> None:
    """Write the card as JSON (atomically: temp file then rename)."""
    card.validate()
    tmp = Path(path).with_suffix(".json.tmp")
    tmp.write_text(json_dumps(asdict(card), indent=1) + "\n")
    tmp.replace(path)


# JSON type of each card field (the dataclass annotations, as strings)
_JSON_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    "dict": ("a JSON object", lambda v: isinstance(v, dict)),
    "list[str]": ("a list of strings",
                  lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "list[float]": ("a list of numbers", lambda v: isinstance(v, list) and all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in v)),
}


def _card_fields(raw: Any) -> str:
    """'' when `raw` (parsed JSON) has exactly the card's fields with their types, else
    what is wrong (names the field and the value)."""
    if not isinstance(raw, dict):
        return f"expected a JSON object, got {type(raw).__name__}"
    fields = ModelCard.__dataclass_fields__
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        return f"unknown field(s) {unknown}"
    missing = [n for n, f in fields.items() if n not in raw and f.default is MISSING
               and f.default_factory is MISSING]
    if missing:
        return f"missing field(s) {missing}"
    for name, value in raw.items():
        what, ok = _JSON_TYPES[str(fields[name].type)]
        if not ok(value):
            return f"{name} must be {what}, got {value!r}"
    return ""


def find_card(path: str | Path) -> Path:
    """Where the model card `path` is (tta_core.io.shipped: the working directory, the
    source checkout, the installed share folder); FileNotFoundError naming every place."""
    return require_data_file(path, "model card", "make one with `tta train-source` or "
                             "`tta model-card`")


def load_card(path: str | Path) -> ModelCard:
    """Read and validate a model card (a relative path is looked up by find_card);
    InputError naming the file and the bad field."""
    path = find_card(path)
    require_file(path, f"model card {str(path)!r}", f"model card {str(path)!r} not found")
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"model card {path} is not valid JSON ({exc})") from None
    if isinstance(raw, dict):  # strict JSON (tta_core.io.strict_json) writes NaN as null
        floats = {n for n, f in ModelCard.__dataclass_fields__.items() if str(f.type) == "float"}
        raw = {k: float("nan") if v is None and k in floats else v for k, v in raw.items()}
    problem = _card_fields(raw)
    if problem:
        raise InputError(f"model card {path}: {problem}")
    card = ModelCard(**raw)
    try:
        card.validate()
    except ValueError as exc:
        raise InputError(f"model card {path}: {exc}") from None
    return card


def build_card_model(card: ModelCard) -> nn.Module:
    """The card's architecture with random weights (its arch, or its factory and kwargs);
    a segmentation model answering with a dict (torchvision's {"out": ...}) answers with
    its "out" tensor (a forward hook: the state_dict keys stay the model's own)."""
    model = build_architecture(card.arch, card.num_classes, card.factory, card.kwargs)
    if card.task == "segmentation":
        model.register_forward_hook(_segmentation_logits)
    return model


def _segmentation_logits(module: nn.Module, inputs: Any, output: Any) -> Any:
    """Forward hook: a dict output's "out" logits (None: the output stands)."""
    if not isinstance(output, dict):
        return None
    if "out" not in output:
        raise InputError(f"{type(module).__name__} returned a dict without 'out' (keys "
                         f"{sorted(map(str, output))[:5]}): segmentation logits expected")
    return output["out"]


def load_model(card: ModelCard, base_dir: str | Path = ".",
               device: str | torch.device = "cpu") -> nn.Module:
    """The card's model in eval mode with its checkpoint's weights (a relative checkpoint
    is found in `base_dir`, the card's folder); InputError naming the mismatching keys."""
    ckpt = Path(base_dir) / card.checkpoint
    require_file(ckpt, f"checkpoint {str(ckpt)!r} named by the card",
                 f"checkpoint {str(ckpt)!r} named by the card is missing")
    model = build_card_model(card)
    what = (f"checkpoint {str(ckpt)!r} does not fit arch {card.arch!r}"
            + (f" (factory {card.factory})" if card.factory else "")
            + f" with {card.num_classes} classes")
    load_into(model, load_state_dict(ckpt), what)
    return model.to(device).eval()


def load_source(card_path: str | Path, device: str | torch.device = "cpu"
                ) -> tuple[nn.Module, ModelCard]:
    """(model in eval mode with the source weights, its card); weights_only loading. What
    the bench, the perception node and the replay load a card with."""
    path = find_card(card_path)
    card = load_card(path)
    return load_model(card, path.parent, device), card
