"""Centred pruning of BN inputs (CodecPlan.norm_keep), max-pool inputs left unstored
(pool_inputs) and index-list pruning: decoded values, gradients against dense backward
(cosine, exactness) and measured saved bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tta_core.memory import ActivationCodec, CodecPlan, SavedActivationCounter
from tta_core.memory.packed import CentredPruned, PackedPruned
from tta_core.memory.scope import OTHER
from tta_core.model.source import load_source

CARD = "checkpoints/small_resnet_signs32.json"
pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(n: int = 16) -> torch.Tensor:
    return 0.5 * torch.randn((n, 3, 32, 32), generator=torch.Generator().manual_seed(0))


def _grads(model: nn.Module, x: torch.Tensor, ctx) -> tuple[torch.Tensor, object]:
    """Flattened entropy gradient of every parameter, computed under the context."""
    params = [p for p in model.parameters() if p.requires_grad]
    with ctx:
        logp = model(x).log_softmax(1)
        loss = -(logp.exp() * logp).sum(1).mean()
    grads = torch.autograd.grad(loss, params)
    return torch.cat([g.reshape(-1) for g in grads]), ctx.result


def _bn_units(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]


def test_centred_pruning_keeps_means_and_largest_deviations() -> None:
    x = torch.randn(4, 8, 6, 6, generator=torch.Generator().manual_seed(1)) * 3 + 2
    enc = CentredPruned.encode(x, 0.25, (0, 2, 3), 65536)
    out = enc.decode()
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    kept = out != mean.expand_as(x)
    assert 0.2 < kept.float().mean() < 0.3
    torch.testing.assert_close(out[kept], x[kept])  # kept entries exact
    dev = (x - mean).abs()
    assert dev[kept].min() >= dev[~kept].max()  # the largest deviations are the kept ones
    assert enc.nbytes < 0.35 * x.nbytes


def test_pruned_bn_step_gradient_close_to_dense() -> None:
    """All BN inputs centred-pruned (conv inputs dense): the whole gradient's cosine with
    the dense one stays high (approximate, not exact) and falls as keep falls, and the BN
    units hold far fewer bytes."""
    model = load_source(CARD)[0].train()
    x = _batch()
    dense, base = _grads(model, x, SavedActivationCounter(model))
    bns = _bn_units(model)
    cos = {}
    for keep in (0.3, 0.03):
        plan = CodecPlan(norm_keep=dict.fromkeys(bns, keep))
        pruned, res = _grads(model, x, ActivationCodec(model, plan))
        cos[keep] = float(torch.nn.functional.cosine_similarity(dense, pruned, dim=0))
        assert res.by_role[OTHER] < 0.5 * base.by_role[OTHER]
    assert 0.98 < cos[0.3] < 1.0 - 1e-6 and 0.9 < cos[0.03] < cos[0.3], cos


def test_bn_input_bytes_shrink_with_keep() -> None:
    model = load_source(CARD)[0].train()
    x = _batch()
    bns = _bn_units(model)
    other = []
    for keep in (1.0, 0.5, 0.1, 0.02):
        plan = CodecPlan(norm_keep=dict.fromkeys(bns, keep) if keep < 1 else {})
        _, res = _grads(model, x, ActivationCodec(model, plan))
        other.append(sum(v for u, v in res.per_unit.items() if u in bns))
    assert other == sorted(other, reverse=True) and len(set(other)) == 4, other
    assert other[2] < 0.35 * other[0], other


class _PoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.fc = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.relu(self.bn(self.conv(x))))
        return self.fc(y.flatten(1))


def test_pool_inputs_unstored_gradient_exact() -> None:
    torch.manual_seed(0)
    model = _PoolNet()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    ref, base = _grads(model, x, ActivationCodec(model, CodecPlan(act_masks=False)))
    got, res = _grads(model, x, ActivationCodec(model, CodecPlan(act_masks=False,
                                                                  pool_inputs=True)))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # the pool input (the ReLU output) is still held by the ReLU: same bytes; with masks
    # for the ReLU, the dense tensor is not held any more
    assert res.total == base.total
    _, masked = _grads(model, x, ActivationCodec(model, CodecPlan()))
    got, res = _grads(model, x, ActivationCodec(model, CodecPlan(pool_inputs=True)))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert masked.total - res.total == 4 * 8 * 16 * 16 * 4  # the float32 pool input


def test_sparse_pruning_stores_indices() -> None:
    x = torch.randn(2, 16, 32, 32, generator=torch.Generator().manual_seed(3))
    sparse = PackedPruned.encode(x, 0.01, 65536)
    assert sparse.bits.dtype == torch.int32
    mask = sparse.decode() != 0
    torch.testing.assert_close(sparse.decode()[mask], x[mask])
    assert x.abs()[mask].min() >= x.abs()[~mask].max()
    assert sparse.nbytes < x.numel() // 8  # below the bitmap alone
    dense = PackedPruned.encode(x, 0.2, 65536)
    assert dense.bits.dtype == torch.uint8
    torch.testing.assert_close(dense.decode()[dense.decode() != 0], x[dense.decode() != 0])
