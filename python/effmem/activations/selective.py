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
import inspect

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import (CheckpointPolicy, SelectiveCheckpointContext,
                                    create_selective_checkpoint_contexts)

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


# Views that do not share their base's version counter: torch cannot see an in-place op on one of them change a
# kept output (the CPU's GRU cell splits a product's output with unsafe_split, then adds into a piece in place:
# gradients 32% off, with no error, in a reviewer's run).
_UNSAFE_VIEWS = frozenset((_aten.unsafe_split.Tensor, _aten.unsafe_split_with_sizes.default,
                           _aten.unsafe_chunk.default))


# Whether torch hands the policy the op's output (op_output, newer than torch 2.11): without it only the bases of
# unsafe views stand for the kept outputs, and a write through `.data` into one goes unseen, as torch's own check.
SEES_OUTPUTS = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


class KeptOutputChanged(RuntimeError):
    """An op in the forward wrote into the storage of an output the policy keeps (checkpoint.py names the layer)."""


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _storage(t) -> int:
    """The address of a plain tensor's storage; 0 where there is none to compare (meta, empty, sparse, a subclass
    such as DTensor or FakeTensor, whose storage has no data pointer, not a tensor)."""
    if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.device.type == "meta"
            or t.numel() == 0):
        return 0
    return t.untyped_storage().data_ptr()


def _written(op, args, kwargs):
    """The tensors `op` writes into (x.add_(y): x; out= arguments; each of a list, as _foreach_mul_'s or FSDP2's
    split_with_sizes_copy's: a list passed whole raised AttributeError in the check, a reviewer's repro)."""
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            w = args[i] if i < len(args) else kwargs.get(a.name)
            yield from (t for t in (w if isinstance(w, (list, tuple)) else (w,)) if isinstance(t, torch.Tensor))


def checked_policy():
    """`policy`, also refusing a write into a kept output's memory through another tensor that autograd does not
    track as a view of it (an unsafe_split piece, `.data`), whose writes torch's check of the cache's version
    counters misses, or through a view of such a tensor (matmul's _unsafe_view of its product, sliced or
    permuted: Gemma3n's AltUp). Writes to the output itself or its views are left to torch (one into the layer's
    last product, which its recompute never reaches, is exact). The kept outputs come from the policy's context
    (op_output, in newer torch); without it (torch 2.11), the bases of unsafe views stand for them, and the input
    of an _unsafe_view right after a kept op (matmul's of its product: Falcon's `mlp_output += attention_output`
    went unseen there, gradients 51% off). Known by storage address and tensor identity (_cdata: C++ code, as the
    GRU cell, drops the Python objects of the tensors it holds). Checked in the forward only: the recompute runs
    the same ops, and releases the kept outputs as it uses them, whose addresses a new tensor may then take
    (reshape's copy through _unsafe_view, then dropout's mask written in place: refused for nothing)."""
    kept = {}   # storage address -> identities of the kept outputs in it (torch's cache holds them to backward)
    last = [None]   # the previous op's decision (an older torch: matmul's _unsafe_view follows its product)

    def watch(t) -> None:
        p = _storage(t)
        if p:
            kept.setdefault(p, set()).add(t._cdata)

    def untracked_alias(w) -> bool:
        if w._is_view():   # a write through a view lands in its base, whose version counter torch's check follows
            w = w._base    # (the root: torch's views of views share it)
        ids = kept.get(_storage(w))
        return ids is not None and w._cdata not in ids

    def check(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        decision = policy(ctx, op, *args, **kwargs)
        if torch.compiler.is_compiling() or getattr(ctx, "is_recompute", False):
            return decision
        if hasattr(ctx, "op_output"):
            if decision is CheckpointPolicy.MUST_SAVE:
                for t in tree_flatten(ctx.op_output)[0]:
                    watch(t)
        elif op in _UNSAFE_VIEWS or (op is _aten._unsafe_view.default and last[0] is CheckpointPolicy.MUST_SAVE):
            watch(args[0])   # an older torch
        last[0] = decision
        schema = getattr(op, "_schema", None)
        if kept and schema is not None and schema.is_mutable and any(
                untracked_alias(w) for w in _written(op, args, kwargs)):
            raise KeptOutputChanged(f"{op} writes into a matrix product's output that the policy keeps, through a "
                                    "tensor torch's version check does not follow")
        return decision
    return check


def context():
    """The context_fn of torch.utils.checkpoint for this policy (a fresh cache per checkpointed call). What it
    keeps bypasses saved-tensor hooks around it (the user's save_on_cpu, compress_activations), as in every
    torch so far: torch 2.14 warns at each kept output that a later release routes them through, and sets
    its choice (checkpoint's respect_saved_tensors_hooks) only on a caching mode handed to it as it is, where
    the eager policy hands it wrapped (torch_checkpoint._Reentrant). Set here; checkpoint() called with this
    context_fn itself overrides it with its argument."""
    forward, recompute = create_selective_checkpoint_contexts(checked_policy())
    if hasattr(forward, "respect_saved_tensors_hooks"):
        forward.respect_saved_tensors_hooks = False
    return forward, recompute
