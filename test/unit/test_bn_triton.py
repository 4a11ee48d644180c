"""tta_kernels.bn_triton: robust BN's lagged pass on CUDA in one Triton kernel (eval BN
with the running statistics, the batch's taken in the same read, the buffers moved) equals
PyTorch's eval BN + batch_norm_update_stats: in Triton's interpreter on any machine, on the
GPU where there is one; and robust BN dispatches CUDA tensors to it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, bn_checks

pytest.importorskip("triton")


@pytest.mark.slow
def test_kernel_matches_pytorch_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "test"), str(ROOT), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "helpers.bn_checks"], capture_output=True,
                          text=True, timeout=280, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok", proc.stdout[-3000:]


def test_only_cuda_nchw_float32_goes_to_the_kernel() -> None:
    from tta_kernels import bn_triton

    x = torch.zeros(2, 3, 4, 4)
    stats = torch.zeros(3)
    assert not bn_triton.takes(x, stats)  # a CPU tensor: the C pass
    meta = torch.empty(2, 3, 4, 4, device="meta")
    assert not bn_triton.takes(meta, None)


@pytest.mark.cuda
def test_kernel_matches_pytorch_on_the_gpu() -> None:
    from tta_kernels import bn_stats, bn_triton

    bn_checks.check(bn_triton, "cuda")
    x = torch.randn(4, 8, 14, 14, device="cuda")
    s = torch.ones(8, device="cuda")
    assert bn_stats.fusable(x, s, s, s, s)
    assert not bn_stats.fusable(x.to(memory_format=torch.channels_last), s, s, s, s)
    assert not bn_stats.fusable(x.half(), s, s, s, s)
    big = torch.empty(2, 1, 256, 256, device="cuda")  # 2 * 65536 values per channel
    assert not bn_stats.fusable(big, *[torch.ones(1, device="cuda")] * 4)
