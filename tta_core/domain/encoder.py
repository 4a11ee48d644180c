"""The learnt corruption encoder an embedding may add (DARDA §4.1-4.2): the network and its
file. Training it is DARDA's offline recipe (tta_core.darda.encoder.train_encoder).

Extractor g (Eqs. 3-5, Noise2Noise-style): the input's two diagonal 2x2 stride-2
downsamplings G1(x), G2(x) (`diagonal_halves`) should be predictable from each
other once the corruption is removed: G~2 = G1 - g(G1), G~1 = G2 - g(G2), loss L_N = the
mean squared error of both (`CorruptionEncoder.noise_loss`). Encoder h: a small conv net on
[G1(x), g(G1(x))] (the image half and its extracted corruption; the image half carries the
low-frequency corruptions such as fog and contrast that a residual does not), channel mean
and std pooled over space, an MLP to an L2-normalised projection.

The batch embedding is the batch mean of the per-sample projections (and their spread),
read in the model's input pre-hook (`EmbeddingConfig.encoder`, tta_core.domain.embedding).
Weights: safetensors, with the architecture and the training settings in its metadata.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tta_core.io.strict_json import dumps as json_dumps

FORMAT = "tta-corruption-encoder"


def diagonal_halves(x: Tensor) -> tuple[Tensor, Tensor]:
    """G1(x) = [[0, .5], [.5, 0]] and G2(x) = [[.5, 0], [0, .5]], stride 2 (DARDA §4.1)."""
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    g1 = (x[..., 0:h:2, 1:w:2] + x[..., 1:h:2, 0:w:2]) / 2
    g2 = (x[..., 0:h:2, 0:w:2] + x[..., 1:h:2, 1:w:2]) / 2
    return g1, g2


@dataclass
class EncoderConfig:
    """Architecture and training settings (stored with the weights)."""

    channels: int = 3
    width: int = 16
    dim: int = 32  # projection size
    tau: float = 0.1  # SupCon temperature
    lambda_e: float = 1.0  # weight of L_N (Eq. 8)
    steps: int = 200
    per_class: int = 8  # images per corruption in a batch (N = 15 x 8, 2N with the copies)
    lr: float = 2e-3
    samples: int = 256  # training images per corruption
    severity: int = 5
    seed: int = 11  # not the benchmark's seeds (0-3)
    threads: int = 2

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for name in ("channels", "width", "dim", "steps", "per_class", "samples", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"encoder {name}={getattr(self, name)} must be >= 1")
        if self.per_class < 2 or self.tau <= 0 or self.lr <= 0 or self.lambda_e < 0:
            raise ValueError(f"encoder per_class {self.per_class} (>= 2), tau {self.tau}, lr "
                             f"{self.lr} (> 0), lambda_e {self.lambda_e} (>= 0) out of range")


class CorruptionEncoder(nn.Module):
    """g (extractor) and h (encoder); `forward(x)` gives unit projections [B, dim]."""

    def __init__(self, config: EncoderConfig | None = None) -> None:
        super().__init__()
        self.config = c = config if config is not None else EncoderConfig()
        c.validate()
        self.extractor = nn.Sequential(nn.Conv2d(c.channels, c.width, 3, padding=1), nn.ReLU(),
                                       nn.Conv2d(c.width, c.channels, 3, padding=1))
        self.trunk = nn.Sequential(nn.Conv2d(2 * c.channels, c.width, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(c.width, c.width, 3, stride=2, padding=1),
                                   nn.ReLU())
        self.head = nn.Sequential(nn.Linear(2 * c.width, 2 * c.width), nn.ReLU(),
                                  nn.Linear(2 * c.width, c.dim))

    def noise_loss(self, x: Tensor) -> Tensor:
        """L_N (Eq. 5), per element."""
        g1, g2 = diagonal_halves(x)
        return 0.5 * (F.mse_loss(g1 - self.extractor(g1), g2)
                      + F.mse_loss(g2 - self.extractor(g2), g1))

    def forward(self, x: Tensor) -> Tensor:
        g1, _ = diagonal_halves(x)
        f = self.trunk(torch.cat([g1, self.extractor(g1)], dim=1)).flatten(2)
        pooled = torch.cat([f.mean(-1), torch.sqrt(f.var(-1, correction=0) + 1e-6)], dim=1)
        return F.normalize(self.head(pooled), dim=1)


class RawCorruptionEncoder(CorruptionEncoder):
    """Table 2's "w/o corruption extractor": h projects the corrupted image directly (the
    extractor's input slot is zeros; trained with lambda_e = 0, g stays unused)."""

    def forward(self, x: Tensor) -> Tensor:
        g1, _ = diagonal_halves(x)
        f = self.trunk(torch.cat([g1, torch.zeros_like(g1)], dim=1)).flatten(2)
        pooled = torch.cat([f.mean(-1), torch.sqrt(f.var(-1, correction=0) + 1e-6)], dim=1)
        return F.normalize(self.head(pooled), dim=1)


def save_encoder(enc: CorruptionEncoder, path: str | Path) -> None:
    """Weights + config as safetensors (float32)."""
    state = {k: v.detach().contiguous() for k, v in enc.state_dict().items()}
    safetensors.torch.save_file(state, str(path), metadata={
        "format": FORMAT, "config": json_dumps(asdict(enc.config))})


def load_encoder(path: str | Path) -> CorruptionEncoder:
    """An encoder saved by `save_encoder`, in eval mode; ValueError naming the file when
    it is not one."""
    try:
        with safetensors.safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, safetensors.SafetensorError) as exc:
        raise ValueError(f"corruption encoder {path}: {exc}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"corruption encoder {path}: not a {FORMAT} file")
    enc = CorruptionEncoder(EncoderConfig(**json.loads(meta["config"])))
    enc.load_state_dict(state)
    return enc.eval()
