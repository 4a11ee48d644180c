"""Which sub-network DARDA's online phase plugs in: Eq. 10's pick over the signatures
S(F^i) for a bundle trained with Eq. 9 over i = j, the nearest centroid for one trained
with Eq. 9 as printed (i != j), whose signatures sit away from their own centroids."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import CARD

from tta_core.darda.offline import OfflineConfig, run_offline
from tta_core.darda.paper import PaperConfig, PaperOnline
from tta_core.model.source import load_source

TINY = OfflineConfig(corruptions=("gaussian_noise", "fog"), samples=8, eval_samples=4,
                     epochs=1, batch=8, noise_count=2, s_hidden=8, s_steps=20,
                     encoder_steps=2, threads=1)


@pytest.fixture(scope="module")
def offline():
    torch.set_num_threads(1)
    model, card = load_source(CARD)
    return model, run_offline(model, 32, tuple(card.mean), tuple(card.std), TINY)


@pytest.mark.parametrize(("pairs", "picked"), [("diagonal", "fog"),
                                               ("off_diagonal", "gaussian_noise")])
def test_the_pick_follows_the_bundles_eq9_reading(offline, pairs, picked) -> None:
    model, off = offline
    off = dataclasses.replace(off, config={**off.config, "cm_pairs": pairs})
    p = PaperOnline(model, off, PaperConfig())
    dim = p.centroids.shape[1]
    e0, e1 = torch.eye(dim)[0], torch.eye(dim)[1]
    # the batch is nearest to gaussian_noise's centroid, but to fog's signature
    p.centroids = torch.stack([e0, e1])
    p.signatures = torch.stack([e1, e0])
    c = F.normalize(e0 + 0.1 * e1, dim=0)
    assert p.observe(c)
    assert p.domain == picked
    live = {k: t.clone() for k, t in p.live.items()}
    assert all(torch.equal(live[k], off.states[picked][k]) for k in live)
