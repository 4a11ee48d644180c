"""tta_kernels.triton_kernels bit for bit against the reference: in Triton's interpreter on
any machine (one subprocess with TRITON_INTERPRET=1, which must be set before triton is
imported, running the checks of helpers.kernel_checks on CPU tensors), and on a CUDA GPU
where there is one; compiled ahead of time for sm_90 without a GPU, with the PTX checked for
the hybrid reduction's instructions, IEEE division and no FMA. Covers the fused kernel,
DAF's hybrid min/max reduction (tree within a program + Algorithm 1's compare-and-swap
across programs) and the quantize pass after it, unpacking, NaN/inf groups, and groups whose
codes depend on computing the reciprocal as PyTorch does ((1 / rng) * L, not L / rng)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, kernel_checks

pytest.importorskip("triton")

FAST = [f"fused_{b}" for b in (2, 4, 8)] + ["hybrid_minmax"] + \
    [f"hybrid_quantize_{b}" for b in (2, 4, 8)] + [f"unpack_{b}" for b in (2, 4, 8)]


def _interpret(names: list[str]) -> dict[str, str]:
    """Run the named checks in a fresh interpreter-mode process: {name: "ok" | traceback}."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "test"), str(ROOT), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "helpers.kernel_checks", *names],
                          capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Every check's result, from one subprocess for the module."""
    return _interpret([*FAST, "sweep"])


@pytest.mark.slow
@pytest.mark.parametrize("name", FAST)
def test_triton_kernel_equals_reference_in_the_interpreter(interpreted: dict[str, str],
                                                           name: str) -> None:
    """fused_*: the one-program-per-groups kernel; hybrid_minmax: the tree + CAS reduction
    against amin / amax; hybrid_quantize_*: odd and multi-program groups; unpack_*."""
    assert interpreted[name] == "ok", interpreted[name]


@pytest.mark.slow
def test_triton_interpreter_sweep(interpreted: dict[str, str]) -> None:
    """The fused kernel over more sizes, seeds and widths; the hybrid path on a tail."""
    assert interpreted["sweep"] == "ok", interpreted["sweep"]


def _ptx(fn: object, sig: dict[str, str], consts: dict[str, int]) -> str:
    """PTX of a kernel compiled ahead of time for sm_90 (no GPU needed: the nvidia backend
    and its ptxas ship with triton), with the flags the launches use."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                    constexprs=consts)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"enable_fp_fusion": False})
    assert kernel.asm["cubin"]
    return kernel.asm["ptx"]


@pytest.mark.slow
def test_kernels_compile_for_cuda_with_the_hybrid_reduction_and_no_fma(monkeypatch,
                                                                      tmp_path) -> None:
    """Every kernel compiles to a cubin for an H100-class GPU on this CPU-only machine; the
    hybrid reduction is a block tree (warp shuffles + shared memory behind bar.sync) and a
    global compare-and-swap (Algorithm 1); the quantize kernels divide with div.rn (IEEE)
    and contain no fused multiply-add."""
    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton without its nvidia backend")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # really compile
    from tta_kernels import triton_kernels as tk

    f32, i32, u8 = "*fp32", "*i32", "*u8"
    hybrid = _ptx(tk._hybrid_minmax_kernel, {"x_ptr": f32, "mn_bits_ptr": i32,
                  "mx_bits_ptr": i32, "n": "i32"}, {"GROUP": 4096, "BLOCK": 1024})
    assert "atom.global.acq_rel.gpu.cas.b32" in hybrid
    assert "shfl.sync.bfly" in hybrid and "bar.sync" in hybrid
    fused = _ptx(tk._quantize_pack_kernel, {"x_ptr": f32, "codes_ptr": u8, "mn_ptr": f32,
                 "scale_ptr": f32, "n": "i32", "groups": "i32"},
                 {"BITS": 4, "GROUP": 128, "ROWS": 16})
    given = _ptx(tk._quantize_given_kernel, {"x_ptr": f32, "mn_ptr": f32, "mx_ptr": f32,
                 "codes_ptr": u8, "scale_ptr": f32, "n": "i32"},
                 {"BITS": 2, "GROUP": 24, "BLOCK": 32})
    unpack = _ptx(tk._unpack_dequantize_kernel, {"codes_ptr": u8, "mn_ptr": f32,
                  "scale_ptr": f32, "out_ptr": f32, "n": "i32", "nbytes": "i32"},
                  {"BITS": 4, "GROUP": 24, "BLOCK": 512})
    for ptx in (fused, given):
        assert "div.rn.f32" in ptx and "div.approx" not in ptx
    for ptx in (fused, given, unpack):
        assert "fma.rn.f32" not in ptx


@pytest.mark.cuda
def test_cuda_kernels_equal_reference_bit_for_bit() -> None:
    """The same checks compiled for the GPU, plus groups of 2**20 values (1024 programs
    each) whose programs really race on the compare-and-swap."""
    from tta_kernels import dispatch

    mod = dispatch.triton_module()
    assert mod is not None and dispatch.backend(torch.zeros(1, device="cuda")) == "triton"
    for bits in (2, 4, 8):
        kernel_checks.fused(mod, bits, "cuda")
        kernel_checks.hybrid_quantize(mod, bits, "cuda")
        kernel_checks.unpack(mod, bits, "cuda")
        for group in (8, 24, 128, 4096):
            for x in kernel_checks.inputs(4096 + 5, group):
                kernel_checks.check_quantize(mod, x.cuda(), bits, group)
    kernel_checks.hybrid_minmax(mod, "cuda")
    big = torch.randn(3 * 2**20 + 11, device="cuda")
    mn, mx = mod.group_minmax(big, 2**20, block=1024)
    rmn, rmx = kernel_checks.reference.group_minmax(big.cpu(), 2**20)
    assert kernel_checks.same(mn, rmn) and kernel_checks.same(mx, rmx)
    kernel_checks.check_quantize(mod, big, 4, 2**20)
