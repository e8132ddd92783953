"""Where a saved tensor's elements lie in memory.

Three cases:

* dense: the tensor covers a contiguous stretch of its storage exactly once,
  in any dim order (contiguous, transposed, channels-last, a slice along the
  first dim...). That stretch is compressed in memory order as one flat
  buffer, and the restored tensor is the buffer viewed with the original
  sizes and strides: strides come back stride for stride.
* strided: the tensor does not overlap itself but leaves gaps (q, k and v
  sliced out of one qkv projection, every other row...). hooks.py compresses
  the dense tensor it is a view of, when there is one not much larger, and
  views the restored buffer the same way; compiled backward graphs check
  saved strides, so a denser copy would not do.
* overlapping (a dim of stride 0 from expand, or an as_strided window): not
  compressible without materialising the repeats, so it is kept as it is.
"""
from typing import List, Sequence

from torch import Tensor

DENSE, STRIDED, OVERLAPPING = "dense", "strided", "overlapping"


def memory_order(sizes: Sequence[int], strides: Sequence[int]) -> List[int]:
    """Dims from outermost to innermost in memory (largest stride first; ties keep dim order)."""
    return sorted(range(len(sizes)), key=lambda d: -strides[d])


def classify(t: Tensor) -> str:
    """DENSE, STRIDED or OVERLAPPING (the last also for layouts too tangled to prove otherwise)."""
    if t.is_contiguous():  # most saves; one call instead of the walk over dims below
        return DENSE
    sizes, strides = t.shape, t.stride()
    order = memory_order(sizes, strides)
    # Size-1 dims never move the pointer, so their stride says nothing.
    inner = [d for d in reversed(order) if sizes[d] != 1]
    expected, dense = 1, True
    for d in inner:
        if strides[d] < expected:
            # Smaller than the span of the dims inside it: two indices reach one element.
            return OVERLAPPING
        if strides[d] != expected:
            dense = False
        expected = strides[d] * sizes[d]
    return DENSE if dense else STRIDED
