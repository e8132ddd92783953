"""A Llama-shaped decoder for the benchmarks: the sizes and layer kinds of Llama, nothing else.

Pre-RMSNorm blocks of causal attention (q, k, v, o projections without bias,
scaled_dot_product_attention) and a SwiGLU MLP, untied embedding and output
matrices. Rotary embeddings are left out: they cost a few elementwise
kernels, no parameters and no memory that matters here.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    vocab: int = 32000

    def num_params(self) -> int:
        h, i = self.hidden, self.intermediate
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return self.layers * per_layer + 2 * self.vocab * h + h

    def hf_config(self) -> dict:
        """The same shape as a transformers LlamaConfig's arguments (full multi-head attention)."""
        return dict(model_type="llama", hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.heads, vocab_size=self.vocab)


SIZES = {
    "tiny": LlamaShape(hidden=256, layers=2, intermediate=688, heads=4, vocab=1024),
    "125m": LlamaShape(hidden=768, layers=12, intermediate=2048, heads=12),
    "1.3b": LlamaShape(hidden=2048, layers=24, intermediate=5504, heads=16),
    "3b": LlamaShape(hidden=3200, layers=26, intermediate=8640, heads=32),
    "7b": LlamaShape(hidden=4096, layers=32, intermediate=11008, heads=32),
    "13b": LlamaShape(hidden=5120, layers=40, intermediate=13824, heads=40),
}


class Block(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.heads = s.heads
        self.norm1 = nn.RMSNorm(s.hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(s.hidden, s.hidden, bias=False) for _ in range(4))
        self.norm2 = nn.RMSNorm(s.hidden)
        self.gate = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.shape = s
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)
        std = 0.02
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
        for b in self.blocks:
            nn.init.normal_(b.o.weight, std=std / math.sqrt(2 * s.layers))
            nn.init.normal_(b.down.weight, std=std / math.sqrt(2 * s.layers))

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def build(size: str, device, dtype=torch.bfloat16) -> Llama:
    """The model of that size, built on the device in its dtype directly (no host copy, no fp32 detour)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Llama(SIZES[size])
    finally:
        torch.set_default_dtype(previous)
