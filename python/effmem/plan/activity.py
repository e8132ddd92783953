"""What effmem.plan() knows of a model's activations and FLOPs at any micro-batch: from its traces (Activity), or
from the closed form where the trace cannot run (FormulaActivity)."""
from typing import Optional

import torch

from effmem.plan import costs, loss_buffers
from effmem.plan.extrapolate import trace_spec
from effmem.plan.model import ModelSpec
from effmem.plan.trace import InputsFn


def hf_config(spec: ModelSpec) -> dict:
    """The model's config as transformers resolved it (ModelSpec.resolved_config; a llama dict without
    intermediate_size raised KeyError in the cross-check when the dict as given was read)."""
    if spec.config is not None:
        return spec.resolved_config if spec.resolved_config is not None else spec.config
    cfg = getattr(spec.module, "config", None)
    return cfg.to_dict() if hasattr(cfg, "to_dict") else {}


def vocab_hidden(spec: ModelSpec):
    cfg = hf_config(spec)
    return cfg.get("vocab_size", 1), cfg.get("hidden_size", cfg.get("n_embd", 1))


class Activity:
    """A model's activations and FLOPs at any micro-batch, from traces at micro-batch 1 and 2 (affine in it; and 3,
    where batch 1 saves other tensors than 2)."""

    def __init__(self, spec: ModelSpec, seq: int, dtype: torch.dtype, target: str, inputs: Optional[InputsFn],
                 loss: str = "standard", layers_from: Optional["Activity"] = None,
                 fast_from: Optional["Activity"] = None):
        """loss: a costs.Config.loss. layers_from: the same model's activity with another loss, whose decoder
        layers this one shares (trace_spec's layers_from). fast_from: the same model's activity with another
        fused loss, traced under the "fast" policy: this one is not (two traces fewer: a 70B plan stays
        under 2 s), and its "fast" counts are that one's with the loss's own saves put in (model())."""
        amp = costs.under_autocast("bf16" if dtype == torch.bfloat16 else "fp32", target)

        def traced(micro: int, attr: str):
            return trace_spec(spec, micro, seq, dtype, target, inputs=inputs, fused_loss=loss != "standard",
                              grad_in_forward=True if loss == "fused_gif" else None, autocast=amp,
                              layers_from=getattr(layers_from, attr, None), fast=fast_from is None)
        self.one, self.two = traced(1, "one"), traced(2, "two")
        # A batch of one can save other tensors than larger batches do (the CPU's SDPA at batch 1 saves more):
        # a slope from micro-batches 1 and 2 then carries that difference into every larger one (GPT-2 on the
        # CPU: 0.965x of what it saved at 16). Where their records differ, micro-batch 1 is its own trace and
        # the slope comes from 2 and 3; the models whose records agree (Llama's; GPT-2's on a CUDA target, flash
        # attention's saves) are not traced again. With the layers of another loss's activity, as that one does.
        differ = self.one.structure() != self.two.structure()
        self.three = traced(3, "three") if differ or getattr(layers_from, "three", None) is not None else None
        self.loss, self.target, self.fast_from = loss, target, fast_from
        self.fused_loss = loss != "standard"
        self.method, self.seq = self.one.method, seq
        # traced under the "fast" policy too
        self.has_fast = fast_from.has_fast if fast_from is not None else self.one.has_fast and self.two.has_fast
        # a layer writing into a product's output in place: the "selective" policy refuses the model
        self.selective_refused = self.one.selective_refused or self.two.selective_refused
        self.strategies = tuple(a for a in costs.ACTIVATIONS if (not a.startswith("fast") or self.has_fast)
                                and (a != "selective" or not self.selective_refused))

    def model(self, spec: ModelSpec, micro: int, trainable_share: float) -> costs.Model:
        first, second, at = ((self.two, self.three, 2) if self.three is not None and micro > 1 else
                             (self.one, self.two, 1))

        def lin(f):
            a, b = f(first), f(second)
            if isinstance(a, dict):
                return {k: a[k] + (micro - at) * (b[k] - a[k]) for k in a}
            return a + (micro - at) * (b - a)
        acts = {s: lin(lambda t, s=s: t.activations(s)) for s in self.strategies
                if s in costs.TRACED and not (s == "fast" and self.fast_from is not None)}
        fast_compressed, fast_codes = lin(lambda t: t.fast_compressed()), lin(lambda t: t.fast_codes())
        if self.fast_from is not None and self.has_fast:
            # The policy acts on the decoder layers only: what the other loss's forward kept under it, with
            # that loss's own saves (logits, gradients made in forward) replaced by this one's.
            other = self.fast_from.model(spec, micro, trainable_share)
            acts["fast"] = dict(other.activations["fast"], **{k: acts["none"][k] for k in ("logits", "grads")})
            fast_compressed, fast_codes = other.fast_compressed, other.fast_codes
        return costs.Model(
            params=spec.num_params, trainable=spec.num_trainable, state_blocks=spec.state_blocks,
            activations=acts,
            offloaded=lin(lambda t: t.offloaded_bytes()), block_bytes=lin(lambda t: t.block_bytes()),
            largest_logits=lin(lambda t: t.largest("logits")), largest_block=lin(lambda t: max(
                t.largest(k) for k in ("attention", "mlp", "norm", "block"))),
            matmul_flops=lin(lambda t: t.matmul_flops), attention_flops=lin(lambda t: t.attention_flops),
            block_matmul_flops=lin(lambda t: t.block_matmul_flops),
            trainable_matmul_share=trainable_share, layers=max(1, spec.num_layers),
            fast_compressed=fast_compressed, fast_codes=fast_codes,
            selective_recompute_bytes=lin(lambda t: t.selective_recompute_bytes),
            elementwise_bytes=lin(lambda t: t.elementwise_bytes),
            head_recompute_flops=lin(lambda t: t.head_recompute_flops), tokens=micro * self.seq,
            backward_flops=lin(lambda t: t.backward_flops),
            attention_backward_flops=lin(lambda t: t.attention_backward_flops),
            forward_ops=lin(lambda t: t.forward_ops), block_ops=lin(lambda t: t.block_ops),
            fused_ce_transient=self._fused_ce_transient(spec, micro * self.seq))

    def _fused_ce_transient(self, spec: ModelSpec, tokens: int) -> int:
        if self.loss == "fused_gif":
            return loss_buffers.fused_ce_gif_buffers(tokens, *vocab_hidden(spec), self.target)
        return loss_buffers.fused_ce_buffers(tokens, *vocab_hidden(spec)) if self.fused_loss else 0


class FormulaActivity:
    """A model the trace could not run, counted by the closed form (plan/formula.py) instead: bf16 with the
    standard loss, and only what it describes: activations kept, checkpointed (plain or with 8-bit layer
    inputs) or saved on the CPU. FLOPs: 2 per matmul weight per token, attention at a flash kernel's
    causal count."""
    has_fast = False
    fused_loss = False
    strategies = ("none", "checkpoint", "checkpoint8", "save_on_cpu")

    def __init__(self, counts, spec: ModelSpec, seq: int, why: str):
        self.c, self.seq = counts, seq
        cfg = hf_config(spec)
        self.vocab, self.hidden = vocab_hidden(spec)
        tied = cfg.get("tie_word_embeddings", cfg.get("model_type") == "gpt2")
        self.matmul_params = spec.num_params - (0 if tied else self.vocab * self.hidden)
        self.method = f"closed form (plan/formula.py; the trace failed: {why})"

    def model(self, spec: ModelSpec, micro: int, trainable_share: float) -> costs.Model:
        from effmem.compress._codec import packed_bytes
        from effmem.plan.trace import KINDS
        c, tokens, h = self.c, micro * self.seq, self.hidden
        none = dict.fromkeys(KINDS, 0)
        none.update(block=tokens * c.layers * c.layer, other=tokens * c.outside + self.seq * c.per_position,
                    logits=tokens * c.logits + 8)
        kept = tokens * c.layers * c.layer + tokens * c.outside + tokens * c.logits
        returned = tokens * 2 * self.vocab + 8  # forward's bf16 logits and the loss stay on the device
        acts = {"none": none, "checkpoint": dict(none, block=tokens * c.layers * c.boundary),
                "checkpoint8": dict(none, block=c.layers * packed_bytes(tokens, h, 8, 128)),
                "save_on_cpu": dict(dict.fromkeys(KINDS, 0), logits=returned)}
        return costs.Model(
            params=spec.num_params, trainable=spec.num_trainable, state_blocks=spec.state_blocks, activations=acts,
            offloaded=kept - returned,
            block_bytes=tokens * c.layer, largest_logits=tokens * 4 * self.vocab,
            largest_block=tokens * max(4 * h, 2 * c.intermediate),
            matmul_flops=2.0 * tokens * self.matmul_params, attention_flops=2.0 * micro * self.seq ** 2 * h * c.layers,
            block_matmul_flops=2.0 * tokens * (self.matmul_params - self.vocab * h),  # all but the output layer
            trainable_matmul_share=trainable_share, layers=max(1, c.layers), tokens=tokens)
