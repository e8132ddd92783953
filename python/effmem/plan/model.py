"""What effmem plan is asked about: a model named by preset, config.json or module, and its parameters.

A Hugging Face config is turned into a model on the meta device (no memory,
no download; plan/hf_config.py), so parameter counts and names are the library's own. The
trace (trace.py) runs on smaller copies of the same config: one and two
decoder layers, from which every per-layer quantity is extrapolated exactly
(all layers of these models are alike).
"""
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

from torch import nn

from effmem.optim import _adam8
from effmem.plan import layer_kinds
from effmem.plan.hf_config import build_model, config_layers, load_config


def find_blocks(model: nn.Module, exclude: Sequence[nn.Module] = ()) -> Tuple[str, Sequence[nn.Module]]:
    """The decoder layers: the longest ModuleList whose entries are all of one type (and which is not inside an
    entry of another such list: a block's list of heads), in a generative model's
    decoder where transformers names one (get_decoder(): a vision-language model's language model, whose
    vision tower may have more blocks; its own `layers` first, where they are one list of one type: a small
    Phi-4-multimodal's 2 language layers, not its vision tower's 27 in the same module), else in the whole
    model. Two such lists of the same length (HRM's H and L modules) warn: only the first is taken. Only a
    model with an output layer (get_output_embeddings()) counts as generative: a dual encoder's (CLIP's) or a masked autoencoder's
    get_decoder() guesses a smaller tower. exclude: lists starting with one of these modules are not it (an
    encoder-decoder's encoder layers, when its get_decoder() returns the whole model)."""
    decoder = generative_decoder(model)
    if decoder is not None:
        if mixed_layer_classes(decoder):   # not a list inside one of them, nor the vision tower's (below)
            return "", []
        names = {id(m): n for n, m in model.named_modules()}
        own = getattr(decoder, "layers", None)
        if isinstance(own, nn.ModuleList) and _one_type(own) and not any(own[0] is e for e in exclude):
            name, layers = "layers", list(own)
        else:
            name, layers = _longest(decoder, exclude)
        if layers and id(decoder) in names:
            return ".".join(n for n in (names[id(decoder)], name) if n), layers
    return _longest(model, exclude)


def mixed_layer_classes(decoder: nn.Module) -> List[str]:
    """The classes of a decoder's `layers` where they are several (Jamba's, Zamba2's attention and Mamba layers,
    Mllama's self- and cross-attention ones), else []. The longest list of one class is then no stack of
    decoder layers: it was a list inside one of them (Zamba2's LoRA adapters) or the vision tower's layers."""
    layers = getattr(decoder, "layers", None)
    classes = {type(m).__name__ for m in layers} if isinstance(layers, nn.ModuleList) else set()
    return sorted(classes) if len(classes) > 1 else []


def generative_decoder(model: nn.Module) -> Optional[nn.Module]:
    output, decoder = getattr(model, "get_output_embeddings", None), getattr(model, "get_decoder", None)
    if output is None or decoder is None or output() is None:   # not a transformers model, or not generative
        return None
    decoder = decoder()
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


def _one_type(mod: nn.ModuleList) -> bool:
    return len(mod) > 0 and len({type(m) for m in mod}) == 1


def _longest(model: nn.Module, exclude: Sequence[nn.Module] = ()) -> Tuple[str, Sequence[nn.Module]]:
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList) and _one_type(mod)]
    # A list inside an entry of another of two or more (each block's heads, each layer's experts) is not the
    # blocks, however long: two blocks of four heads each had the policy on block 0's heads alone.
    inner = {n for n, _ in lists for o, om in lists if len(om) >= 2 and o != n and n.startswith(f"{o}." if o else "")}
    best: Tuple[str, Sequence[nn.Module]] = ("", [])
    ties: List[str] = []
    for name, mod in lists:
        if name in inner or any(mod[0] is e for e in exclude):
            continue
        if len(mod) > len(best[1]):
            best, ties = (name, list(mod)), []
        elif len(mod) == len(best[1]) and type(mod[0]) is type(best[1][0]):
            ties.append(name)
    if ties:
        warnings.warn(f"{type(model).__name__}: {len(ties) + 1} lists of {len(best[1])} {type(best[1][0]).__name__} "
                      f"({', '.join([best[0]] + ties)}); effmem takes {best[0]!r} as the decoder layers, and "
                      "leaves the others as they are")
    return best


@dataclass
class Trainable:
    """Which parameters train: regular expressions searched in parameter names.

    An item may end in ``#a:b`` to train only entries a..b-1 along the
    parameter's first dimension, for parameters that stack several units
    (Hugging Face's Mixtral keeps all experts of a layer in one tensor:
    ``mlp\\.experts\\.#0:2`` trains two of them). None trains everything.
    """
    text: Optional[str] = None
    items: List[Tuple[re.Pattern, Optional[Tuple[int, int]]]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: Optional[str]) -> "Trainable":
        if text is None:
            return cls()
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"trainable: expected comma-separated regular expressions, got {text!r}")
        items = []
        for raw in text.split(","):
            raw = raw.strip()
            pattern, _, part = raw.partition("#")
            if not pattern:   # 'a,' or ',': an empty pattern would match every name and train everything
                raise ValueError(f"trainable: an empty pattern in {text!r} (a stray comma?) would match every "
                                 "parameter")
            rows = None
            if part:
                m = re.fullmatch(r"(\d+):(\d+)", part)
                if not m or int(m.group(1)) >= int(m.group(2)):
                    raise ValueError(f"trainable: {raw!r}: after '#' expected a:b with a < b (rows of the first "
                                     f"dimension), got {part!r}")
                rows = (int(m.group(1)), int(m.group(2)))
            try:
                items.append((re.compile(pattern), rows))
            except re.error as e:
                raise ValueError(f"trainable: {pattern!r} is not a regular expression ({e})") from None
        return cls(text, items)

    @property
    def partial(self) -> bool:
        return any(rows is not None for _, rows in self.items)

    def numel(self, name: str, shape: Sequence[int]) -> int:
        """How many of this parameter's elements train."""
        total = 1
        for s in shape:
            total *= s
        if self.text is None:
            return total
        best = 0
        for pattern, rows in self.items:
            if pattern.search(name):
                if rows is None:
                    return total
                if len(shape) < 3:   # a matrix's rows are not experts: a pattern meant for whole layers?
                    raise ValueError(f"trainable: '#{rows[0]}:{rows[1]}' selects experts of a stacked parameter "
                                     f"(3 or more dimensions, experts first); {name} has shape {tuple(shape)}")
                first = shape[0]
                if rows[1] > first:
                    raise ValueError(f"trainable: '#{rows[0]}:{rows[1]}' asks for rows up to {rows[1]} of {name}, "
                                     f"which has {first} along its first dimension")
                take = rows[1] - rows[0]
                best = max(best, total // max(first, 1) * take)
        return best


@dataclass
class ParamInfo:
    name: str
    shape: Tuple[int, ...]
    numel: int
    trainable: int   # elements that train (0 for frozen)


@dataclass
class ModelSpec:
    """A model as the planner sees it."""
    name: str
    params: List[ParamInfo]
    num_layers: int
    config: Optional[dict] = None          # Hugging Face config, when the model came as one
    # that config as transformers resolved it building the model: aliases (GPT-2's n_embd given as
    # hidden_size) and the defaults of keys it leaves out, which the closed form and the limits read
    resolved_config: Optional[dict] = None
    module: Optional[nn.Module] = None     # the user's module, when it came as one
    # Builds a meta-device copy with n decoder layers (configs only): the trace extrapolates from 1 and 2.
    build_layers: Optional[Callable[[int], nn.Module]] = None
    trainable_text: Optional[str] = None   # the trainable= argument, for apply()
    # configs: each decoder layer's kind and each kind's signature (plan/layer_kinds.py)
    layer_kinds: Optional[List[int]] = None
    kind_signatures: Optional[list] = None
    # the attention implementation the traced model ran (transformers' config._attn_implementation), for
    # apply() to compare: eager attention saves several times what sdpa's kernels do
    attention: Optional[str] = None

    def layer_groups(self) -> List[Tuple[int, List[int]]]:
        """Per kind of layer after the first: (how many, the layers a trace of one more of them holds)."""
        return layer_kinds.groups(self.layer_kinds or [0] * self.num_layers)

    def build_kept(self, keep: List[int]) -> Optional[nn.Module]:
        """A meta-device copy holding the decoder layers at `keep` only (built with the first max(keep) + 1),
        its parameters' requires_grad as trainable= has the whole model's; None where one of those layers
        is not the whole model's layer of that index (a pattern that changes with the layer count), or
        where its input would need a gradient in one and not the other (a frozen layer after the first
        trained one, held after a frozen first layer): the trace then takes the whole model."""
        model = self.build_layers(max(keep) + 1)
        path, layers = find_blocks(model)
        if self.layer_kinds is not None:
            sigs = [self.kind_signatures[self.layer_kinds[i]] for i in keep]
            if any(layer_kinds.signature(layers[i]) != sig[0] for i, sig in zip(keep, sigs)):
                return None
            first = self.kind_signatures[self.layer_kinds[0]]
            if len(keep) > 1 and sigs[1][2] is not None and sigs[1][2] != (first[2] or any(first[1])):
                return None
        model = layer_kinds.keep_layers(model, path, keep)
        self.set_trained(model, layer_kinds.whole_names(path, keep))
        return model

    def set_trained(self, model: nn.Module, whole_name=lambda n: n) -> None:
        """requires_grad as trainable= says (a copy's names mapped to the whole model's); nothing without it."""
        if self.trainable_text is None:
            return
        which = Trainable.parse(self.trainable_text)
        for n, p in model.named_parameters():
            p.requires_grad_(which.numel(whole_name(n), tuple(p.shape)) > 0)

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def num_trainable(self) -> int:
        return sum(p.trainable for p in self.params)

    @property
    def state_blocks(self) -> int:
        """8-bit Adam's blocks (a scale per moment each) over the trained tensors, as the optimizers make them."""
        return sum(_adam8.blocks(p.trainable) for p in self.params)


def _param_infos(model: nn.Module, trainable: Trainable) -> List[ParamInfo]:
    out = []
    for name, p in model.named_parameters():  # tied parameters are listed once
        frozen_by_user = trainable.text is None and not p.requires_grad
        n = 0 if frozen_by_user else trainable.numel(name, tuple(p.shape))
        out.append(ParamInfo(name, tuple(p.shape), p.numel(), n))
    return out


# A preset name or config.json path, a config dict, a transformers PretrainedConfig, or a module.
ModelArg = Union[str, dict, nn.Module, object]


def model_spec(model: ModelArg, trainable: Optional[str] = None) -> ModelSpec:
    """Resolve the MODEL argument of effmem plan (preset, config.json path, config dict or object, module)."""
    which = Trainable.parse(trainable)
    if isinstance(model, os.PathLike):   # a pathlib.Path to a config.json or its folder
        model = os.fspath(model)
    if isinstance(model, nn.Module):
        blocks = find_blocks(model)[1]
        spec = ModelSpec(type(model).__name__, _param_infos(model, which), len(blocks), module=model)
        spec.attention = _attention(model)
    else:
        if isinstance(model, str):
            name, cfg = load_config(model)
        elif isinstance(model, dict):
            if "model_type" not in model:
                raise ValueError("model: a config dict needs a \"model_type\" key (a Hugging Face config)")
            name, cfg = model["model_type"], dict(model)
        elif hasattr(model, "to_dict") and hasattr(model, "model_type"):
            cfg = model.to_dict()
            cfg["model_type"] = model.model_type
            # to_dict leaves out the attention implementation asked for (eager keeps the [seq, seq] scores:
            # several times the activations of the sdpa kernel a model built from the dict would get). Not flash
            # attention's: transformers refuses to build it without the flash_attn package, and sdpa, which the
            # trace plans then, saves what it saves
            impl = getattr(model, "_attn_implementation", None)
            if isinstance(impl, str) and not impl.startswith("flash") and "attn_implementation" not in cfg:
                cfg["attn_implementation"] = impl
            name = model.model_type
        else:
            raise TypeError(f"model: expected a preset name, a config.json path, a Hugging Face config "
                            f"(dict or object) or an nn.Module, got {type(model).__name__}")
        vocab = cfg.get("vocab_size")
        if vocab is not None and (not isinstance(vocab, int) or vocab < 1):
            raise ValueError(f"model: the config's vocab_size is {vocab!r}; expected a whole number >= 1")
        full = build_model(cfg)
        spec = ModelSpec(name, _param_infos(full, which), config_layers(cfg), config=cfg,
                         resolved_config=full.config.to_dict(),
                         build_layers=lambda n, cfg=cfg: build_model(cfg, n))
        spec.attention = _attention(full)
        path, blocks = find_blocks(full)
        if len(blocks) != spec.num_layers:   # (Jamba: attention and Mamba layers in one list)
            raise ValueError(_mixed_layers(full, name, spec.num_layers, len(blocks)))
        trained = layer_kinds.trainability(full, path, blocks, lambda n, shape: which.numel(n, shape) > 0) \
            if which.text is not None else ((), ())
        spec.layer_kinds, spec.kind_signatures = layer_kinds.kinds(blocks, *trained)
    spec.trainable_text = which.text
    for pattern, _ in which.items:   # each item: 'q_proj,lm_head' trained q_proj alone, lm_head being tied
        if not any(pattern.search(p.name) for p in spec.params):
            raise ValueError(f"trainable: {pattern.pattern!r} matches no parameter of {spec.name} "
                             f"(names look like {spec.params[min(1, len(spec.params) - 1)].name!r}; a weight "
                             "tied to another, as lm_head's to the embedding, goes by the first one's name)")
    return spec


def _attention(model: nn.Module) -> Optional[str]:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def _mixed_layers(model: nn.Module, name: str, num_layers: int, found: int) -> str:
    """Why a model's decoder layers were not found: the list of them holds several classes (or is not there)."""
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    classes = sorted({type(m).__name__ for m in stacks[0]}) if stacks else []
    if len(classes) > 1:
        return (f"model: effmem plan models a stack of decoder layers of one class; {name}'s {num_layers} layers "
                f"are of {len(classes)} classes ({', '.join(classes)}), which it does not support")
    return (f"model: effmem plan found {found} decoder layers in {name} where its config counts {num_layers}, "
            "and cannot model it")


def techniques_on(model: nn.Module, fused_loss: bool) -> List[str]:
    """The memory techniques already on `model`, each with its undo (fused_loss: but the fused loss, which the
    caller makes itself)."""
    modules = list(model.modules())
    found = []
    # by its layers: a wrapper keeps the policy's attributes after a removal through the model inside it (a
    # PeftModel's get_base_model()), which then made apply() refuse a policy no longer on (a reviewer's run)
    if any(getattr(m, "_effmem_policy", None) is not None for m in modules):
        found.append("an activation policy (remove_activation_policy(model))")
    if any(m.__dict__.get("_effmem_compressor") is not None for m in modules):
        found.append("compress_activations (remove_compression(model))")
    if any(getattr(m, "gradient_checkpointing", False) is True for m in modules):   # transformers' flag
        found.append("transformers' gradient checkpointing (model.gradient_checkpointing_disable())")
    if model.__dict__.get("_effmem_save_on_cpu") is not None:
        found.append("an earlier apply()'s save_on_cpu hooks (build the model again)")
    if not fused_loss and model.__dict__.get("_effmem_fused_forward") is not None:
        found.append("fuse_linear_cross_entropy (unfuse_linear_cross_entropy(model))")
    return found
