"""DARDA's offline phase (§3, §4.1-4.3): everything the online phase bootstraps from.

From a source model and labelled images of the d_s training corruptions:
- one sub-network per corruption (§3 (i)-(ii)): the BN layers (affine + running
  statistics) and the final dense layer; running statistics re-estimated on the
  corruption's images (cumulative average), then the BN affine and the dense layer
  fine-tuned on the labels (cross-entropy, Adam, BN in eval mode);
- the corruption extractor g and encoder h (Eqs. 3-8: the network tta_core.domain.encoder,
  its training tta_core.darda.encoder; a trained one can be reused), and the encoder
  without extractor for Table 2's first row;
- the corruption centroids C^j (normalised mean projection of corruption j's images);
- the accuracy matrix a_ij of sub-network i on fresh images of corruption j;
- the fingerprints F^i on the fixed Gaussian noise and the sub-network encoder S trained
  on Eq. 13 (tta_core.darda.subnet; Eq. 9's pairs: `cm_pairs`), one S per latent space
  (with and without extractor);
- the Eq. 16 probe (`eq16_probe`): on each evaluation batch of each training corruption,
  the sub-network Eq. 10 picks from the batch's signature (and, for comparison, the one of
  the nearest centroid), Eq. 16's loss against its floor and its gradient norm w.r.t. the
  adapted parameters there (the online step's start).

The labelled images are the built-in signs rendered under the training corruptions, or a
folder's (tta_core.darda.offline_data: `run_offline(..., data=folder_data(...))`).
Everything goes into one bundle (tta_core.darda.bundle), with the config, the data's
source and the report.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from tta_core.darda.encoder import train_encoder
from tta_core.darda.offline_data import (
    Labelled,
    OfflineData,
    check_training_corruptions,
    rendered_data,
)
from tta_core.darda.subnet import (
    PAIRS,
    SubnetEncoder,
    SubnetEncoderConfig,
    closest,
    cm_loss,
    eq16_gradient,
    fingerprint,
    noise_batch,
    subnet_loss,
)
from tta_core.data.corruptions import ALL_CORRUPTIONS, CORRUPTIONS
from tta_core.domain.bank import adapted_tensors, last_linear
from tta_core.domain.encoder import CorruptionEncoder, EncoderConfig, RawCorruptionEncoder

__all__ = ["Labelled", "Offline", "OfflineConfig", "OfflineData", "run_offline"]


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
    # Eq. 9's pairs (tta_core.darda.subnet.PAIRS): i = j, because the printed i != j pulls
    # S^i away from its own centroid and Eq. 10's pick over the S^i then never chooses
    # the corruption's own sub-network; "off_diagonal" is the printed reading
    cm_pairs: str = "diagonal"
    probe_batch: int = 64  # evaluation images per batch of the Eq. 16 probe

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for name in ("samples", "eval_samples", "epochs", "batch", "noise_count", "s_hidden",
                     "s_steps", "encoder_steps", "threads", "probe_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"train-darda {name}={getattr(self, name)} must be >= 1")
        if len(self.corruptions) < 2 or len(set(self.corruptions)) != len(self.corruptions):
            raise ValueError(f"train-darda needs >= 2 distinct corruptions, got "
                             f"{self.corruptions}")
        unknown = [c for c in self.corruptions if c not in ALL_CORRUPTIONS]
        if unknown:
            raise ValueError(f"train-darda: unknown corruption {unknown[0]!r}; choose from "
                             f"{', '.join(CORRUPTIONS)}")
        check_training_corruptions(self.corruptions)
        if self.severity not in range(1, 6):
            raise ValueError(f"train-darda severity {self.severity} not in 1..5")
        if self.cm_pairs not in PAIRS:
            raise ValueError(f"train-darda cm_pairs {self.cm_pairs!r} not in {PAIRS}")
        if not 0 < self.lambda_r < 1 or self.lr <= 0 or self.s_lr <= 0:
            raise ValueError(f"train-darda lambda_r {self.lambda_r} (in (0, 1)), lr {self.lr}, "
                             f"s_lr {self.s_lr} (> 0) out of range")

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (the bundle's `offline` metadata)."""
        out = asdict(self)
        out["corruptions"] = list(self.corruptions)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OfflineConfig:
        """The config `to_dict` wrote; ValueError naming an unknown field."""
        known = {f.name for f in fields(cls)}
        extra = sorted(set(d) - known)
        if extra:
            raise ValueError(f"offline config: unknown field {extra[0]!r}")
        d = dict(d)
        if "corruptions" in d:
            d["corruptions"] = tuple(d["corruptions"])
        return cls(**d)


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
    config: dict = field(default_factory=dict)  # OfflineConfig.to_dict() ({} if unrecorded)
    data: dict = field(default_factory=dict)  # source, training corruptions, sizes, a_ii

    def offline_config(self) -> OfflineConfig | None:
        """The OfflineConfig that made this (None for a bundle that did not record it)."""
        return OfflineConfig.from_dict(self.config) if self.config else None


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
    """S trained on Eq. 13 with Eq. 9 over `cfg.cm_pairs`; report: first and last L_m,
    last L_CM, share of corruptions whose own sub-network Eq. 10 picks from the centroid,
    mean S^j . C^j and mean S . C^j of the pick."""
    torch.manual_seed(cfg.seed)
    s = SubnetEncoder(SubnetEncoderConfig(fps.shape[1], cents.shape[1], cfg.s_hidden))
    opt = torch.optim.Adam(s.parameters(), lr=cfg.s_lr)
    acc32, first = acc.float(), None
    for _ in range(cfg.s_steps):
        loss = subnet_loss(s(fps), cents, acc32, cfg.lambda_r, cfg.cm_pairs)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    s.eval().requires_grad_(False)
    sig = s(fps)
    picks = [closest(sig, cents[j]) for j in range(len(cents))]
    dots = sig @ cents.T
    return s, {"first_loss": first, "loss": float(loss.detach()),
               "cm_loss": float(cm_loss(sig, cents, cfg.cm_pairs)),
               "own_pick": sum(i == j for j, i in enumerate(picks)) / len(cents),
               "own_dot": float(dots.diagonal().mean()),
               "pick_dot": float(torch.stack([dots[i, j] for j, i in enumerate(picks)]).mean())}


PICKS = ("signature", "centroid")


def eq16_probe(model: nn.Module, live: dict[str, Tensor], states: list[dict[str, Tensor]],
               s: SubnetEncoder, encoder: CorruptionEncoder, fps: Tensor, noise: Tensor,
               held: Labelled, acc: Tensor, batch: int, pick: str = "signature",
               cents: Tensor | None = None) -> dict[str, Any]:
    """Eq. 16 where the online step starts, on each evaluation batch (`batch` images; one
    batch of all when a corruption has fewer) of each training corruption j: the picked
    sub-network i is loaded, C_bar is the batch's mean projection; means of L_u, its floor
    exp(-|C_bar|), S . C_bar and the gradient norm w.r.t. the adapted parameters, the share
    of batches picking their own sub-network and the mean a_ij of the picks (against a_jj).
    `pick`: "signature" (Eq. 10: the largest S^i . c, what the online phase does) or
    "centroid" (the sub-network of the nearest centroid C^i, `cents`: §3's "infer the
    closest domain t, select theta_t")."""
    if pick not in PICKS or (pick == "centroid" and cents is None):
        raise ValueError(f"eq16_probe pick {pick!r} not in {PICKS} (centroid needs cents)")
    params = [t for k, t in live.items() if k.endswith((".weight", ".bias"))]
    with torch.no_grad():
        sig = s(fps) if pick == "signature" else cents
    rows: list[tuple[int, int, Any]] = []
    for j in range(len(states)):
        hj = held.only(j)
        step = min(batch, len(hj.x))
        for k in range(0, len(hj.x) - step + 1, step):
            with torch.no_grad():
                proj = encoder(hj.x[k:k + step])
            i = closest(sig, F.normalize(proj.mean(0), dim=0))
            _load(live, states[i])
            rows.append((i, j, eq16_gradient(model, params, s, noise, proj.mean(0))))
    n = len(rows)

    def mean(vals: list[float]) -> float:
        return sum(vals) / n

    grads = [p.grad_norm for _, _, p in rows]
    return {"batches": n, "batch": batch,
            "pick_own": mean([float(i == j) for i, j, _ in rows]),
            "picked_accuracy": mean([float(acc[i, j]) for i, j, _ in rows]),
            "own_accuracy": mean([float(acc[j, j]) for _, j, _ in rows]),
            "loss": mean([p.loss for _, _, p in rows]),
            "floor": mean([p.floor for _, _, p in rows]),
            "dot": mean([p.dot for _, _, p in rows]),
            "grad_norm": mean(grads), "grad_norm_min": min(grads), "grad_norm_max": max(grads)}


def run_offline(model: nn.Module, size: int, mean: tuple[float, ...], std: tuple[float, ...],
                cfg: OfflineConfig, encoder: CorruptionEncoder | None = None,
                log: bool = False, raw_encoder: CorruptionEncoder | None = None,
                data: OfflineData | None = None) -> Offline:
    """The whole offline phase on `model` (its tensors are restored afterwards); `encoder`,
    `raw_encoder`: trained ones to reuse (default: trained here); `data`: labelled images
    of cfg.corruptions, in that order (offline_data.folder_data; default: the built-in
    signs rendered at `size`)."""
    cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    try:
        if data is None:
            data = rendered_data(cfg.corruptions, cfg.samples, cfg.eval_samples, cfg.severity,
                                 cfg.seed, size, mean, std)
        _check_data(data, cfg, size)
        return _offline(model, mean, std, cfg, data, (encoder, raw_encoder), log, t0)
    finally:
        model.load_state_dict(saved)
        model.eval()
        torch.set_num_threads(threads)


def _check_data(data: OfflineData, cfg: OfflineConfig, size: int) -> None:
    """ValueError when `data` does not hold every training corruption at `size` px."""
    d_s = len(cfg.corruptions)
    for what, part in (("training", data.train), ("evaluation", data.held)):
        if part.x.ndim != 4 or tuple(part.x.shape[2:]) != (size, size):
            raise ValueError(f"offline {what} images {tuple(part.x.shape)}: expected "
                             f"[N, C, {size}, {size}]")
        counts = torch.bincount(part.d, minlength=d_s)
        if len(counts) != d_s or bool((counts == 0).any()) or len(part.y) != len(part.x):
            raise ValueError(f"offline {what} data must hold images of each of the {d_s} "
                             f"corruptions (counts {counts.tolist()})")


def _say(log: bool, t0: float, msg: str) -> None:
    if log:
        print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)


def _offline(model: nn.Module, mean: tuple[float, ...], std: tuple[float, ...],
             cfg: OfflineConfig, data: OfflineData,
             encoders: tuple[CorruptionEncoder | None, CorruptionEncoder | None], log: bool,
             t0: float) -> Offline:
    model.eval().requires_grad_(False)
    train, held = data.train, data.held
    _say(log, t0, f"{len(train.x)} + {len(held.x)} images ({data.source.get('kind', '?')})")
    live = adapted_tensors(model)
    source = {k: v.detach().clone() for k, v in live.items()}
    d_s = len(cfg.corruptions)
    states = []
    for j in range(d_s):
        states.append(fit_subnetwork(model, live, source, train.only(j), cfg, cfg.seed + j))
        _say(log, t0, f"sub-network {j + 1}/{d_s} ({cfg.corruptions[j]}) fine-tuned")
    acc = accuracy_matrix(model, live, states, held)
    noise = noise_batch(tuple(train.x.shape[1:]), cfg.noise_count, cfg.noise_seed)
    fps = fingerprints(model, live, states, noise)
    ecfg = EncoderConfig(steps=cfg.encoder_steps, samples=cfg.samples, severity=cfg.severity,
                         threads=cfg.threads)
    enc_data = (train.x, train.d)
    encoder, raw = encoders
    if encoder is None:
        encoder, _ = train_encoder(ecfg, mean, std, data=enc_data)
    if raw is None:
        raw, _ = train_encoder(replace(encoder.config, lambda_e=0.0, steps=cfg.encoder_steps),
                               mean, std, cls=RawCorruptionEncoder, data=enc_data)
    encoder.eval()
    raw.eval()
    _say(log, t0, "corruption encoders ready")
    cents, raw_cents = centroids(encoder, train, d_s), centroids(raw, train, d_s)
    s, s_rep = train_s(fps, cents, acc, cfg)
    raw_s, raw_rep = train_s(fps, raw_cents, acc, cfg)
    _say(log, t0, f"S trained: own pick {s_rep['own_pick']:.2f} (raw {raw_rep['own_pick']:.2f})")
    for rep, s_enc, enc, cs in ((s_rep, s, encoder, cents), (raw_rep, raw_s, raw, raw_cents)):
        for pick, key in zip(PICKS, ("eq16", "eq16_centroid_pick"), strict=True):
            rep[key] = eq16_probe(model, live, states, s_enc, enc, fps, noise, held, acc,
                                  cfg.probe_batch, pick, cs)
    _say(log, t0, f"Eq. 16 at the pick: loss {s_rep['eq16']['loss']:.4f} (floor "
                  f"{s_rep['eq16']['floor']:.4f}), gradient norm {s_rep['eq16']['grad_norm']:.3g}")
    names = list(cfg.corruptions)
    own = acc.diagonal().tolist()
    report = {"seconds": time.perf_counter() - t0, "s": s_rep, "raw_s": raw_rep,
              "own_accuracy": own,
              "source_accuracy": _source_accuracy(model, live, source, held),
              "classifier": last_linear(model)}
    counts = torch.bincount(train.d, minlength=d_s).tolist()
    held_counts = torch.bincount(held.d, minlength=d_s).tolist()
    info = {"source": dict(data.source), "corruptions": names,
            "samples_per_corruption": dict(zip(names, counts, strict=True)),
            "eval_samples_per_corruption": dict(zip(names, held_counts, strict=True)),
            "own_accuracy": dict(zip(names, own, strict=True))}
    return Offline(names, dict(zip(names, states, strict=True)), acc, noise, fps, encoder,
                   raw, cents, raw_cents, s, raw_s, report, cfg.to_dict(), info)


def _source_accuracy(model: nn.Module, live: dict[str, Tensor], source: dict[str, Tensor],
                     held: Labelled) -> list[float]:
    """Accuracy of the source state per training corruption (the baseline of a_ii)."""
    return accuracy_matrix(model, live, [source], held)[0].tolist()
