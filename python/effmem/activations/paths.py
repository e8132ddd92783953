"""The "fast" policy's fast paths: the modules inside a decoder layer that get a fused function.

Recognised by what they are, in the model families effmem knows (Llama,
Mistral, Mixtral, Qwen2/Qwen3 and GPT-2 in transformers, and the demo GPT):

* RMSNorm of the Llama family (x * rsqrt(mean(x^2) + eps) in float32, times
  weight): fused.rms_norm.
* nn.LayerNorm (GPT-2, the demo GPT): fused.layer_norm.
* a gated MLP, down(act(gate(x)) * up(x)) with SiLU (Llama, Mistral, Qwen2,
  Qwen3): fused.swiglu for the product (its projections nn.Linear, or PEFT's
  LoRA wrappers of them). Only where its class's forward is that and nothing
  else (read from its source: FalconH1's multipliers or a clamp would be
  dropped). Its own forward runs instead while its act_fn is not a SiLU or has
  hooks, or any global module hook is set (the fused product does not call act_fn).
* GELU modules (torch's nn.GELU, transformers' GELU activations): fused.gelu.
* nn.ReLU (OPT, T5): activations.relu, its on/off mask kept exactly in 1 bit (by giving the module the
  class relu.MaskedReLU, which a compiled layer keeps: activations.compiled).

Each is patched by giving the module instance its own forward (a ReLU: its
class; removed by unpatch), so parameters, state_dict keys and hooks are untouched. Anything
else in the layer (attention, mixture-of-experts routing) runs as it is; the
policy's hooks still store what it saves in 8 bits.
"""
import ast
import functools
import inspect
import textwrap
from typing import Callable, List, Optional

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks

from effmem.activations import fused, relu

# Llama-family RMSNorms, all "Copied from LlamaRMSNorm" in transformers (Gemma's, with 1 + weight, is not).
RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
             "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm"}
# SiLU modules: torch's and transformers' (whose forward is F.silu)
SILU = {"SiLU", "SiLUActivation"}
# transformers' GELU activation classes, by the form of GELU they compute
GELU_FORMS = {"GELUActivation": "none", "NewGELUActivation": "tanh", "GELUTanh": "tanh",
              "PytorchGELUTanh": "tanh", "GELUPytorchTanh": "tanh", "FastGELUActivation": "tanh"}


# Patched forwards are partials of these functions, not closures: a deep copy of the model (copy.deepcopy
# copies a partial's arguments) then calls its own modules.

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:   # a torch built without distributed
    FSDPModule = ()

# A norm that is an FSDP2 unit of its own (fully_shard(layer.input_layernorm)) frees its gathered weight after
# its forward and gathers it again at its own backward, after the projections that read its output have asked
# for it: rebuilt from its weight there, the output read freed memory (SIGSEGV, a reviewer's 2-rank run). Such
# a norm runs its own forward, its output stored in 8 bits, as where fully_shard came first (FSDP's class).


def _own_forward(m: nn.Module) -> bool:
    """Whether the module runs its own forward: an FSDP2 unit (above), or inside a torch.func transform (vmap,
    under which the layers run as plain ones; one that differentiates the policy refuses at the layer), where
    the fused autograd functions, which have no vmap rule, raised."""
    return isinstance(m, FSDPModule) or (not torch.compiler.is_compiling()
                                         and torch._C._functorch.peek_interpreter_stack() is not None)


def _rms_norm_forward(m: nn.Module, eps: float, x):
    if _own_forward(m):
        return type(m).forward(m, x)
    return fused.rms_norm(x, m.weight, eps)


def _layer_norm_forward(m: nn.LayerNorm, x):
    if _own_forward(m):
        return type(m).forward(m, x)
    return fused.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


# Set on a hook function that only watches modules run (effmem plan's trace): a module the fused product does
# not call is not run in training either, so such a hook does not keep the fused product from running.
OBSERVER = "_effmem_observer"


def _user_hooks(*dicts) -> bool:
    return any(not getattr(h, OBSERVER, False) for d in dicts for h in d.values())


def _plain_silu(act) -> bool:
    """Whether calling `act` is SiLU and nothing else: no hooks on it, none on every module (a global hook
    would see it called), which the fused product (that never calls it) would skip."""
    return type(act).__name__ in SILU and not _user_hooks(
        act._forward_hooks, act._forward_pre_hooks, _module_hooks._global_forward_hooks,
        _module_hooks._global_forward_pre_hooks)


def _gated_mlp_forward(m: nn.Module, x):
    # read at each call: a hook put on act_fn, or another act_fn set, after the policy runs as it would
    if not _plain_silu(m.act_fn) or _own_forward(m):
        return type(m).forward(m, x)
    return m.down_proj(fused.swiglu(m.gate_proj(x), m.up_proj(x)))


def _gelu_forward(m: nn.Module, form: str, x):
    # the module's own GELU computes the forward, so its bits stay
    if _own_forward(m):
        return type(m).forward(m, x)
    return fused.gelu(x, functools.partial(type(m).forward, m), form)


def _rms_norm(m: nn.Module) -> Optional[Callable]:
    if type(m).__name__ not in RMS_NORMS or not isinstance(getattr(m, "weight", None), nn.Parameter):
        return None
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return None if eps is None else functools.partial(_rms_norm_forward, m, eps)


def _layer_norm(m: nn.Module) -> Optional[Callable]:
    return functools.partial(_layer_norm_forward, m) if type(m) is nn.LayerNorm else None


def _linear_like(p) -> bool:
    """An nn.Linear, or a wrapper of one that PEFT makes (a LoRA's lora.Linear keeps it as base_layer): the
    fused MLP only calls the three projections, so a LoRA on them trains through it as through the module."""
    return isinstance(p, nn.Linear) or isinstance(getattr(p, "base_layer", None), nn.Linear)


def _gated_mlp(m: nn.Module) -> Optional[Callable]:
    parts = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(m, "act_fn", None)
    if not all(_linear_like(p) for p in parts) or type(act).__name__ not in SILU:
        return None
    if not _plain_swiglu(type(m).forward):
        return None
    return functools.partial(_gated_mlp_forward, m)


@functools.lru_cache(maxsize=None)
def _plain_swiglu(forward) -> bool:
    """Whether forward(self, x) is down_proj(act_fn(gate_proj(x)) * up_proj(x)) and nothing else (returned at
    once, or through one name; no decorator, no other argument), as in Llama, Mistral, Qwen2/3, OLMo: what the
    fused forward computes. Cached by the function: a class's forward replaced since is read again."""
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):   # no source to read: not patched
        return False
    if (not isinstance(fn, ast.FunctionDef) or fn.decorator_list or len(fn.args.args) != 2 or fn.args.vararg
            or fn.args.kwarg or fn.args.kwonlyargs or fn.args.posonlyargs):
        return False
    x = fn.args.args[1].arg
    forms = {ast.dump(ast.parse(f"self.down_proj({a} * {b})", mode="eval").body)
             for a, b in ((f"self.act_fn(self.gate_proj({x}))", f"self.up_proj({x})"),
                          (f"self.up_proj({x})", f"self.act_fn(self.gate_proj({x}))"))}
    body = [n for n in fn.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
        return ast.dump(body[0].value) in forms
    if (len(body) == 2 and isinstance(body[0], ast.Assign) and len(body[0].targets) == 1
            and isinstance(body[0].targets[0], ast.Name) and isinstance(body[1], ast.Return)
            and isinstance(body[1].value, ast.Name) and body[1].value.id == body[0].targets[0].id):
        return ast.dump(body[0].value) in forms
    return False


def _gelu(m: nn.Module) -> Optional[Callable]:
    form = m.approximate if type(m) is nn.GELU else GELU_FORMS.get(type(m).__name__)
    return None if form is None else functools.partial(_gelu_forward, m, form)


FINDERS = (_rms_norm, _layer_norm, _gated_mlp, _gelu)


def patch(layer: nn.Module) -> List[nn.Module]:
    """Give the recognised modules inside `layer` their fused forward; returns the patched modules."""
    patched = []
    for m in layer.modules():
        # the layer itself too (nn.TransformerEncoderLayer), which remove_activation_policy puts back itself
        if relu.patch_functional(m) and m is not layer:
            patched.append(m)
        if m is layer or "forward" in m.__dict__:
            continue
        if relu.patch(m):   # in place too (a conv net's usual ReLU), as the module does
            patched.append(m)
            continue
        for find in FINDERS:
            fwd = find(m)
            if fwd is not None:
                m.forward = fwd
                patched.append(m)
                break
    return patched


def ours(m: nn.Module) -> bool:
    """Whether m's own forward is one effmem's activation code gave it (not a wrapper put on it since)."""
    f = m.__dict__.get("forward")
    return isinstance(f, functools.partial) and getattr(f.func, "__module__", "").startswith("effmem.activations")


def unpatch(modules: List[nn.Module]) -> None:
    for m in modules:
        if ours(m):
            m.__dict__.pop("forward")
        relu.unpatch(m)


def for_compiler(modules: List[nn.Module]) -> List[nn.Module]:
    """Unpatch the modules whose work a compiled layer's graph does itself (activations.compiled); returns
    those that stay patched: the ReLUs (modules, or a function a module holds), whose exact mask no compiled
    rule keeps otherwise."""
    def relu_kept(m):
        return type(m) is relu.MaskedReLU or "_effmem_relu_attrs" in m.__dict__
    unpatch([m for m in modules if not relu_kept(m)])
    return [m for m in modules if relu_kept(m)]
