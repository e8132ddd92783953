"""Activation-memory policies for a whole model: one call, undone by another.

    model = effmem.apply_activation_policy(model, "min")      # checkpointed layers, inputs kept in 8 bits
    effmem.remove_activation_policy(model)                     # as it was

Policies:

* ``"checkpoint"``: each decoder layer checkpointed (torch.utils.checkpoint,
  non-reentrant): its input kept, its insides recomputed in backward.
* ``"min"``: the same, with each layer's input kept as 8-bit codes
  (effmem.activations.checkpoint): about half of checkpointing's memory in
  bf16, a quarter in fp32, for one quantisation per layer and its inverse.

The decoder layers are the longest nn.ModuleList of same-typed modules (a
Hugging Face model's ``model.layers``, GPT-2's ``transformer.h``, the demo
GPT's ``blocks``).
"""
from torch import nn

from effmem.activations.checkpoint import checkpoint_layer, compressed_checkpoint, restore_layer
from effmem.plan.model import find_blocks

POLICIES = ("checkpoint", "min")


def apply_activation_policy(model: nn.Module, policy: str = "min", *, bits: int = 8,
                            group_size: int = 128) -> nn.Module:
    """Apply an activation policy to every decoder layer of `model` (in place); returns the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(repr(p) for p in POLICIES)}, got {policy!r}")
    layers = find_blocks(model)[1]
    if not layers:
        raise ValueError(f"model: {type(model).__name__} has no list of decoder layers (an nn.ModuleList of "
                         "modules of one type) to apply a policy to")
    if any(getattr(layer, "_effmem_policy", None) is not None for layer in layers):
        raise ValueError("model: an activation policy is already applied; remove_activation_policy(model) first")
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # A recomputed layer would append its keys and values to the cache again (as transformers'
        # own gradient checkpointing, training turns the cache off).
        config.use_cache = False
    for layer in layers:
        checkpoint_layer(layer, bits=bits if policy == "min" else None, group_size=group_size)
    return model


def remove_activation_policy(model: nn.Module) -> nn.Module:
    """Undo apply_activation_policy: every layer's own forward again."""
    for layer in find_blocks(model)[1]:
        restore_layer(layer)
    return model


__all__ = ["apply_activation_policy", "remove_activation_policy", "compressed_checkpoint", "POLICIES"]
