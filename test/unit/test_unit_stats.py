"""BN-carried unit statistics equal the directly computed ones, and the source history
seeded from BN running stats makes the first batch's importance meaningful."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tta_core.adashadow.assessor import Assessor
from tta_core.adashadow.engine import AdaShadowEngine, EngineConfig
from tta_core.model.norms import set_bn_mode
from tta_core.model.units import decompose
from tta_core.model.zoo import build_model
from tta_core.runtime.stats import channel_stats
from tta_core.runtime.unit_stats import UnitStatsCollector, source_seeds


def _model(arch: str, size: int):
    torch.manual_seed(0)
    model = build_model(arch, 10)
    set_bn_mode(model, "batch")
    return decompose(model, (3, size, size), arch)


@pytest.mark.parametrize("arch,size", [pytest.param("resnet18", 32, marks=pytest.mark.slow),
                                       pytest.param("mobilenet_v2", 32, marks=pytest.mark.slow),
                                       ("small_resnet", 32)])
def test_carried_stats_equal_direct_channel_stats(arch, size):
    staged = _model(arch, size)
    col = UnitStatsCollector(staged, with_grad=False)
    n_conv = sum(u.kind == "conv" for u in staged.units)
    assert len(col.pairs) == n_conv  # in these nets every conv feeds its own BN
    direct: dict[int, tuple] = {}  # BN units (batch statistics) are described by their input
    hooks = [u.module.register_forward_pre_hook(
        lambda _m, a, i=u.index: direct.__setitem__(i, channel_stats(a[0].detach())))
        if u.kind == "bn" else u.module.register_forward_hook(
        lambda _m, _a, out, i=u.index: direct.__setitem__(i, channel_stats(out.detach())))
        for u in staged.units]
    x = torch.randn(3, 3, size, size) * 2 + 0.5
    col.capture = True
    with torch.no_grad():
        staged.model(x)
    col.capture = False
    got = col.collect(x.shape[0])
    for h in hooks:
        h.remove()
    for u in staged.units:
        m, v = got[u.index]
        dm, dv = direct[u.index]
        torch.testing.assert_close(m, dm, rtol=1e-4, atol=1e-4, msg=u.name)
        torch.testing.assert_close(v, dv, rtol=1e-3, atol=1e-4, msg=u.name)


def test_robust_bn_pairs_carry_stats_equal_to_hooks():
    """Conv -> robust-BN pairs (AdaShadow's default bn_mode) take their statistics from the
    robust-BN controller's own update pass: equal to channel statistics measured on the
    conv output and the eval BN's output, and the running statistics move exactly as
    without collection."""
    from tta_core.adashadow.engine import robust_bn

    def build():
        torch.manual_seed(0)
        model = build_model("small_resnet", 10)
        for m in model.modules():  # non-trivial affine and running stats
            if isinstance(m, nn.BatchNorm2d):
                m.weight.data.uniform_(0.5, 1.5), m.bias.data.uniform_(-0.3, 0.3)
                m.running_mean.uniform_(-0.2, 0.2), m.running_var.uniform_(0.5, 2.0)
        model.eval()
        staged = decompose(model, (3, 32, 32), "small_resnet")
        rbn = robust_bn(model, EngineConfig(bn_mode="robust", bn_batch_layers=2))
        return staged, rbn

    staged, rbn = build()
    col = UnitStatsCollector(staged, with_grad=False)
    n_robust = sum(p.robust is not None for p in col.pairs)
    assert n_robust == sum(isinstance(m, nn.BatchNorm2d) for m in staged.model.modules()) - 2
    ref_staged, ref_rbn = build()
    direct: dict[int, tuple] = {}
    for u in ref_staged.units:
        u.module.register_forward_hook(
            lambda _m, a, out, i=u.index, bn=u.kind == "bn" and u.module.training:
            direct.__setitem__(i, channel_stats((a[0] if bn else out).detach())))
    x = torch.randn(3, 3, 32, 32) * 2 + 0.5
    for r in (rbn, ref_rbn):
        r.enabled = True
    col.capture = True
    with torch.no_grad():
        staged.model(x)
        ref_staged.model(x)
    col.capture = False
    got = col.collect(x.shape[0])
    for u in staged.units:
        torch.testing.assert_close(got[u.index], direct[u.index], rtol=1e-4, atol=1e-5,
                                   msg=u.name)
    moved = {k: v for k, v in staged.model.state_dict().items() if "running" in k}
    ref = ref_staged.model.state_dict()
    assert len(moved) == 2 * n_robust + 4  # the batch-statistics pairs carry theirs too
    for k, v in moved.items():
        if k in ref:  # the robust layers' buffers
            torch.testing.assert_close(v, ref[k], msg=k)
    assert not rbn.record and not rbn.recorded  # nothing kept once collection is off


def test_pairs_follow_tensor_identity_not_names():
    """A BN that comes right after a conv but does not read its output is not paired, and
    its stats (and the conv's) still come out right through the hook fallback."""
    from tta_core.model.zoo import SmallResNet

    class Rewired(SmallResNet):
        def forward(self, x):
            c = self.conv1(x)
            x = self.relu(self.bn1(c * 1.0))  # a new tensor: not the conv's output object
            x = self.layer3(self.layer2(self.layer1(x)))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    torch.manual_seed(0)
    model = Rewired(num_classes=10)
    set_bn_mode(model, "batch")
    staged = decompose(model, (3, 32, 32), "small_resnet")
    col = UnitStatsCollector(staged, with_grad=False)
    paired = {p.conv for p in col.pairs}
    assert 0 not in paired and len(paired) == sum(u.kind == "conv" for u in staged.units) - 1
    x = torch.randn(2, 3, 32, 32)
    col.capture = True
    with torch.no_grad():
        staged.model(x)
        c = model.conv1(x)
    col.capture = False
    got = col.collect(2)
    torch.testing.assert_close(got[0][0], channel_stats(c)[0], rtol=1e-4, atol=1e-5)


def _source_model(clean: torch.Tensor):
    """small_resnet whose BN running stats are those of `clean` (a trained source)."""
    torch.manual_seed(1)
    model = build_model("small_resnet", 10)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None  # cumulative average over the calibration batches
    model.train()
    with torch.no_grad():
        for chunk in clean.split(16):
            model(chunk)
    return model


@pytest.mark.slow
def test_seeded_history_scores_a_shifted_first_batch_higher():
    g = torch.Generator().manual_seed(0)
    clean = torch.rand(64, 3, 32, 32, generator=g)
    results = {}
    for name, batch in {"clean": torch.rand(8, 3, 32, 32, generator=g),
                        "shifted": torch.rand(8, 3, 32, 32, generator=g) * 3 + 1}.items():
        model = _source_model(clean)
        source_bn = {n: (m.running_mean.clone(), m.running_var.clone())
                     for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
        set_bn_mode(model, "batch")
        staged = decompose(model, (3, 32, 32), "small_resnet")
        eng = AdaShadowEngine(staged, EngineConfig(sigma=1.0), source_bn=source_bn)
        results[name] = eng.step(batch).importance
        eng.close()
    assert results["clean"].sum() > 0  # scored against the source, not against itself
    # bn1 (unit 1) normalises the first conv's output: it sees the input shift first
    assert results["shifted"][1] > 5 * results["clean"][1]
    assert results["shifted"][0] == 0.0  # conv units are not trainable by default
    assert results["shifted"].sum() > 2 * results["clean"].sum()


def test_seeds_shape_mismatch_is_a_clear_error():
    staged = _model("small_resnet", 32)
    with pytest.raises(ValueError, match=r"bn1.*shape \(5,\).*16 channels"):
        source_seeds(staged, {staged.units[1].name: (torch.zeros(5), torch.ones(5))})
    a = Assessor(3)
    a.seed([None, (torch.zeros(4), torch.ones(4)), None])
    with pytest.raises(ValueError, match="seed of unit 1 has 4 channels"):
        a.step([(torch.zeros(2), torch.ones(2))] * 3)
