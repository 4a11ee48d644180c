"""Training DARDA's learnt corruption encoder (§4.2, Eqs. 6-8); the network, its file and
the embedding that reads it are tta_core.domain.encoder and tta_core.domain.embedding.

Trained (Eq. 8) on L = L_D + lambda_e L_N with L_D the supervised contrastive loss of Eq. 7
read as standard SupCon (positives: other samples of the same corruption; the printed
indicator D^i != D^j is read as a typo) over each batch and a flipped / rotated copy of it
(DARDA's "soft augmentation", 2N samples), L_N the extractor's noise loss (Eq. 5,
`CorruptionEncoder.noise_loss`).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from tta_core.data.corruptions import CORRUPTIONS
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.streams import StreamSpec, build_stream
from tta_core.domain.encoder import CorruptionEncoder, EncoderConfig


def supcon_loss(z: Tensor, labels: Tensor, tau: float) -> Tensor:
    """Eq. 7 as standard SupCon: for each anchor, the mean log-probability of its positives
    (same label, not itself) among all other samples; averaged over anchors."""
    sim = z @ z.T / tau
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(eye, float("-inf"))
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    pos = (labels[:, None] == labels[None, :]) & ~eye
    return -(log_prob.masked_fill(~pos, 0.0).sum(1) / pos.sum(1).clamp_min(1)).mean()


def _augment(x: Tensor, g: torch.Generator) -> Tensor:
    """A flipped and rotated copy (random per sample; 90 degree steps keep the pixels)."""
    k = torch.randint(0, 4, (len(x),), generator=g)
    flip = torch.rand(len(x), generator=g) < 0.5
    out = [torch.rot90(torch.flip(s, (-1,)) if f else s, int(r), (-2, -1))
           for s, f, r in zip(x, flip, k, strict=True)]
    return torch.stack(out)


def training_data(c: EncoderConfig, mean: tuple[float, ...], std: tuple[float, ...],
                  corruptions: tuple[str, ...] = CORRUPTIONS) -> tuple[Tensor, Tensor]:
    """Normalised images [n, C, H, W] of the synthetic signs under each corruption, labels."""
    stream = build_stream(StreamSpec(order="continual", corruptions=corruptions,
                                     samples_per_domain=c.samples, severity=c.severity,
                                     seed=c.seed))
    names = [d.split("/")[0] for d in stream.domains.tolist()]
    labels = torch.tensor([corruptions.index(n) for n in names])
    return images_to_tensor(stream.images, mean, std), labels


def train_encoder(c: EncoderConfig, mean: tuple[float, ...], std: tuple[float, ...],
                  log_every: int = 0, cls: type[CorruptionEncoder] = CorruptionEncoder,
                  data: tuple[Tensor, Tensor] | None = None) -> tuple[CorruptionEncoder, dict]:
    """Train g and h (Eq. 8) on the 15 corruptions; returns the encoder (eval mode) and a
    report (losses, seconds). `cls`: RawCorruptionEncoder for the Table 2 ablation; `data`:
    (images, corruption labels) already rendered (default: `training_data`)."""
    torch.manual_seed(c.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(c.threads)
    t0 = time.perf_counter()
    try:
        x, y = training_data(c, mean, std) if data is None else data
        enc = cls(c)
        opt = torch.optim.Adam(enc.parameters(), lr=c.lr)
        g = torch.Generator().manual_seed(c.seed)
        classes = int(y.max()) + 1
        by_class = [torch.nonzero(y == k).flatten() for k in range(classes)]
        history = []
        for step in range(c.steps):
            idx = torch.cat([b[torch.randperm(len(b), generator=g)[:c.per_class]]
                             for b in by_class])
            xb = torch.cat([x[idx], _augment(x[idx], g)])
            yb = torch.cat([y[idx], y[idx]])
            l_d = supcon_loss(enc(xb), yb, c.tau)
            l_n = enc.noise_loss(xb)
            loss = l_d + c.lambda_e * l_n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            history.append((float(l_d.detach()), float(l_n.detach())))
            if log_every and (step + 1) % log_every == 0:
                print(f"step {step + 1}/{c.steps}: L_D {l_d:.3f} L_N {l_n:.4f}", flush=True)
    finally:
        torch.set_num_threads(threads)
    enc.eval()
    tail = np.asarray(history[-20:])
    return enc, {"seconds": time.perf_counter() - t0, "supcon": float(tail[:, 0].mean()),
                 "noise": float(tail[:, 1].mean()), "first_supcon": history[0][0]}
