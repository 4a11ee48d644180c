"""DARDA's per-batch host reads gathered into one transfer each (issue #29): the batch
embedding with its cancellation flags, the detector's decision inputs, the paper's memory
bank scores. The values and decisions are those of a read per scalar."""

from __future__ import annotations

import torch
from helpers.host_reads import HostReads

from tta_core.darda.corruption_memory import CorruptionMemory
from tta_core.domain.detector import DetectorConfig, DomainDetector
from tta_core.domain.embedding import moments_part, read_parts


def _reference(x: torch.Tensor) -> torch.Tensor:
    """Batch mean of per-sample [channel means, log-variances], in float64 throughout."""
    v = x.double().flatten(2)
    var, mean = torch.var_mean(v, dim=-1, correction=0)
    return torch.cat([mean, torch.log(var + 1e-5)], dim=1).mean(0)


def test_embedding_is_one_read_and_a_cancelling_layer_is_recomputed_two_pass():
    torch.manual_seed(0)
    plain = torch.randn(8, 4, 16, 16)
    offset = torch.randn(8, 4, 16, 16) * 1e-2 + 300.0  # mean^2 >> 1e3 var: one pass cancels
    with HostReads() as reads:
        vec, spread = read_parts([moments_part(plain, True)])
    assert sum(reads.count.values()) == 1
    assert torch.allclose(vec, _reference(plain), rtol=1e-5, atol=1e-5)
    assert spread is not None and spread.shape == vec.shape
    one_pass = moments_part(offset, True).vec.cpu()
    with HostReads() as reads:
        vec, _ = read_parts([moments_part(plain, True), moments_part(offset, True)])
    assert sum(reads.count.values()) == 2  # the flags, then the recomputed parts
    exact = torch.cat([_reference(plain), _reference(offset)])
    assert torch.allclose(vec, exact, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(one_pass, _reference(offset), rtol=1e-3, atol=1e-3)


def test_detector_reads_each_batch_once_and_returns_to_a_known_domain():
    g = torch.Generator().manual_seed(0)
    dim = 6
    det = DomainDetector(dim, DetectorConfig(confident=0.0))  # switches only by a vote
    names, reads = [], []
    for center in [0.0] * 8 + [3.0] * 5 + [0.0] * 4:
        e = center + 0.1 * torch.randn(dim, generator=g, dtype=torch.float64)
        with HostReads() as r:
            names.append(det.observe(e, torch.full((dim,), 0.05, dtype=torch.float64)).domain)
        reads.append(sum(r.count.values()))
    assert reads[0] == 0 and set(reads[1:]) == {1}  # nothing known before the first batch
    # two batches away before each switch; the mean of the two recognises d0 again
    assert names == ["d0"] * 9 + ["d1"] * 5 + ["d0"] * 3
    assert det.names == ["d0", "d1"]


def test_memory_scores_are_read_once_per_batch_and_follow_the_centroid():
    torch.manual_seed(0)
    mem = CorruptionMemory(capacity=8, num_classes=2)
    a = torch.nn.functional.normalize(torch.tensor([1.0, 0.0, 0.2]), dim=0)
    b = torch.nn.functional.normalize(torch.tensor([0.0, 1.0, 0.2]), dim=0)
    for _ in range(4):
        proj = torch.nn.functional.normalize(a + 0.3 * torch.randn(4, 3), dim=1)
        with HostReads() as r:
            mem.add(torch.randn(4, 1), torch.tensor([0, 1, 0, 1]), proj, a)
        assert sum(r.count.values()) == 1
    slots = [s for cls in mem.slots for s in cls]
    assert len(slots) == 8
    assert [s.sim for s in slots] == [float(s.proj @ a) for s in slots]
    with HostReads() as r:
        mem.retarget(b)
    assert sum(r.count.values()) == 1
    assert [s.sim for s in slots] == [float(s.proj @ b) for s in slots]
