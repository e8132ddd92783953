"""Closed-form saved-activation bytes for the common decoder families: the trace's cross-check.

Counts per token, bf16 training, flash attention, Hugging Face's modules as
they are in transformers 5 (derived by reading what each module saves):

Llama / Mistral / Qwen2 layer (RMSNorm upcasts to float32 and keeps that
copy and the rstd; SwiGLU keeps gate, silu(gate), up and their product):
    2 norms x (4h + 4 + 2h)  +  attention: 2h input + 2h q + 2 kv_dim k + 2 kv_dim v + 2h output + 4 heads lse
    +  mlp: 2h input + 4 x 2i
GPT-2 layer (LayerNorm keeps input, mean, rstd; gelu_new's tanh form keeps
five [4h] tensors; c_attn's output holds q, k, v):
    2 x (2h + 8)  +  attention: 2h + 6h + 2h + 2h + 4 heads  +  mlp: 2h + 5 x 8h + 2h
Outside the layers: the ids, the final norm, the head's input, the float32
logits the loss keeps (4V) and the bf16 logits forward returns (2V); for
rotary models also the cos and sin tables, per position not per token.

A model this does not describe returns None; a difference from the trace
means one of the two is wrong about the model (the trace is what plan uses).
"""
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Counts:
    """Bytes per token (or per position) of a bf16 training forward, by where they are kept."""
    layers: int
    layer: int          # saved inside one decoder layer, per token
    boundary: int       # one decoder layer's hidden-state input, per token (what checkpointing keeps)
    logits: int         # the loss's float32 logits and the returned bf16 ones, per token
    outside: int        # the rest outside the layers, per token
    per_position: int   # rotary tables or position ids, per position of the sequence
    intermediate: int   # the MLP's width (its largest transient per token is 2 bytes of it)


def counts(cfg: dict) -> Optional[Counts]:
    """The closed-form counts for a config this module describes, else None."""
    kind = cfg.get("model_type")
    v = cfg.get("vocab_size")
    if kind in ("llama", "mistral", "qwen2"):
        h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads") or heads
        kv_dim = kv * cfg.get("head_dim", h // heads)
        norm = 4 * h + 4 + 2 * h
        layer = 2 * norm + (2 * h + 2 * h + 4 * kv_dim + 2 * h + 4 * heads) + (2 * h + 8 * i)
        outside = 8 + norm + 2 * h + 8
        per_position = 2 * 2 * cfg.get("head_dim", h // heads)  # bf16 cos and sin
    elif kind == "gpt2":
        h, layers, heads = cfg["n_embd"], cfg["n_layer"], cfg["n_head"]
        if cfg.get("n_inner") not in (None, 4 * h) or cfg.get("activation_function", "gelu_new") != "gelu_new":
            return None
        i = 4 * h
        layer = 2 * (2 * h + 8) + (2 * h + 6 * h + 2 * h + 2 * h + 4 * heads) + (2 * h + 5 * 8 * h + 2 * h)
        outside = 8 + 2 * h + (2 * h + 8) + 2 * h + 8
        per_position = 8  # the position ids, [1, seq]
    else:
        return None
    return Counts(layers, layer, 2 * h, 4 * v + 2 * v, outside, per_position, i)


def saved_bytes(cfg: dict, batch: int, seq: int) -> Optional[int]:
    """Bytes a bf16 training forward leaves alive (saved for backward plus the returned logits), or None."""
    c = counts(cfg)
    if c is None:
        return None
    # The loss (a float32 scalar, saved and returned) is the only per-batch constant.
    return batch * seq * (c.layers * c.layer + c.outside + c.logits) + seq * c.per_position + 8
