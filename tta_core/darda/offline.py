"""DARDA's offline phase (§3, §4.1-4.3): everything the online phase bootstraps from.

From a source model and labelled images of the d_s training corruptions:
- one sub-network per corruption (§3 (i)-(ii)): the BN layers (affine + running
  statistics) and the final dense layer; running statistics re-estimated on the
  corruption's images (cumulative average), then the BN affine and the dense layer
  fine-tuned on the labels (cross-entropy, Adam, BN in eval mode);
- the corruption extractor g and encoder h (Eqs. 3-8, tta_core.darda.encoder; a trained
  one can be reused), and the encoder without extractor for Table 2's first row;
- the corruption centroids C^j (normalised mean projection of corruption j's images);
- the accuracy matrix a_ij of sub-network i on fresh images of corruption j;
- the fingerprints F^i on the fixed Gaussian noise and the sub-network encoder S trained
  on Eq. 13 (tta_core.darda.subnet), one S per latent space (with and without extractor).

Everything goes into one bundle (tta_core.darda.bundle).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from tta_core.darda.bank import adapted_tensors, last_linear
from tta_core.darda.encoder import (
    CorruptionEncoder,
    EncoderConfig,
    RawCorruptionEncoder,
    train_encoder,
)
from tta_core.darda.subnet import (
    SubnetEncoder,
    SubnetEncoderConfig,
    closest,
    fingerprint,
    noise_batch,
    subnet_loss,
)
from tta_core.data.corruptions import CORRUPTIONS
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.streams import StreamSpec, build_stream


@dataclass
class OfflineConfig:
    """Offline-phase settings (stored in the bundle's metadata)."""

    corruptions: tuple[str, ...] = CORRUPTIONS
    samples: int = 256  # labelled training images per corruption
    eval_samples: int = 128  # fresh images per corruption for a_ij
    severity: int = 5
    seed: int = 101  # not the benchmark's stream seeds (0-3) nor the encoder's (11)
    epochs: int = 10  # sub-network fine-tuning passes
    batch: int = 32
    lr: float = 5e-3
    noise_count: int = 4  # fixed Gaussian-noise images for the fingerprint
    noise_seed: int = 7
    s_hidden: int = 64
    s_steps: int = 800
    s_lr: float = 5e-3
    lambda_r: float = 0.5
    encoder_steps: int = 200
    threads: int = 2

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for name in ("samples", "eval_samples", "epochs", "batch", "noise_count", "s_hidden",
                     "s_steps", "encoder_steps", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"train-darda {name}={getattr(self, name)} must be >= 1")
        if len(self.corruptions) < 2:
            raise ValueError(f"train-darda needs >= 2 corruptions, got {self.corruptions}")
        if not 0 < self.lambda_r < 1 or self.lr <= 0 or self.s_lr <= 0:
            raise ValueError(f"train-darda lambda_r {self.lambda_r} (in (0, 1)), lr {self.lr}, "
                             f"s_lr {self.s_lr} (> 0) out of range")


@dataclass
class Labelled:
    """Normalised images, class labels and corruption indices."""

    x: Tensor
    y: Tensor
    d: Tensor


@dataclass
class Offline:
    """What the offline phase produced (saved by tta_core.darda.bundle)."""

    names: list[str]
    states: dict[str, dict[str, Tensor]]
    accuracy: Tensor  # a_ij [d_s, d_s]
    noise: Tensor
    fingerprints: Tensor  # F^i [d_s, noise_count x classes]
    encoder: CorruptionEncoder
    raw_encoder: CorruptionEncoder
    centroids: Tensor  # C^j with the extractor [d_s, dim]
    raw_centroids: Tensor
    s: SubnetEncoder
    raw_s: SubnetEncoder
    report: dict = field(default_factory=dict)


def render(cfg: OfflineConfig, n: int, seed: int, size: int, mean: tuple[float, ...],
           std: tuple[float, ...]) -> Labelled:
    """n images per training corruption (severity cfg.severity), normalised."""
    stream = build_stream(StreamSpec(order="continual", corruptions=cfg.corruptions,
                                     samples_per_domain=n, severity=cfg.severity, seed=seed,
                                     image_size=size))
    names = [d.split("/")[0] for d in stream.domains.tolist()]
    d = torch.tensor([cfg.corruptions.index(k) for k in names])
    return Labelled(images_to_tensor(stream.images, mean, std),
                    torch.as_tensor(stream.labels, dtype=torch.long), d)


def _load(live: dict[str, Tensor], state: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for k, t in live.items():
            t.copy_(state[k])


def _bn_statistics(model: nn.Module, x: Tensor, batch: int) -> None:
    """Running statistics := the cumulative average over x's batches (PyTorch momentum None)."""
    bns = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    with torch.no_grad():
        for i in range(0, len(x), batch):
            model(x[i:i + batch])
    for m, (mom, nbt) in zip(bns, saved, strict=True):
        m.momentum = mom
        m.num_batches_tracked.copy_(nbt)  # the model's fingerprint stays the source's
        m.eval()


def fit_subnetwork(model: nn.Module, live: dict[str, Tensor], source: dict[str, Tensor],
                   data: Labelled, cfg: OfflineConfig, seed: int) -> dict[str, Tensor]:
    """One sub-network: the source state, BN statistics of `data`, then BN affine + final
    dense layer fine-tuned on its labels. Returns a copy of the state."""
    _load(live, source)
    _bn_statistics(model, data.x, cfg.batch)
    params = [t for k, t in live.items() if k.endswith((".weight", ".bias"))]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(cfg.epochs):
        perm = torch.randperm(len(data.x), generator=g)
        for i in range(0, len(perm), cfg.batch):
            idx = perm[i:i + cfg.batch]
            loss = F.cross_entropy(model(data.x[idx]), data.y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    for p in params:
        p.requires_grad_(False)
    return {k: t.detach().clone() for k, t in live.items()}


def accuracy_matrix(model: nn.Module, live: dict[str, Tensor], states: list[dict[str, Tensor]],
                    data: Labelled, batch: int = 256) -> Tensor:
    """a_ij: accuracy of sub-network i (row per state) on the images of corruption j."""
    d_s = int(data.d.max()) + 1
    a = torch.zeros(len(states), d_s, dtype=torch.float64)
    with torch.no_grad():
        for i, state in enumerate(states):
            _load(live, state)
            pred = torch.cat([model(data.x[k:k + batch]).argmax(1)
                              for k in range(0, len(data.x), batch)])
            for j in range(d_s):
                sel = data.d == j
                a[i, j] = (pred[sel] == data.y[sel]).double().mean()
    return a


def centroids(enc: CorruptionEncoder, data: Labelled, d_s: int, batch: int = 256) -> Tensor:
    """C^j: the normalised mean projection of corruption j's images."""
    with torch.no_grad():
        proj = torch.cat([enc(data.x[k:k + batch]) for k in range(0, len(data.x), batch)])
    return F.normalize(torch.stack([proj[data.d == j].mean(0) for j in range(d_s)]), dim=1)


def fingerprints(model: nn.Module, live: dict[str, Tensor], states: list[dict[str, Tensor]],
                 noise: Tensor) -> Tensor:
    """F^i of every sub-network on the fixed noise (eval mode)."""
    out = []
    with torch.no_grad():
        for state in states:
            _load(live, state)
            out.append(fingerprint(model, noise))
    return torch.stack(out)


def train_s(fps: Tensor, cents: Tensor, acc: Tensor, cfg: OfflineConfig
            ) -> tuple[SubnetEncoder, dict]:
    """S trained on Eq. 13; report: first and last loss, share of corruptions whose own
    sub-network Eq. 10 picks from the centroid."""
    torch.manual_seed(cfg.seed)
    s = SubnetEncoder(SubnetEncoderConfig(fps.shape[1], cents.shape[1], cfg.s_hidden))
    opt = torch.optim.Adam(s.parameters(), lr=cfg.s_lr)
    acc32, first = acc.float(), None
    for _ in range(cfg.s_steps):
        loss = subnet_loss(s(fps), cents, acc32, cfg.lambda_r)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    s.eval().requires_grad_(False)
    sig = s(fps)
    own = sum(closest(sig, cents[j]) == j for j in range(len(cents))) / len(cents)
    return s, {"first_loss": first, "loss": float(loss.detach()), "own_pick": own}


def run_offline(model: nn.Module, size: int, mean: tuple[float, ...], std: tuple[float, ...],
                cfg: OfflineConfig, encoder: CorruptionEncoder | None = None,
                log: bool = False, raw_encoder: CorruptionEncoder | None = None) -> Offline:
    """The whole offline phase on `model` (its tensors are restored afterwards); `encoder`,
    `raw_encoder`: trained ones to reuse (default: trained here)."""
    cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    try:
        return _offline(model, size, mean, std, cfg, (encoder, raw_encoder), log, t0)
    finally:
        model.load_state_dict(saved)
        model.eval()
        torch.set_num_threads(threads)


def _only(data: Labelled, j: int) -> Labelled:
    sel = data.d == j
    return Labelled(data.x[sel], data.y[sel], data.d[sel])


def _say(log: bool, t0: float, msg: str) -> None:
    if log:
        print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)


def _offline(model: nn.Module, size: int, mean: tuple[float, ...], std: tuple[float, ...],
             cfg: OfflineConfig,
             encoders: tuple[CorruptionEncoder | None, CorruptionEncoder | None], log: bool,
             t0: float) -> Offline:
    model.eval().requires_grad_(False)
    train = render(cfg, cfg.samples, cfg.seed, size, mean, std)
    held = render(cfg, cfg.eval_samples, cfg.seed + 1, size, mean, std)
    _say(log, t0, f"rendered {len(train.x)} + {len(held.x)} images")
    live = adapted_tensors(model)
    source = {k: v.detach().clone() for k, v in live.items()}
    states = [fit_subnetwork(model, live, source, _only(train, j), cfg, cfg.seed + j)
              for j in range(len(cfg.corruptions))]
    _say(log, t0, f"{len(states)} sub-networks fine-tuned")
    acc = accuracy_matrix(model, live, states, held)
    noise = noise_batch(tuple(train.x.shape[1:]), cfg.noise_count, cfg.noise_seed)
    fps = fingerprints(model, live, states, noise)
    ecfg = EncoderConfig(steps=cfg.encoder_steps, samples=cfg.samples, threads=cfg.threads)
    enc_data = (train.x, train.d)
    encoder, raw = encoders
    if encoder is None:
        encoder, _ = train_encoder(ecfg, mean, std, data=enc_data)
    if raw is None:
        raw, _ = train_encoder(replace(encoder.config, lambda_e=0.0, steps=cfg.encoder_steps),
                               mean, std, cls=RawCorruptionEncoder, data=enc_data)
    _say(log, t0, "corruption encoders ready")
    d_s = len(cfg.corruptions)
    cents, raw_cents = centroids(encoder, train, d_s), centroids(raw, train, d_s)
    s, s_rep = train_s(fps, cents, acc, cfg)
    raw_s, raw_rep = train_s(fps, raw_cents, acc, cfg)
    _say(log, t0, f"S trained: own pick {s_rep['own_pick']:.2f} (raw {raw_rep['own_pick']:.2f})")
    report = {"seconds": time.perf_counter() - t0, "s": s_rep, "raw_s": raw_rep,
              "own_accuracy": acc.diagonal().tolist(),
              "source_accuracy": _source_accuracy(model, live, source, held),
              "classifier": last_linear(model)}
    return Offline(list(cfg.corruptions), dict(zip(cfg.corruptions, states, strict=True)),
                   acc, noise, fps, encoder.eval(), raw.eval(), cents, raw_cents, s, raw_s,
                   report)


def _source_accuracy(model: nn.Module, live: dict[str, Tensor], source: dict[str, Tensor],
                     held: Labelled) -> list[float]:
    """Accuracy of the source state per training corruption (the baseline of a_ii)."""
    return accuracy_matrix(model, live, [source], held)[0].tolist()
