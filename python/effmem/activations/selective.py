"""The "selective" policy: torch's selective activation checkpointing, per decoder layer, saving the
outputs of matrix products and attention and recomputing everything else.

What a layer keeps is its input (as plain checkpointing does) and the output
of every matmul and attention kernel it ran (torch's SAC cache holds them):
the work that is expensive to redo. Norms, rotary embeddings, activation
functions and the other elementwise ops run again in backward, which costs
memory bandwidth rather than FLOPs. The math is plain autograd's: gradients
are those of an unchanged model, bit for bit.

effmem plan traces the same rule (``SAVED_OPS``) to count what it keeps.
"""
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import effmem.activations.relu  # noqa: F401 (registers effmem::relu)

_aten = torch.ops.aten
# Matmuls and attention: their outputs are kept, so backward never recomputes a product.
SAVED_OPS = frozenset(op for op in (
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    getattr(_aten, "_grouped_mm", None) and _aten._grouped_mm.default,   # mixture-of-experts layers
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    # a ReLU's exact mask (activations.relu): recomputed, it would come from the rounded stored input
    torch.ops.effmem.relu.default) if op)
SAVED_PACKETS = frozenset(op.overloadpacket for op in SAVED_OPS)


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def context():
    """The context_fn of torch.utils.checkpoint for this policy (a fresh cache per checkpointed call)."""
    return create_selective_checkpoint_contexts(policy)
