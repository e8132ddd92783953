"""Activation-memory policies for a whole model: one call, undone by another.

    model = effmem.apply_activation_policy(model, "fast")     # 8-bit saves, cheap parts recomputed
    effmem.remove_activation_policy(model)                     # as it was

Policies:

* ``"fast"``: every decoder layer keeps what is expensive to recompute
  (matmul inputs, attention's q, k, v and output, the residual stream) as
  8-bit codes and recomputes what is cheap: norms, SiLU-times-up and GELU
  outputs are rebuilt in backward from their 8-bit inputs instead of being
  kept (effmem.activations.fused, fast paths in .paths for the Llama,
  Mistral, Mixtral, Qwen2/3 and GPT-2 families of transformers and the demo
  GPT, and modules of those kinds in other models; the rest of a layer gets
  the 8-bit storage alone). Nothing runs twice but
  those elementwise ops.
* ``"checkpoint"``: each decoder layer checkpointed (torch.utils.checkpoint,
  non-reentrant): its input kept, its insides recomputed in backward.
* ``"min"``: the same, with each layer's input kept as 8-bit codes
  (effmem.activations.checkpoint): about half of checkpointing's memory in
  bf16, a quarter in fp32, for one quantisation per layer and its inverse.
* ``"selective"``: torch's selective checkpointing per layer: its input
  and the outputs of its matmuls and attention kept, the norms and
  elementwise ops recomputed (effmem.activations.selective). Exact.
* ``memory_budget=`` instead of a policy: each layer plain, "fast", "min" or
  (on a GPU) "offload", a "fast" layer whose codes go to pinned host memory;
  the mix of least time whose layers' saved activations fit the budget
  (effmem.activations.budget), chosen at the first forward of each shape and mode.

Under torch.compile, a "fast" layer is compiled as its own graph with
selective checkpointing that keeps matmul and attention outputs, and called
inside the policy's hooks (the compiled backward of a whole model would
restore every layer's saves at once).

The decoder layers are the longest nn.ModuleList of same-typed modules (a
Hugging Face model's ``model.layers``, GPT-2's ``transformer.h``, the demo
GPT's ``blocks``), in a generative model's get_decoder() where it names one
(a vision-language model's language model); an encoder-decoder model (T5,
Bart, torch's nn.Transformer) has two such stacks, its encoder's and its
decoder's, and a policy covers both.

While the policy is applied, a training forward (with gradients) runs
without a key/value cache, as under transformers' own gradient
checkpointing (effmem.activations.cache); the model's config is not
changed, and inference and generate() keep their cache.
"""
import functools
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from effmem import _checks
from effmem._replicas import holds_refusal, refuse_replication
from effmem.activations import paths, relu
from effmem.activations.cache import (HF_CHECKPOINTING, no_training_cache, refuse_cache, refuse_func_transforms,
                                      refuse_hf_checkpointing, restore_training_cache)
from effmem.activations.checkpoint import SEEDS, Seeds, checkpoint_layer, compressed_checkpoint, restore_layer
from effmem.activations.compiled import compiled_forward, leaves_graph
from effmem.activations.budget import BudgetPolicy, check_budget
from effmem.activations.fast import FastCompressor, param_shapes
from effmem.compress import _codec
from effmem.compress.hooks import torch_checkpoint_on_top
from effmem.plan.model import find_blocks, generative_decoder, mixed_layer_classes
from effmem.plan.trace import _tensors

POLICIES = ("fast", "checkpoint", "min", "selective")
_FAST = "_effmem_fast"
_BUDGET = "_effmem_budget"


def apply_activation_policy(model: nn.Module, policy: Optional[str] = None, *, memory_budget=None, bits: int = 8,
                            group_size: int = 128) -> nn.Module:
    """Apply an activation policy to every decoder layer of `model` (in place); returns the model.

    policy: "fast" (the default), "checkpoint", "min" or "selective" for every layer. memory_budget: instead of one
    policy, each layer plain, "fast", "min" or (GPU) "offload", the mix of least time whose saved activations fit: a
    fraction in (0, 1] of the layers' plain saved bytes, or bytes (an int) at the shape of each forward
    (see effmem.activations.budget; the choice is made at the first forward of each input shape).
    bits (8 or 4) and group_size (elements per scale: 32, 64, 128 or 256): the codes the lossy
    policies ("fast", "min", a budget) keep saves in; checked for every policy.
    """
    _checks.module(model)
    if memory_budget is not None:
        if policy is not None:
            raise ValueError(f"policy: memory_budget chooses the policy of each layer; leave policy unset "
                             f"(got policy={policy!r})")
        check_budget(memory_budget)
        policy = "budget"
    elif policy is None:
        policy = "fast"
    elif policy not in POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(repr(p) for p in POLICIES)}, got {policy!r}"
                         + (" (a memory budget goes by name: memory_budget=...)" if isinstance(policy, (int, float))
                            and not isinstance(policy, bool) else ""))
    _codec.check_config(bits, group_size)   # every policy: a bad value is a mistake, used or not
    stacks = layer_stacks(model)
    if not stacks:
        decoder = generative_decoder(model)
        mixed = mixed_layer_classes(decoder) if decoder is not None else []
        why = f"; its decoder's layers are of {len(mixed)} classes ({', '.join(mixed)})" if mixed else ""
        raise ValueError(f"model: {type(model).__name__} has no list of decoder layers (an nn.ModuleList of "
                         f"modules of one type) to apply a policy to{why}")
    if policy == "budget" and len(stacks) > 1:
        raise ValueError(f"memory_budget: {type(model).__name__} has {len(stacks)} stacks of layers "
                         f"({', '.join(n for n, _ in stacks)}), unlike each other; a budget chooses among "
                         "alike layers of one stack. Give a policy ('fast', 'min', ...) instead")
    named = [(f"{name}.{i}", layer) for name, layers in stacks for i, layer in enumerate(layers)]
    layers = [layer for _, layer in named]
    if any(getattr(layer, "_effmem_policy", None) is not None for layer in layers):
        raise ValueError("model: an activation policy is already applied; remove_activation_policy(model) first")
    # Every check before the first change: a refused call leaves the model as it was.
    first_name = {}
    for name, layer in named:
        if id(layer) in first_name:   # tied or looped layers: wrapped twice, then unwrapped once
            raise ValueError(f"model: {name} is the same module as {first_name[id(layer)]} (a layer used more "
                             "than once); a policy wraps each layer once, so it cannot apply to this stack")
        first_name[id(layer)] = name
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):   # transformers' flag
        raise ValueError(f"model: {HF_CHECKPOINTING}")
    for name, layer in named:
        if "forward" in layer.__dict__:
            raise ValueError(f"{type(layer).__name__} ({name}): its forward is already replaced (by "
                             "checkpointing or another library's wrapper); remove that first")
    refused_min = min_refusal(getattr(model, "config", None))
    if policy == "min" and refused_min:
        raise ValueError(f"policy: {refused_min}")
    no_training_cache(model, layers)
    if policy in ("fast", "budget"):
        comp = FastCompressor(bits=bits, group_size=group_size)
        setattr(model, _FAST, comp)
        budget = None
        if policy == "budget":
            budget = BudgetPolicy(memory_budget, layers, comp, bits, group_size,
                                  allow_min=not refused_min)
            setattr(model, _BUDGET, budget)
            budget.forward_hook = model.register_forward_pre_hook(budget.new_forward, with_kwargs=True)
        seeds = Seeds()   # the rounding seeds of the layers the budget makes "min" (next_seed)
        for i, (name, layer) in enumerate(named):
            # on the layers too: found from a model that wraps this one or that it was unwrapped into (_record)
            layer.__dict__[_FAST], layer.__dict__[_BUDGET] = comp, budget
            if budget is not None:
                layer.__dict__[SEEDS] = seeds
            layer._effmem_patched = paths.patch(layer)
            if budget is None:
                layer.forward = functools.partial(_fast_layer_forward, layer, layer.forward, comp, name, i == 0,
                                                  param_shapes(layer))
            else:
                layer.forward = functools.partial(_budget_layer_forward, layer, layer.forward, budget, i,
                                                  name, param_shapes(layer))
            layer._effmem_policy = policy
            layer._replicate_for_data_parallel = _no_replicas
        return model
    seeds = Seeds()   # "min": the rounding seeds of this model's layers (next_seed)
    for layer in layers:
        if policy == "min":
            # "fast" inside the recomputed layer where it pays: the fused norms and MLP product recompute
            # the same forward with fewer passes and run their one-pass backwards (activations.fused)
            layer._effmem_patched = paths.patch(layer)
        checkpoint_layer(layer, bits=bits if policy == "min" else None, group_size=group_size,
                         selective=policy == "selective", seeds=seeds)
        layer._replicate_for_data_parallel = _no_replicas
    return model


# nn.DataParallel's replicas would run each layer's policy forward, bound to the original layer (_replicas)
_no_replicas = functools.partial(refuse_replication, "apply_activation_policy: a model under an activation policy",
                                 "remove_activation_policy(model)")


def min_refusal(config) -> Optional[str]:
    """Why "min" cannot train a model of this config (a transformers config, or its dict), or None: "min" keeps
    nothing of a layer's forward but its input's codes (effmem plan leaves it out for the same reasons)."""
    def get(c, key):
        return c.get(key) if isinstance(c, dict) else getattr(c, key, None)
    side = [f for f in ("output_router_logits", "output_attentions") if get(config, f) is True]
    if side:
        return (f"'min' keeps nothing of a layer's forward but its input's codes, so a loss on tensors a layer makes "
                f"besides its output (config.{side[0]}=True: e.g. an MoE router's auxiliary loss) cannot "
                f"backpropagate; use 'fast', 'checkpoint' or memory_budget=, or set config.{side[0]}=False")
    # Gemma3n's last layers reuse the keys and values of earlier ones (passed on beside the hidden state)
    shared_kv = get(get(config, "text_config") or config, "num_kv_shared_layers")
    if isinstance(shared_kv, int) and shared_kv > 0:
        return (f"'min' keeps nothing of a layer's forward but its input's codes, and this model's last {shared_kv} "
                "layers reuse keys and values earlier layers make (num_kv_shared_layers), whose gradients would "
                "need those layers' graphs; use 'fast' or 'checkpoint'")
    return None


def _hidden(args, kwargs):
    """A layer's hidden state: its first argument, or hidden_states=."""
    return args[0] if args else kwargs.get("hidden_states")


def _hidden_tensor(layer, args, kwargs, who: str) -> Tensor:
    """_hidden, a tensor, or a TypeError as "min" gives (compressed checkpointing): a layer called with its
    hidden state under another keyword (block(x=x)) ran plain, silently, with nothing compressed."""
    hidden = _hidden(args, kwargs)
    if not isinstance(hidden, Tensor):
        raise TypeError(f"{type(layer).__name__}: {who} needs the hidden state as the first argument or as "
                        f"hidden_states=, got {'no arguments' if not args else type(args[0]).__name__ + ' first'}"
                        f"{' and keywords ' + ', '.join(kwargs) if kwargs else ''}")
    return hidden


def _layer_inputs(args, kwargs):
    """A layer's hidden state and its other tensor inputs."""
    hidden = _hidden(args, kwargs)
    return hidden, list(_tensors((args[1:], {k: v for k, v in kwargs.items() if v is not hidden})))


def _in_users_checkpoint(comp: FastCompressor, first: bool) -> bool:
    """Whether the layer runs inside the user's torch checkpoint (non-reentrant), which keeps its input alone and
    runs it again in backward: then it runs as it is. The first layer of a forward (not of checkpoint's recompute,
    in backward) still starts the statistics afresh."""
    if torch.compiler.is_compiling() or not torch_checkpoint_on_top():
        return False
    if first and torch._C._current_graph_task_id() == -1:
        comp.reset_stats()
    return True


def _fast_layer_forward(layer, original, comp: FastCompressor, name: str, first: bool, shapes, *args, **kwargs):
    """A layer's forward with its saves routed through the "fast" policy's compressor."""
    if not torch.is_grad_enabled():   # nothing saved: the layer as it is (traced into a compiled model's graph)
        return original(*args, **kwargs)
    refuse_hf_checkpointing(layer)
    _hidden_tensor(layer, args, kwargs, 'the "fast" policy')
    if refuse_func_transforms(layer) or _in_users_checkpoint(comp, first):
        return original(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Inside a compiled model: leave the graph here and run the layer as its own compiled graph,
        # with the hooks around it (see _compiled_layer).
        return _compiled_layer(original, comp, name, first, shapes, *args, **kwargs)
    hidden, others = _layer_inputs(args, kwargs)
    with comp.layer(name, hidden, others, shapes, first):
        return original(*args, **kwargs)


@leaves_graph
def _compiled_layer(original, comp, name, first, shapes, *args, **kwargs):
    """The layer compiled on its own (one graph per layer call, shared by layers of one class), called with
    the policy's hooks active: they store what the compiled forward saves for backward, and its backward
    restores one layer at a time. Traced whole, the model's compiled backward would restore every layer's
    saves at once."""
    hidden, others = _layer_inputs(args, kwargs)
    with comp.layer(name, hidden, others, shapes, first):
        return compiled_forward(original, selective=True)(*args, **kwargs)


def _budget_layer_forward(layer, original, budget: BudgetPolicy, index: int, name: str, shapes, *args, **kwargs):
    """A layer under memory_budget: plain, "fast", "offload" or "min", as chosen for the current input shape."""
    if not torch.is_grad_enabled():
        return original(*args, **kwargs)   # nothing saved (traced into a compiled model's graph)
    _hidden_tensor(layer, args, kwargs, "memory_budget")
    refuse_hf_checkpointing(layer)
    if refuse_func_transforms(layer) or _in_users_checkpoint(budget.comp, index == 0):
        return original(*args, **kwargs)
    if torch.compiler.is_compiling():
        return _compiled_budget_layer(layer, original, budget, index, name, shapes, *args, **kwargs)
    return _run_budget_layer(False, layer, original, budget, index, name, shapes, *args, **kwargs)


@leaves_graph
def _compiled_budget_layer(*args, **kwargs):
    """Inside a compiled model: out of the model's graph, the layer's choice made and run as in eager mode,
    each mode a compiled graph of the layer alone (see _compiled_layer). Traced into the model's graph,
    the budget's probes could not run and every layer would be plain."""
    return _run_budget_layer(True, *args, **kwargs)


def _run_budget_layer(compiled: bool, layer, original, budget: BudgetPolicy, index: int, name: str, shapes,
                      *args, **kwargs):
    hidden, others = _layer_inputs(args, kwargs)
    refuse_cache(layer, args, kwargs)   # a shape's first forward runs a layer more times (the probes)
    return budget.forward(layer, original, index, name, shapes, hidden, others, args, kwargs, compiled=compiled)


def layer_stacks(model: nn.Module) -> List[Tuple[str, List[nn.Module]]]:
    """The stacks of layers a policy applies to, with their names: the decoder layers (find_blocks, which
    effmem plan uses too), or for an encoder-decoder model (T5, Bart: config.is_encoder_decoder) its
    encoder's and its decoder's (torch's nn.Transformer's too), each a list of its own that the longest list
    alone would leave out."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        names = {id(m): n for n, m in model.named_modules()}
        stacks = []
        for get in ("get_encoder", "get_decoder"):
            part = getattr(model, get, lambda: None)()
            # (Florence2's get_decoder() is its whole BART, whose encoder's list came first where as long)
            found = [layers[0] for _, layers in stacks]
            name, layers = find_blocks(part, found) if isinstance(part, nn.Module) and id(part) in names else ("", [])
            if layers:
                stacks.append((".".join(n for n in (names[id(part)], name) if n), layers))
        if len(stacks) == 2:
            return stacks
    name, layers = find_blocks(model)
    stacks = _torch_encoder_decoder(model)
    if stacks and layers and any(layers[0] is found[0] for _, found in stacks):
        return stacks   # the model's main stack is one of an nn.Transformer's: both (not a small one inside)
    return [(name, layers)] if layers else []


def _torch_encoder_decoder(model: nn.Module) -> List[Tuple[str, List[nn.Module]]]:
    """torch's nn.Transformer, or any module holding an nn.TransformerEncoder and an nn.TransformerDecoder as
    encoder and decoder: both stacks, where the longest list alone took the encoder's."""
    for name, m in model.named_modules():
        enc, dec = getattr(m, "encoder", None), getattr(m, "decoder", None)
        if isinstance(enc, nn.TransformerEncoder) and isinstance(dec, nn.TransformerDecoder) \
                and len(enc.layers) and len(dec.layers):
            prefix = f"{name}." if name else ""
            return [(f"{prefix}encoder.layers", list(enc.layers)), (f"{prefix}decoder.layers", list(dec.layers))]
    return []


def _record(model: nn.Module, key: str):
    """The policy's compressor or budget, from the layers it was applied to (each holds a reference): found
    whether the model given wraps the one it was applied to, as PEFT's PeftModel does, or is the one
    merge_and_unload() returned. Not from the model's own attribute, which a removal through the model
    inside a wrapper leaves stale on the wrapper."""
    _checks.module(model)
    return next((m.__dict__[key] for m in model.modules()
                 if getattr(m, "_effmem_policy", None) is not None and m.__dict__.get(key) is not None), None)


def budget_choice(model: nn.Module) -> Optional[dict]:
    """Under memory_budget, the choice the latest forward ran (one per input shape): per-layer modes, measured
    bytes per layer of each mode, the budget in bytes and the bytes the choice holds; None before the first
    forward or without a budget."""
    budget = _record(model, _BUDGET)
    return None if budget is None else budget.latest()


def activation_stats(model: nn.Module):
    """What the "fast" policy saved in the latest forward (a CompressionStats), or None without it."""
    comp = _record(model, _FAST)
    return None if comp is None else comp.stats


def remove_activation_policy(model: nn.Module) -> nn.Module:
    """Undo apply_activation_policy: every layer's own forward again.

    Remove it between steps, not between a forward and its backward: a layer that "min" checkpoints runs its
    forward again in backward with its modules as they are then, and a ReLU given back its own class there
    takes its mask from the 8-bit codes instead of the exact one (a reviewer's OPT: gradients 6.6-8.8% off
    plain's instead of 1.3%)."""
    _checks.module(model)
    names = {id(m): n for n, m in model.named_modules()}
    # the layers of the model's stacks and every module a policy is on: a layer given alone (a copy of one), or
    # layers a wrapper's longer stack hides from layer_stacks (both were left on, silently: a reviewer's repro)
    every = {id(layer): layer for _, layers in layer_stacks(model) for layer in layers}
    every.update((id(m), m) for m in model.modules() if m.__dict__.get("_effmem_policy") is not None)
    every = list(every.values())
    for layer in every:   # before any change
        for m in [layer] * (layer.__dict__.get("_effmem_policy") is not None) + layer.__dict__.get(
                "_effmem_patched", []):
            if "forward" in m.__dict__ and not paths.ours(m):
                raise RuntimeError(
                    f"remove_activation_policy: {names.get(id(m), type(m).__name__)}'s forward was wrapped after the "
                    "policy was applied (by another library, such as accelerate's hooks), and the wrapper calls the "
                    "policy's forward: remove that wrapper first (accelerate: remove_hook_from_module), then the "
                    "policy")
    for layer in every:
        if holds_refusal(layer, _no_replicas):
            del layer._replicate_for_data_parallel
        paths.unpatch(layer.__dict__.pop("_effmem_patched", []))
        relu.unpatch(layer)   # a function it holds (paths.patch)
        restore_layer(layer)
    for m in model.modules():   # the model given, or the one inside a wrapper that it was applied to
        m.__dict__.pop(_FAST, None)
        budget = m.__dict__.pop(_BUDGET, None)
        if budget is not None and budget.forward_hook is not None:
            budget.forward_hook.remove()
            budget.forward_hook = None
    restore_training_cache(model)
    return model


__all__ = ["apply_activation_policy", "remove_activation_policy", "activation_stats", "budget_choice",
           "compressed_checkpoint", "restore_training_cache", "POLICIES"]
