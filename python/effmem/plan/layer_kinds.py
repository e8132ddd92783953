"""Decoder stacks whose layers are not all alike, for the trace's extrapolation (plan/extrapolate.py).

DeepSeek-V2/V3 start with dense layers (first_k_dense_replace) before their mixture-of-experts ones,
Qwen-MoE's decoder_sparse_step and mlp_only_layers interleave the two: extrapolating from the first two
layers counted a 61-layer DeepSeek-V3 as 61 dense layers (0.83x of its activations traced whole). Layers
are grouped by what they are made of; each kind's cost per layer is traced once, on a copy holding the
first layer and one layer of that kind.
"""
from collections import OrderedDict
from typing import List, Sequence, Tuple

from torch import nn


# Attributes by which transformers' layers of one class differ: sliding-window or full attention per layer
# (config.layer_types; Gemma2/3, Qwen2, Cohere2, Olmo3 name it in one of these), whose masks differ in size.
_VARIANT_ATTRS = ("attention_type", "layer_type", "sliding_window", "is_sliding")


def signature(layer: nn.Module) -> tuple:
    """What decides the tensors a layer saves: its modules' types, its parameters' shapes and its attention's
    window."""
    return (tuple((n, type(m).__name__) for n, m in layer.named_modules()),
            tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()),
            tuple((n, a, getattr(m, a)) for n, m in layer.named_modules() for a in _VARIANT_ATTRS
                  if isinstance(getattr(m, a, None), (str, int, bool))))


def kinds(layers: Sequence[nn.Module], trained: Sequence[Tuple[bool, ...]] = (),
          grad_in: Sequence[bool] = ()) -> Tuple[List[int], List[tuple]]:
    """Each layer's kind (numbered in order of first appearance) and each kind's signature: what the layer is
    made of, which of its parameters train (trainable=) and whether its input needs a gradient (something
    before it trains), since a frozen layer saves less, and nothing at all before the first trained one."""
    found: List[tuple] = []
    of_layer = []
    for i, layer in enumerate(layers):
        sig = (signature(layer), tuple(trained[i]) if trained else None, bool(grad_in[i]) if grad_in else None)
        if sig not in found:
            found.append(sig)
        of_layer.append(found.index(sig))
    return of_layer, found


def trainability(model: nn.Module, path: str, layers: Sequence[nn.Module], trains) -> Tuple[list, list]:
    """Per decoder layer: which of its parameters train (trains(name, shape) -> bool) and whether its input
    needs a gradient (the input embedding or an earlier layer trains)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    before = any(trains(n, tuple(p.shape)) for n, p in model.named_parameters()
                 if embedding is not None and any(p is q for q in embedding.parameters()))
    masks, grad_in = [], []
    for i, layer in enumerate(layers):
        masks.append(tuple(trains(f"{path}.{i}.{n}", tuple(p.shape)) for n, p in layer.named_parameters()))
        grad_in.append(before)
        before = before or any(masks[-1])
    return masks, grad_in


def whole_names(path: str, keep: Sequence[int]):
    """A copy's parameter name -> the whole model's (a copy's layer j is the whole model's layer keep[j])."""
    prefix = path + "."

    def name(n: str) -> str:
        if not n.startswith(prefix):
            return n
        j, _, rest = n[len(prefix):].partition(".")
        return f"{prefix}{keep[int(j)]}.{rest}" if j.isdigit() and int(j) < len(keep) else n
    return name


def groups(of_layer: List[int]) -> List[Tuple[int, List[int]]]:
    """For the layers after the first, per kind: how many there are, and the layers a trace of one more layer
    of that kind holds (the first layer and the first of that kind after it). All alike: [(L - 1, [0, 1])]."""
    out = {}
    for i, k in enumerate(of_layer[1:], start=1):
        count, keep = out.get(k, (0, [0, i]))
        out[k] = (count + 1, keep)
    return list(out.values())


def keep_layers(model: nn.Module, path: str, keep: List[int]) -> nn.Module:
    """The model with only the decoder layers at `keep` in its layer list (at `path`), in that order."""
    stack = model.get_submodule(path)
    if list(keep) != list(range(len(stack))):
        chosen = [stack[i] for i in keep]
        stack._modules = OrderedDict((str(j), m) for j, m in enumerate(chosen))
        # the forward picks layer j's mask by config.layer_types[j]: the kept layers' own, in their new places
        config = getattr(model, "config", None)
        types = getattr(config, "layer_types", None)
        # (Jamba's is computed: no setter; Bamba's an alias, attribute_map, of a computed one)
        name = getattr(config, "attribute_map", {}).get("layer_types", "layer_types")
        if isinstance(types, list) and len(types) > max(keep) and not isinstance(
                getattr(type(config), name, None), property):
            config.layer_types = [types[i] for i in keep] + types[len(keep):]
    return model
