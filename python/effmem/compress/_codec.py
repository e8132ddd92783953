"""The one place where compress/ reaches the quantisation kernels.

``quantize`` and ``dequantize`` are ``effmem.ops.quantize`` /
``effmem.ops.dequantize`` (the C++/CUDA op family): codes are uint8
``[rows, ceil(D * bits / 8)]`` (at 4 bits two codes per byte, low nibble
first) and stats are float32 ``[rows, ceil(D / group_size), 2]`` holding
(min, scale) per group.

Also here: argument checks shared by every entry point, and bit-packing of
bool masks (plain torch ops, eight flags per byte).
"""

from typing import Tuple

import torch
from torch import Tensor

from effmem import ops as _ops

# The dtypes the kernels take; float64 and the float8 types are kept as they are.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
check_config = _ops.check_quant_config


def memory_row(t: Tensor) -> int:
    """The length of a dense tensor's rows in memory (csrc/saved/layout.cpp's memory_row): its last dim where it
    is contiguous, else the dim it walks with stride 1 (a transposed key's head_dim)."""
    if t.dim() == 0 or t.numel() == 0:
        return max(t.numel(), 1)
    if t.is_contiguous():
        return max(t.shape[-1], 1)
    return next((t.shape[d] for d in reversed(range(t.dim())) if t.shape[d] > 1 and t.stride(d) == 1), t.numel())


def saved_groups(n: int, last_dim: int, group_size: int) -> Tuple[int, int, int]:
    """(rows, cols, group size) the saved-tensor store (csrc/saved/store.cpp, which says why) quantises n elements
    of memory whose rows (memory_row) are last_dim long as: groups within rows."""
    d = last_dim if last_dim > 0 else max(n, 1)
    if d % group_size == 0:
        return n // group_size, group_size, group_size
    return n // d, d, (d if d >= 32 and group_size % d == 0 else group_size)


def packed_bytes(rows: int, cols: int, bits: int, group_size: int) -> int:
    """Bytes held by quantize's codes and stats for a [rows, cols] input."""
    groups = -(-cols // group_size)
    return rows * (-(-cols * bits // 8)) + rows * groups * 2 * 4


quantize = _ops.quantize
dequantize = _ops.dequantize


_BIT_WEIGHTS = {}


def _weights(like: Tensor) -> Tensor:
    """The bit weights 1, 2, ..., 128 on like's device: cached per device, except for a tensor a compiler is
    tracing (its functional or fake tensors; a compiled ReLU's backward), which takes a table of its own
    trace: a cached real table in a traced graph, or a traced one in the cache, failed the compilation."""
    traced = type(like) is not Tensor
    w = None if traced else _BIT_WEIGHTS.get(like.device)
    if w is None:
        # Built on the device itself: a host-to-device copy would synchronise.
        w = torch.bitwise_left_shift(torch.ones(8, dtype=torch.uint8, device=like.device),
                                     torch.arange(8, dtype=torch.uint8, device=like.device))
        if not traced:
            _BIT_WEIGHTS[like.device] = w
    return w


def pack_bool(flat: Tensor) -> Tensor:
    """A 1-D bool tensor -> uint8, eight flags per byte (first flag in the lowest bit)."""
    pad = (-flat.numel()) % 8
    bytes8 = torch.nn.functional.pad(flat.to(torch.uint8), (0, pad)).view(-1, 8)
    return (bytes8 * _weights(flat)).sum(dim=1, dtype=torch.uint8)


def unpack_bool(packed: Tensor, n: int) -> Tensor:
    bits = (packed.unsqueeze(1) & _weights(packed)) != 0
    return bits.reshape(-1)[:n]
