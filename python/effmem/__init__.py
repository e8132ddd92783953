"""effmem: memory-efficient training for PyTorch.

    from effmem import FusedAdam, OffloadAdam, clip_grad_norm_, compress_activations, linear_cross_entropy
"""
from effmem._load import load_extension

_C, build_info = load_extension()

from effmem import ops  # noqa: E402  (registers fake kernels; needs _C loaded)
from effmem.compress import compress_activations  # noqa: E402
from effmem.activations import apply_activation_policy, remove_activation_policy  # noqa: E402
from effmem.linear_ce import linear_cross_entropy  # noqa: E402
from effmem.linear_ce_hf import fuse_linear_cross_entropy, unfuse_linear_cross_entropy  # noqa: E402
from effmem.optim import FusedAdam, OffloadAdam, clip_grad_norm_  # noqa: E402
from effmem.plan import Plan, plan  # noqa: E402

__version__ = "0.1.0"
__all__ = ["FusedAdam", "OffloadAdam", "clip_grad_norm_", "compress_activations", "apply_activation_policy",
           "remove_activation_policy", "linear_cross_entropy",
           "fuse_linear_cross_entropy", "unfuse_linear_cross_entropy", "plan", "Plan", "ops", "build_info"]
