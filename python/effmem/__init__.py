"""effmem: memory-efficient training for PyTorch.

    from effmem import FusedAdam, OffloadAdam, clip_grad_norm_, compress_activations
"""
from effmem._load import load_extension

_C, build_info = load_extension()

from effmem import ops  # noqa: E402  (registers fake kernels; needs _C loaded)
from effmem.compress import compress_activations  # noqa: E402
from effmem.optim import FusedAdam, OffloadAdam, clip_grad_norm_  # noqa: E402

__version__ = "0.1.0"
__all__ = ["FusedAdam", "OffloadAdam", "clip_grad_norm_", "compress_activations", "ops", "build_info"]
