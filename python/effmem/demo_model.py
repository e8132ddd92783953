"""A small byte-level GPT and a corpus that every machine already has.

Used by ``effmem demo``: nothing is downloaded. The corpus is Python's own
standard-library source, so any machine that can run effmem can build it,
and the same Python version gives the same bytes.
"""
import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB_SIZE = 256  # one token per byte: no tokenizer to download or train


@dataclass
class GPTConfig:
    seq_len: int = 64
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    mlp_ratio: int = 4
    tie_weights: bool = True

    def __post_init__(self):
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by the number of heads ({self.n_head})")


class _Fp32MatmulLinear(torch.autograd.Function):
    """F.linear for bf16/fp16 CPU tensors, with the products computed in float32.

    torch's CPU GEMM for bf16/fp16 is about ten times slower than for float32
    on CPUs without AVX512-BF16 or AMX (measured on a 2-core AVX2 machine),
    which would make the demo's bf16 runs take minutes. The rounding points
    are those of a bf16 GEMM (bf16 inputs, float accumulation, one rounding of
    each result to bf16), and autograd saves the same tensors as for
    F.linear: the low-precision input and the weight.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.float().reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.float()).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ x.float().reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b


class Linear(nn.Linear):
    """nn.Linear whose bf16/fp16 matmuls on the CPU run in float32 (see _Fp32MatmulLinear)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            return _Fp32MatmulLinear.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        # (b, t, 3c) -> three (b, heads, t, head_dim) tensors, the layout SDPA expects.
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        # SDPA picks a flash / memory-efficient kernel where one exists, so the
        # (t x t) attention matrix is never stored for backward on GPU.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = Linear(cfg.d_model, VOCAB_SIZE, bias=False)
        if cfg.tie_weights:
            # One tensor serves as both embedding and output projection; it is
            # listed once by parameters(), so optimizers hold one state for it.
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2's trick: shrink the residual projections by depth so the
        # residual stream's variance does not grow with the number of blocks.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor, targets: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of length {t} is longer than the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        # The loss is taken in fp32 even for a bf16 model: log-softmax over 256
        # classes loses visible precision in bf16.
        loss = F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), targets.reshape(-1))
        return logits, loss


def decay_groups(model: nn.Module, weight_decay: float):
    """Param groups: weight decay on matrices and embeddings only (not biases or LayerNorm gains)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def stdlib_corpus(max_bytes: int = 4 << 20) -> bytes:
    """Python standard-library source files, concatenated in a fixed order, up to max_bytes.

    Installed packages (site-packages / dist-packages) differ between
    machines, so they are skipped; what remains depends only on the Python
    version.
    """
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes os.walk's visiting order, which is otherwise
        # the file system's (and so differs between machines).
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    if total == 0:
        raise RuntimeError(f"no Python source files found under {root} to build the demo corpus from")
    return b"".join(chunks)


def split_corpus(data: bytes, val_fraction: float = 0.1) -> Tuple[Tensor, Tensor]:
    """Bytes -> (train, validation) uint8 token tensors; validation is the tail.

    Kept as uint8 (widened per batch) so the corpus adds 4 MB, not 32 MB, to
    the resident memory the demo reports.
    """
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_val = max(int(len(tokens) * val_fraction), 1)
    return tokens[:-n_val], tokens[-n_val:]


def sample_batch(tokens: Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> Tuple[Tensor, Tensor]:
    """Random windows of seq_len + 1 bytes; inputs and next-byte targets.

    The offsets come from ``gen`` (a CPU generator), so every run seeded the
    same sees the same batches whatever the device or model dtype.
    """
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"corpus of {len(tokens)} tokens is too short for seq_len {seq_len}")
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=gen)
    windows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
