"""The "fast" policy's fast paths: the modules inside a decoder layer that get a fused function.

Recognised by what they are, in the model families effmem knows (Llama,
Mistral, Mixtral, Qwen2/Qwen3 and GPT-2 in transformers, and the demo GPT):

* RMSNorm of the Llama family (x * rsqrt(mean(x^2) + eps) in float32, times
  weight): fused.rms_norm.
* nn.LayerNorm (GPT-2, the demo GPT): fused.layer_norm.
* a gated MLP, down(act(gate(x)) * up(x)) with SiLU (Llama, Mistral, Qwen2,
  Qwen3): fused.swiglu for the product (its projections nn.Linear, or PEFT's
  LoRA wrappers of them).
* GELU modules (torch's nn.GELU, transformers' GELU activations): fused.gelu.
* nn.ReLU (OPT, T5): activations.relu, its on/off mask kept exactly in 1 bit (by giving the module the
  class relu.MaskedReLU, which a compiled layer keeps: activations.compiled).

Each is patched by giving the module instance its own forward (a ReLU: its
class; removed by unpatch), so parameters, state_dict keys and hooks are untouched. Anything
else in the layer (attention, mixture-of-experts routing) runs as it is; the
policy's hooks still store what it saves in 8 bits.
"""
import functools
from typing import Callable, List, Optional

from torch import nn

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

def _rms_norm_forward(m: nn.Module, eps: float, x):
    return fused.rms_norm(x, m.weight, eps)


def _layer_norm_forward(m: nn.LayerNorm, x):
    return fused.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


def _gated_mlp_forward(m: nn.Module, x):
    return m.down_proj(fused.swiglu(m.gate_proj(x), m.up_proj(x)))


def _gelu_forward(m: nn.Module, form: str, x):
    # the module's own GELU computes the forward, so its bits stay
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
    if not all(_linear_like(p) for p in parts) or type(getattr(m, "act_fn", None)).__name__ not in SILU:
        return None
    return functools.partial(_gated_mlp_forward, m)


def _gelu(m: nn.Module) -> Optional[Callable]:
    form = m.approximate if type(m) is nn.GELU else GELU_FORMS.get(type(m).__name__)
    return None if form is None else functools.partial(_gelu_forward, m, form)


FINDERS = (_rms_norm, _layer_norm, _gated_mlp, _gelu)


def patch(layer: nn.Module) -> List[nn.Module]:
    """Give the recognised modules inside `layer` their fused forward; returns the patched modules."""
    patched = []
    for m in layer.modules():
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


def unpatch(modules: List[nn.Module]) -> None:
    for m in modules:
        m.__dict__.pop("forward", None)
        relu.unpatch(m)


def for_compiler(modules: List[nn.Module]) -> List[nn.Module]:
    """Unpatch the modules whose work a compiled layer's graph does itself (activations.compiled); returns
    those that stay patched: the ReLUs, whose exact mask no compiled rule keeps otherwise."""
    unpatch([m for m in modules if type(m) is not relu.MaskedReLU])
    return [m for m in modules if type(m) is relu.MaskedReLU]
