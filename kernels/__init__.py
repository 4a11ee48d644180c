"""tta_kernels: DAF kernels (quantize + bit-pack, unpack + dequantize, group min/max) with
PyTorch fallbacks (installed from the kernels/ folder).

    qt = quantize_pack(flat, bits=4, group=128)         # Quantized(codes, mn, scale)
    x_hat = unpack_dequantize(qt, 4, 128, flat.numel(), flat.dtype)
    qt, mask = quantize_pack_mask(relu_out, 4, 128, (0.0, float("inf")))  # + ReLU mask
    both = unpack_dequantize_relu(qt, 4, 128, relu_out.numel(), mask)  # > 0 exactly as mask

reference: the pure-PyTorch oracle and the format's definition; cpu: the vectorised (and a
torch.compile) CPU path; triton_kernels: CUDA kernels, imported only on first CUDA use;
dispatch: the choice, with one-warning fallbacks; bn_stats: robust BN's statistics pass
(batch mean/variance, running statistics moved) in one C read, PyTorch's pass elsewhere.
Importing this package needs neither a GPU nor triton nor a C++ compiler.
"""

from .dispatch import (
    backend,
    group_minmax,
    native_masks,
    quantize_pack,
    quantize_pack_mask,
    unpack_dequantize,
    unpack_dequantize_relu,
)
from .reference import BITS, Quantized, n_groups, packed_nbytes

__all__ = ["BITS", "Quantized", "backend", "group_minmax", "n_groups", "native_masks",
           "packed_nbytes", "quantize_pack", "quantize_pack_mask", "unpack_dequantize",
           "unpack_dequantize_relu"]
