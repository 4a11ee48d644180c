"""Checks of tta_kernels.bn_triton (robust BN's lagged pass in one Triton kernel) against
PyTorch's eval-mode BN and batch_norm_update_stats, shared by the interpreter test (a
subprocess with TRITON_INTERPRET=1, CPU tensors) and the CUDA test (in process).

    python -m helpers.bn_checks     # prints "ok" or the failing check's traceback
"""

from __future__ import annotations

import sys
import traceback

import torch
from torch.nn import functional as F

CASES = [  # (shape, weight and bias present, momentum, keep_old, offset, spread)
    ((4, 16, 7, 9), True, 0.1, True, 0.0, 1.0),  # one masked step per channel
    ((3, 8, 40, 40), True, 0.05, False, 0.3, 2.0),  # 5 steps, the last one partial
    ((5, 12), False, 0.2, True, -1.0, 1.0),  # 2-D: one value per image and channel
    ((2, 6, 33, 33), False, 0.0, True, 0.0, 1.0),  # momentum 0: buffers unchanged
    ((2, 4, 30, 30), True, 0.1, True, 1000.0, 0.01),  # a large mean, a small spread
]


def _case(mod, device: str, shape, affine: bool, momentum: float, keep_old: bool,
          offset: float, spread: float, kernel: bool = True) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    c = shape[1]
    x = (torch.randn(shape, generator=g) * spread + offset).to(device)
    rm = (torch.randn(c, generator=g) * 0.1 + offset).to(device)
    rv = (torch.rand(c, generator=g) + 0.5).to(device) * spread ** 2
    w, b = ((torch.randn(c, generator=g).to(device), torch.randn(c, generator=g).to(device))
            if affine else (None, None))
    erm, erv = rm.clone(), rv.clone()
    # PyTorch's float32 eval BN is x * a + (b - mean * a), which cancels on a large mean;
    # the kernel's (x - mean) * a + b does not: it is held to the double result
    args = [t.double() if kernel and t is not None else t for t in (x, erm, erv, w, b)]
    want_y = F.batch_norm(*args, False, 0.0, 1e-5).float()
    want = torch.batch_norm_update_stats(x, erm, erv, momentum)
    old = (rm.clone(), rv.clone())
    got = mod.normalise_update(x, rm, rv, momentum, w, b, 1e-5, keep_old)
    assert len(got) == (5 if keep_old else 3), len(got)
    torch.testing.assert_close(got[0], want_y, rtol=1e-4, atol=1e-5)
    exact = x.double().transpose(0, 1).reshape(c, -1)  # the statistics in double
    torch.testing.assert_close(got[1].double(), exact.mean(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2].double(), exact.var(1, correction=0), rtol=1e-4,
                               atol=1e-7)
    torch.testing.assert_close(got[1], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rm, erm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rv, erv, rtol=1e-4, atol=1e-6)
    if keep_old:
        assert torch.equal(got[3], old[0]) and torch.equal(got[4], old[1])
    if momentum == 0.0:
        assert torch.equal(rm, old[0]) and torch.equal(rv, old[1])


def check(mod, device: str = "cpu") -> None:
    """Every case through the kernel, then through the fallback (the kernel marked
    failed): same outputs, statistics and moved buffers."""
    for case in CASES:
        _case(mod, device, *case)
    mod._FAILED.append("forced by the test")
    try:
        for case in CASES:
            _case(mod, device, *case, kernel=False)
    finally:
        mod._FAILED.clear()


def main() -> int:
    from tta_kernels import bn_triton

    try:
        check(bn_triton)
    except Exception:  # reported to the calling test
        print(traceback.format_exc(limit=6)[-3000:])
        return 0
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
