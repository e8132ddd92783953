"""Hugging Face causal LMs computing their training loss with effmem.linear_cross_entropy.

    model = effmem.fuse_linear_cross_entropy(model)     # Llama, Mistral, Qwen, GPT-2, ... (SUPPORTED)
    loss = model(input_ids=x, labels=y).loss            # no [batch, seq, vocab] logits
    effmem.unfuse_linear_cross_entropy(model)           # as it was

How: the model's own forward runs unchanged (its arguments, caches, MoE router losses), except
that, when it is given labels, its ``lm_head`` passes the hidden states through instead of
making logits and its ``loss_function`` computes the fused loss from them. The output then has
``logits=None``. Without labels (inference, generation) or without gradients (evaluation under
torch.no_grad: Trainer.evaluate, whose compute_metrics reads the logits) nothing changes.
"""
import functools
import inspect
import re
import threading
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from effmem import _checks
from effmem._replicas import refuse_replication
from effmem.linear_ce import check_grad_in_forward, linear_cross_entropy
from effmem.optim._validate import is_dtensor

# Families whose forward feeds lm_head's output straight into loss_function (no logit
# soft-capping or scaling in between, which the passed-through hidden states would get), each
# tested against its own loss (tests/test_linear_ce_hf.py). Not Gemma 2/3 (soft-capping), Granite or
# Cohere (scaled logits): _feeds_head_to_loss refuses those, and any listed family whose forward
# changes so in some transformers release.
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
             "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GPT2LMHeadModel",
             "GemmaForCausalLM", "Phi3ForCausalLM", "PhiForCausalLM", "OlmoForCausalLM", "Olmo2ForCausalLM",
             "StableLmForCausalLM", "Starcoder2ForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM")

# After the head's call, a statement that changes the logits before the loss sees them.
_CHANGES_LOGITS = re.compile(r"\blogits\s*(=|\*=|/=|\+=|-=)(?!=)|\blogits\.(mul|div|add|sub|clamp|tanh)_?\(")


# After the loss: the logits returned (logits=logits, a tuple's logits,) or given to the loss itself, nothing else
_RETURNS_LOGITS = re.compile(r"self\.loss_function\([^\n]*|\blogits\s*=\s*logits\b|\(logits,\)|^\s*logits,\s*$", re.M)


def _feeds_head_to_loss(source: str) -> bool:
    """Whether a forward's source assigns the head's output to logits as a statement of its own, then calls
    the loss on them, with nothing changing the logits in between, nothing after reading them but the
    output, and no soft-capping anywhere. (A class of the user's own under a listed name, with a tanh around
    the head's call or a z-loss from the logits after the loss, was taken, its loss silently another.)"""
    head, loss = source.find("self.lm_head("), source.find("self.loss_function(")
    if head < 0 or loss < head or "softcap" in source:
        return False
    start = source.rfind("\n", 0, head) + 1
    end = _closing_paren(source, head + len("self.lm_head"))
    line_end = source.find("\n", end)   # (> 0: the loss comes later)
    if (end < 0 or line_end < 0 or re.fullmatch(r"\s*logits\s*=\s*", source[start:head]) is None
            or source[end + 1:line_end].split("#")[0].strip()):   # the call, then only a comment
        return False
    between = source[line_end + 1:loss]
    return (_CHANGES_LOGITS.search(between) is None
            and re.search(r"\blogits\b", _RETURNS_LOGITS.sub("", source[loss:])) is None)


def _closing_paren(source: str, opening: int) -> int:
    """The index of the parenthesis closing the one at `opening` (-1 if none)."""
    depth = 0
    for i in range(opening, len(source)):
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        if depth == 0:
            return i
    return -1


def knows(model: nn.Module) -> bool:
    """Whether fuse_linear_cross_entropy can take this model's class (effmem plan asks too)."""
    return type(model).__name__ in SUPPORTED and _feeds_head_to_loss(inspect.getsource(type(model).forward))


# Per thread, the heads passing their input through now (a training forward with labels), each with what it
# passed: another thread's forward of the same model (inference beside training) must get logits.
_PASSING = threading.local()


def _passing() -> dict:
    heads = getattr(_PASSING, "heads", None)
    if heads is None:
        heads = _PASSING.heads = {}
    return heads


def _head_forward(head: nn.Module, original, x: Tensor) -> Tensor:
    """The lm_head's forward while fused: its input passed through in a fused forward with labels (in this
    thread), else its own forward (a wrapper another library put there included)."""
    heads = _passing()
    if head in heads:
        heads[head] = x   # for _fused_forward to find in a tuple output (its place varies)
        return x
    return original(x)


class _FusedLoss:
    """The model's loss_function while fused: the causal-LM loss of HF (labels shifted by one,
    ignore_index, num_items_in_batch), from the hidden states the head passed through."""

    def __init__(self, head: nn.Module, fallback, grad_in_forward: Optional[bool] = None):
        self.head, self.fallback, self.grad_in_forward = head, fallback, grad_in_forward

    def __call__(self, logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch=None,
                 ignore_index: int = -100, shift_labels: Optional[Tensor] = None, **kwargs) -> Tensor:
        if self.head not in _passing():  # called with real logits
            return self.fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        hidden = logits
        if is_dtensor(self.head.weight):
            raise RuntimeError("fuse_linear_cross_entropy: lm_head's weight is sharded (a DTensor) when the loss "
                               "reads it: lm_head is an FSDP2 unit of its own (fully_shard(model.lm_head)), which "
                               "reshards it after its forward, before the fused loss runs. Leave lm_head to the "
                               "model's own fully_shard(model), or fully_shard(model.lm_head, "
                               "reshard_after_forward=False)")
        if self.head.weight.is_meta and not hidden.is_meta:   # (effmem plan traces on meta tensors)
            raise RuntimeError("fuse_linear_cross_entropy: lm_head's weight is on the meta device when the loss reads "
                               "it: offloaded (accelerate's cpu_offload, or a device_map that offloads lm_head), "
                               "loaded only inside lm_head's own forward, which the fused loss does not run. Keep "
                               "lm_head on the device (device_map), or unfuse_linear_cross_entropy(model)")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.head.weight,
                                    shift_labels.reshape(-1).to(hidden.device), self.head.bias,
                                    ignore_index=ignore_index, reduction="sum" if num_items_in_batch is not None
                                    else "mean", grad_in_forward=self.grad_in_forward)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def fuse_linear_cross_entropy(model: nn.Module, *, grad_in_forward: Optional[bool] = None) -> nn.Module:
    """Make a Hugging Face causal LM compute its ``labels=`` loss without logits (in place;
    returns the model). Raises TypeError for a model it does not know.

    grad_in_forward: linear_cross_entropy's choice for every loss of the model. None (its default)
    recomputes the logits in backward for a trained bf16/fp16 head (no logits memory, one more matrix
    product); True makes the gradients in forward instead (three products: faster than the unfused
    loss on an H200 at 16k tokens x 128k vocabulary, for a float32 buffer of the head's size while
    the weight gradient is summed)."""
    _checks.module(model)
    check_grad_in_forward(grad_in_forward)   # at fusing, not at the first loss
    base = _peft_base(model)
    if base is not None and knows(base):   # PEFT's PeftModel (a LoRA fine-tune): its model is what runs the loss
        fuse_linear_cross_entropy(base, grad_in_forward=grad_in_forward)
        return model
    name = type(model).__name__
    fused = getattr(model, "_effmem_fused_forward", None)
    if fused is not None:   # fused already: the choice given now, and the output layer the model has now
        fused.follow()
        fused.loss.grad_in_forward = grad_in_forward
        return model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not knows(model):
        known = [c.__name__ for c in type(model).__mro__[1:] if c.__name__ in SUPPORTED]
        if base is not None:
            hint = f"; {name} wraps a {type(base).__name__} (get_base_model()), not one of those either"
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):   # torch.compile's OptimizedModule
            hint = (f"; {name} is torch.compile's wrapper of a {type(model._orig_mod).__name__}: fuse before "
                    "compiling (compile the fused model)")
        elif isinstance(getattr(model, "module", None), nn.Module):   # DDP and other wrappers
            hint = f"; {name} wraps a model: fuse that one (fuse_linear_cross_entropy(model.module)), or fuse first"
        elif known and _fully_sharded(model):   # FSDP2's fully_shard makes the class a subclass (FSDPLlama...)
            hint = f"; {name} is a {known[0]} made another class since (fully_shard): fuse before sharding"
        elif known:
            hint = (f"; {name} subclasses {known[0]}, whose forward it may change: fusing takes the listed "
                    "classes themselves")
        else:
            hint = ""
        # a model that changes its logits before the loss: the plain call below would give another loss
        config = getattr(model, "config", None)
        cap = getattr(config, "final_logit_softcapping", None)
        scale = next(((k, getattr(config, k)) for k in ("logit_scale", "logits_scaling")
                      if getattr(config, k, None) not in (None, 1, 1.0)), None)
        # a head with a bias (GPT-J's): left out, the call gave another loss (5.59 where the model's was 6.28)
        hidden, extra, why = "hidden", "", ""
        bias = ", lm_head.bias" if getattr(head, "bias", None) is not None else ""
        if cap:
            extra = f", logit_softcap={cap}"
            why = f" (its config's final_logit_softcapping: {name} soft-caps its logits)"
        elif scale:
            op = f"{'*' if scale[0] == 'logit_scale' else '/'} {scale[1]}"
            hidden, bias = f"hidden {op}", bias and f"{bias} {op}"
            why = (f" ({name} scales its logits by its config's {scale[0]}: the hidden states scaled so, the loss "
                   "is the model's)")
        own = f"effmem.linear_cross_entropy({hidden}, lm_head.weight, labels{bias}{extra}){why}"
        # a causal LM's loss shifts its labels by one; a masked LM's (BERT's) does not, and has no lm_head
        causal = name.endswith(("ForCausalLM", "LMHeadModel")) or getattr(config, "is_decoder", False) is True
        align = ("the labels shifted by one against the last hidden states (hidden[:, :-1], labels[:, 1:]) as the "
                 "model's loss shifts them" if causal else "the hidden states and labels aligned as the model's "
                 "own loss aligns them, lm_head being its output layer (model.get_output_embeddings())")
        raise TypeError(f"model: effmem.fuse_linear_cross_entropy knows {', '.join(SUPPORTED)} (a forward that "
                        f"feeds lm_head straight into loss_function), got {name}{hint}; or use {own} in your "
                        f"own loss, {align}")
    _check_head(head, name)
    _check_loss(model, name)
    _check_hooks(head)
    # Instance attributes holding module-level functions, not closures or classes made here: a deep copy
    # of the model then runs itself (not the original), and the model pickles.
    # what fusing replaces, as instance attributes (None: the class's), for unfuse to put back
    model._effmem_forward_before = model.__dict__.get("forward")
    model._effmem_loss_before = model.__dict__.get("_loss_function")
    _patch_head(head)
    model.loss_function = loss = _FusedLoss(head, model.loss_function, grad_in_forward)
    model.forward = model._effmem_fused_forward = _FusedForward(model, model.forward, head, loss)
    model._replicate_for_data_parallel = _no_replicas
    return model


# nn.DataParallel's replicas would run the fused forward and loss, bound to the original model (_replicas)
_no_replicas = functools.partial(refuse_replication, "fuse_linear_cross_entropy: a fused model",
                                 "unfuse_linear_cross_entropy(model)")


def _peft_base(model: nn.Module) -> Optional[nn.Module]:
    """The model inside PEFT's PeftModel (get_base_model()), for a wrapper that fusing does not know itself.
    PEFT's wrappers call that model's forward, labels and all, and pass attribute reads through to it."""
    inside = getattr(model, "get_base_model", None)
    if not callable(inside) or knows(model):
        return None
    base = inside()
    return base if isinstance(base, nn.Module) and base is not model else None


def _check_head(head, name: str) -> None:
    if type(head) is not nn.Linear:
        raise TypeError(f"model: {name}'s output layer is a {type(head).__module__}.{type(head).__name__}, not a "
                        "plain torch.nn.Linear (wrapped to be trained, e.g. by PEFT's modules_to_save or a LoRA "
                        "on lm_head), whose weight alone would miss what the wrapper adds; fusing supports a "
                        "plain lm_head only: use effmem.linear_cross_entropy(hidden, weight, labels) in your own "
                        "loss")


def own_loss(model: nn.Module) -> bool:
    """Whether the model's loss_function is transformers' causal-LM cross-entropy, which the fused loss computes
    (effmem plan asks too): one set by hand (a z-loss, weights) would be replaced silently."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:   # a transformers without the mapping: its models name no loss of their own
        return True
    return model.loss_function is LOSS_MAPPING.get("ForCausalLM")


def _check_loss(model: nn.Module, name: str) -> None:
    if not own_loss(model):
        loss = model.loss_function
        raise TypeError(f"model: {name}.loss_function is {getattr(loss, '__name__', type(loss).__name__)}, not "
                        "transformers' causal-LM cross-entropy (ForCausalLMLoss), which is what the fused loss "
                        "computes: fusing would replace yours. Compute your loss from the hidden states with "
                        "effmem.linear_cross_entropy(hidden, lm_head.weight, labels) (output_hidden_states=True), "
                        "or fuse with the model's own loss_function")


def _check_hooks(head: nn.Module) -> None:
    """Forward hooks on lm_head would get the hidden states it passes through where they expect logits. Checked
    when fusing (not at each forward: hooks put on every module later, such as effmem plan's trace, observe
    shapes only); compress_activations' module tracking reads no output (_effmem_observes)."""
    if head.weight.is_meta and getattr(head, "_hf_hook", None) is not None:
        raise RuntimeError("fuse_linear_cross_entropy: lm_head is offloaded by accelerate (cpu_offload, or a "
                           "device_map that offloads it): its weight is on the meta device except inside lm_head's "
                           "own forward, which the fused loss does not run. Keep lm_head on the device")
    if any(not getattr(getattr(h, "__func__", h), "_effmem_observes", False) for h in head._forward_hooks.values()):
        raise RuntimeError("fuse_linear_cross_entropy: lm_head has forward hooks, which would see the hidden states "
                           "it passes to the fused loss instead of logits (and a hook that frees its weight after "
                           "the forward, as DeepSpeed ZeRO-3's, would free it before the loss reads it). Remove them "
                           "(the handle's .remove()), or unfuse_linear_cross_entropy(model)")


def _patch_head(head: nn.Module) -> None:
    head._effmem_forward_before = head.__dict__.get("forward")   # None: the class's
    head.forward = functools.partial(_head_forward, head, head.forward)


def _unpatch_head(head: nn.Module) -> None:
    """The head's own forward again, unless a wrapper was put on it since (it calls ours, which then passes
    nothing through: _fused_forward never lists a head no longer fused)."""
    kept = head.__dict__.pop("_effmem_forward_before", None)
    now = head.__dict__.get("forward")
    if isinstance(now, functools.partial) and now.func is _head_forward:
        if kept is None:
            head.__dict__.pop("forward", None)
        else:
            head.__dict__["forward"] = kept


def _fully_sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:   # a torch without distributed
        return False
    return isinstance(model, FSDPModule)


class _FusedForward:
    """The model's forward while fused: with labels, lm_head passes the hidden states to the fused loss.

    It shows the original's signature, which transformers reads: the Trainer keeps only the batch columns
    the forward names, and generate() builds attention masks and position ids, and asks for the last
    position's logits only, for a forward that names them (a bare (*args, **kwargs) lost all of that)."""

    def __init__(self, model: nn.Module, original, head: nn.Module, loss: _FusedLoss):
        self.model, self.original, self.head, self.loss = model, original, head, loss
        # set by unfuse when a wrapper put on model.forward after fusing calls this one: the model's own
        # forward from then on, the wrapper kept
        self.inert = False
        self.warned = False
        # where labels sits among the positional parameters (None: keyword only or absent): labels given by
        # position were not seen, and the loss was made from full logits
        params = list(inspect.signature(original).parameters.values())
        self.names = [p.name for p in params]
        self.labels_at = next((i for i, p in enumerate(params) if p.name == "labels"
                               and p.kind == p.POSITIONAL_OR_KEYWORD), None)
        if self.labels_at is not None and any(p.kind != p.POSITIONAL_OR_KEYWORD
                                              for p in params[:self.labels_at + 1]):
            self.labels_at = None

    def follow(self) -> None:
        """The model's output layer now: replaced by another plain nn.Linear since fusing (resize_token_embeddings
        makes a new one for an untied head), the fusing moves to it; wrapped, refused."""
        head = self.model.get_output_embeddings()
        if head is self.head:
            return
        if type(head) is not nn.Linear:
            raise RuntimeError("fuse_linear_cross_entropy: the model's output layer is no longer the lm_head it "
                               f"fused but a {type(head).__name__} (wrapped since, e.g. by PEFT's modules_to_save "
                               "or a LoRA on lm_head), so the loss would get logits (or hidden states plus a "
                               "LoRA's logits) instead of hidden states. Fusing supports a plain lm_head only (a "
                               "LoRA elsewhere is fine): unfuse_linear_cross_entropy(model), or train lm_head's "
                               "weight itself (requires_grad) rather than through a wrapper")
        _unpatch_head(self.head)
        _patch_head(head)
        self.head = self.loss.head = head

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.original)

    def __call__(self, *args, **kwargs):
        if self.inert:
            return self.original(*args, **kwargs)
        if self.labels_at is not None and len(args) > self.labels_at:
            # labels (and what follows it) by position: by name, where the fused loss looks for it
            named = dict(zip(self.names[self.labels_at:], args[self.labels_at:]))
            if len(named) < len(args) - self.labels_at or named.keys() & kwargs.keys():
                return self.original(*args, **kwargs)   # more positionals than names, or a clash: its own error
            args, kwargs = args[:self.labels_at], {**kwargs, **named}
        if kwargs.get("labels") is not None:
            self.follow()
            if self.model.__dict__.get("_loss_function") is not self.loss:
                raise RuntimeError("fuse_linear_cross_entropy: model.loss_function was replaced after fusing, and "
                                   "would get hidden states where it expects logits. Set it before fusing (which "
                                   "refuses a loss other than transformers' own), or unfuse_linear_cross_entropy("
                                   "model) first")
        if kwargs.get("labels") is None and self.model.training and torch.is_grad_enabled() and not self.warned:
            self.warned = True
            warnings.warn("fuse_linear_cross_entropy: a training forward without labels= makes the full logits "
                          "(the fused loss needs the labels): a loss made from them outside the model, such as "
                          "transformers' Trainer with label_smoothing_factor > 0 (it takes the labels out of the "
                          "batch), holds the logits' memory as if unfused. Pass labels= to the model, or "
                          "effmem.linear_cross_entropy(hidden, lm_head.weight, labels, label_smoothing=...) in "
                          "your own loss", stacklevel=2)
        return _fused_forward(self.original, self.head, *args, **kwargs)


def _fused_forward(original, head: nn.Module, *args, **kwargs):
    # Without gradients no backward will keep the logits, and evaluation may read them (Trainer's
    # compute_metrics got predictions=None and dropped its metrics, silently): the model's own forward.
    if kwargs.get("labels") is None or not torch.is_grad_enabled():
        return original(*args, **kwargs)
    heads = _passing()
    heads[head] = None
    try:
        out = original(*args, **kwargs)
    finally:
        passed = heads.pop(head, None)
    # The logits slot held the hidden states passed through. A ModelOutput is a dict whose item outlives
    # setting the attribute to None (the output kept them alive): clear the item, which clears the
    # attribute too. With return_dict=False the output is the ModelOutput's tuple, which leaves out its
    # None fields (an MoE's aux_loss comes before the logits only when router logits are asked for), so
    # the slot is found by identity.
    if isinstance(out, dict):
        out["logits"] = None
    elif isinstance(out, tuple):
        out = tuple(None if v is passed else v for v in out)
    else:
        out.logits = None
    return out


def unfuse_linear_cross_entropy(model: nn.Module) -> nn.Module:
    """Undo fuse_linear_cross_entropy (in place; returns the model)."""
    _checks.module(model)
    base = _peft_base(model)
    if base is not None:
        unfuse_linear_cross_entropy(base)
        return model
    if "_effmem_fused_forward" not in model.__dict__:   # not getattr: a wrapper may pass attributes through
        return model
    fused = model.__dict__.pop("_effmem_fused_forward")
    model.__dict__.pop("_replicate_for_data_parallel", None)
    _unpatch_head(fused.head)
    ours = {"forward": lambda f: f is fused, "_loss_function": lambda f: isinstance(f, _FusedLoss)}
    for module, attr, before in ((model, "forward", "_effmem_forward_before"),
                                 (model, "_loss_function", "_effmem_loss_before")):
        kept = module.__dict__.pop(before, None)
        if not ours[attr](module.__dict__.get(attr)):
            # Wrapped since fusing (accelerate's autocast around model.forward, say): the wrapper calls
            # ours, so ours stays, doing nothing of its own now, and so does the wrapper.
            continue
        if kept is None:
            module.__dict__.pop(attr, None)
        else:
            module.__dict__[attr] = kept
    fused.inert = True
    return model
