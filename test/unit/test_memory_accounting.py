"""Measured saved-activation accounting (tta_core.memory.accounting): bytes equal an
independent walk of the autograd graph, shared storages count once, per-unit attribution,
analytic count, peak-memory helpers."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
import torch
from torch import nn
from torchvision.models import resnet18

from tta_core.memory import SavedActivationCounter, memory_peaks, peak_rss_bytes
from tta_core.memory.scope import ACT, BEFORE_UNITS, OTHER, WGRAD
from tta_core.model.units import decompose

pytestmark = pytest.mark.usefixtures("one_thread")


def _resnet18(px: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return resnet18(num_classes=10).train(), torch.randn(2, 3, px, px)


def _walk_saved_bytes(out: torch.Tensor, model: nn.Module) -> int:
    """Unique storages reachable through grad_fn `_saved_*` attributes (no hooks involved)."""
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    storages: dict[int, int] = {}
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if not name.startswith("_saved_"):
                continue
            value = getattr(fn, name)
            for t in value if isinstance(value, list | tuple) else [value]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in state:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        todo += [nxt for nxt, _ in fn.next_functions]
    return sum(storages.values())


def test_resnet18_total_equals_unique_storages_of_the_graph() -> None:
    model, x = _resnet18()
    counter = SavedActivationCounter(decompose(model, (3, 64, 64)))
    with counter:
        out = model(x)
    res = counter.result
    assert res.total == _walk_saved_bytes(out, model)
    assert res.total == sum(res.per_unit.values()) == sum(res.by_role.values())
    assert res.saves > res.stored  # ReLU outputs are saved twice (ReLU and next conv)
    assert 3.0 < res.total_mib < 4.5  # 2x3x64x64: 3.49 MiB measured


def test_relu_output_saved_twice_counts_once() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    x = torch.randn(2, 3, 16, 16)
    counter = SavedActivationCounter(net)
    with counter:
        net(x)
    res = counter.result
    relu_out = 2 * 8 * 16 * 16 * 4
    assert res.saves == 3  # conv0 input, ReLU result, conv2 input (= ReLU result)
    assert res.total == x.nbytes + relu_out  # not x + 2 * relu_out
    assert res.by_role == {WGRAD: x.nbytes, ACT: relu_out, OTHER: 0}
    assert res.per_unit == {"0": x.nbytes + relu_out}  # the ReLU belongs to unit "0"


def test_bn_only_saves_almost_as_much_as_all_trainable() -> None:
    model, x = _resnet18(32)
    staged = decompose(model, (3, 32, 32))
    totals = []
    for bn_only in (False, True):
        for name, p in model.named_parameters():
            p.requires_grad_(not bn_only or "bn" in name or "downsample.1" in name)
        counter = SavedActivationCounter(staged)
        with counter:
            model(x)
        totals.append(counter.result.total)
    full, bn = totals
    # dropped: the stem conv's input (the image) and the frozen fc's input (addmm keeps
    # its input only for the weight gradient; convolution keeps it anyway)
    assert full - bn == x.nbytes + 2 * 512 * 4
    assert (full - bn) / full < 0.05


def test_per_unit_attribution_and_analytic_count() -> None:
    model, x = _resnet18()
    staged = decompose(model, (3, 64, 64))
    inputs: dict[str, int] = {}
    handles = [u.module.register_forward_pre_hook(
        lambda _m, a, n=u.name: inputs.__setitem__(n, a[0].nbytes))
        for u in staged.units if u.kind in ("conv", "linear")]
    counter = SavedActivationCounter(staged)
    with counter:
        model(x)
    for h in handles:
        h.remove()
    res = counter.result
    assert res.analytic == sum(inputs.values())  # per conv/linear call, no dedup
    assert res.analytic == res.analytic_kept
    act = 2 * 64 * 16 * 16 * 4  # layer1 activation, batch 2 at 64 px
    # layer1.0.conv1 first saves the maxpool output (its input); its own BN holds conv output
    assert res.per_unit["layer1.0.conv1"] == act
    # a BN unit owns its input, its batch mean/invstd and its output, saved by the
    # in-place ReLU after it
    assert res.per_unit["layer1.0.bn1"] == 2 * act + 2 * 64 * 4
    assert BEFORE_UNITS not in res.per_unit


def test_counter_result_per_batch_and_not_reentrant() -> None:
    model, x = _resnet18(32)
    counter = SavedActivationCounter(decompose(model, (3, 32, 32)))
    with counter:
        model(x)
    first = counter.result.total
    with counter:
        model(x[:, :, :16, :16])
    assert 0 < counter.result.total < first
    with counter, pytest.raises(RuntimeError, match="already active"):
        counter.__enter__()


@pytest.mark.slow
def test_peak_rss_tracks_a_large_allocation() -> None:
    """In a fresh process: in this one, memory freed by earlier tests (kept resident by
    runtime.malloc_tuning) can serve the block without raising the peak."""
    rss = psutil.Process().memory_info().rss  # read first: the peak read after bounds it
    assert rss <= peak_rss_bytes() <= psutil.virtual_memory().total  # bytes, not KiB or pages
    code = ("import torch; from tta_core.memory.accounting import memory_peaks, "
            "peak_rss_bytes, reset_peaks\n"
            "if not reset_peaks(): print('skip'); raise SystemExit\n"
            "before = peak_rss_bytes(); block = torch.ones(64 * 2**20 // 4)\n"
            "print(memory_peaks().rss_bytes - before)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()[-1]
    if out == "skip":
        pytest.skip("peak RSS cannot be reset on this platform")
    assert int(out) >= 60 * 2**20
    after = memory_peaks()
    assert (after.cuda_bytes is None) == (not torch.cuda.is_available())
