"""A whole model's trace from traces of its first decoder layers (plan/trace.py records one trace).

A config's model is traced with 1 and 2 decoder layers on the meta device,
and every count is extrapolated linearly to all of them: quick for a 70B
preset, and exact where every layer saves the same tensors.
"""
import dataclasses
from typing import Dict, List, Optional

import torch
from torch import nn

from effmem.plan.model import ModelSpec
from effmem.plan.trace import _LAYER_KINDS, InputsFn, Trace, trace_module


def trace_spec(spec: ModelSpec, batch: int, seq: int, dtype: torch.dtype, target: str,
               inputs: Optional[InputsFn] = None, fused_loss: bool = False, autocast: bool = False,
               layers_from: Optional["Extrapolated"] = None,
               grad_in_forward: Optional[bool] = None, fast: bool = True) -> "Extrapolated":
    """Trace a model; for a config, trace 1 and 2 decoder layers and extrapolate to all of them.

    fused_loss: with the training loss computed by effmem.linear_cross_entropy
    (effmem.fuse_linear_cross_entropy with grad_in_forward; a user's module is unfused again afterwards).
    autocast: see trace_module. layers_from: a trace of the same model, batch, dtype and autocast with
    another loss; then only 1 layer is traced and each further layer adds what it adds there (the loss runs
    after the last layer and changes nothing in them), a quarter fewer traces for effmem plan. fast=False:
    without the trace under the "fast" policy (effmem plan derives it from another loss's, see
    plan.activity.Activity)."""
    from effmem.linear_ce_hf import fuse_linear_cross_entropy, unfuse_linear_cross_entropy

    def run(model: nn.Module, fresh: bool) -> Trace:
        if fused_loss:
            fuse_linear_cross_entropy(model, grad_in_forward=grad_in_forward)
        try:
            t = trace_module(model, batch, seq, dtype, target, inputs, autocast=autocast)
            if fast:   # the same forward under the "fast" activation policy (plan() refuses a model under one)
                t.fast = trace_module(model, batch, seq, dtype, target, inputs, fast=True, autocast=autocast)
            return t
        finally:
            if fused_loss and not fresh:
                unfuse_linear_cross_entropy(model)

    if spec.module is not None:
        flags = [(p, p.requires_grad) for p in spec.module.parameters()]
        spec.set_trained(spec.module)   # the user's module: trainable= for the trace, its own flags after
        try:
            t = run(spec.module, fresh=False)
        finally:
            for p, flag in flags:
                p.requires_grad_(flag)
        return Extrapolated(t, [], t.num_blocks)
    first = spec.build_kept([0])
    # Another loss's increments hold only where the one-layer copy trains something: frozen whole (--trainable
    # naming later layers only), its loss saves nothing, and the increments of that other loss then held the
    # switch to its saves (the unfused logits, 13x the fused loss's, counted for it)
    if layers_from is not None and layers_from.pairs and first is not None and any(
            q.requires_grad for q in first.parameters()):
        return Extrapolated(run(first, True), [], spec.num_layers, step=layers_from)
    pairs = []
    for count, keep in spec.layer_groups():
        model = spec.build_kept(keep)
        if model is None:
            break
        pairs.append((count, run(model, True)))
    else:
        if first is not None:
            return Extrapolated(run(first, True), pairs, spec.num_layers)
    # layers that shorter copies do not reproduce: the whole model, traced
    whole = spec.build_layers(spec.num_layers)
    spec.set_trained(whole)
    t = run(whole, True)
    return Extrapolated(t, [], t.num_blocks)


class Extrapolated:
    """Per-strategy bytes of an L-layer model from a trace of its first layer and, per kind of the layers after
    it (plan/layer_kinds.py), a trace of the first layer and one of that kind: T(L) = T(1) + sum over kinds of
    n_k (T(1 + k) - T(1)); one kind (most models) is T(1) + (L-1)(T(2)-T(1)).

    Exact when every layer of a kind saves the same tensors. Tensors the model makes once and hands to its
    layers (masks, rotary tables: Record.shared) are counted once per kind of layer that brings them: a later
    kind may be the first to use one (Gemma2's full-attention mask, only in its odd layers) or to save one
    (the rotary tables, where the first layer is frozen; Gemma3's local and global ones, one per kind), and
    extrapolating them counted them per layer. (Two kinds that both bring one tensor first count it twice: a
    rotary table's bytes too many at most.) With `step` (another Extrapolated of the same layers), the
    increments are taken from it."""

    def __init__(self, one: Trace, pairs, layers: int, step: Optional["Extrapolated"] = None):
        self.one, self.pairs, self.layers, self.step = one, list(pairs), layers, step
        self.two = self.pairs[0][1] if self.pairs else None   # the 2-layer trace, if any (what tests count)
        self.method = ("traced" if not self.pairs and step is None else
                       "traced (1 and 2 layers, extrapolated)" if len(self.pairs) <= 1 else
                       f"traced ({len(self.pairs)} kinds of layer, extrapolated)")

    def _traces(self) -> List[Trace]:
        return [self.one] + [t for _, t in self.pairs]

    def _lin(self, f):
        a = f(self.one)
        for count, d in self._increments(f):
            a = _add(a, d, count)
        return a

    def _increments(self, f):
        """Per kind of layer: how many there are after the first, and what one more of them adds to f."""
        if self.step is not None:
            return self.step._increments(f)
        first = f(self.one)
        return [(count, _diff(f(t), first)) for count, t in self.pairs]

    # The traces' scalar counts, each extrapolated over the layers as _lin does: FLOPs, traffic, op counts.
    _LINEAR = ("selective_recompute_bytes", "elementwise_bytes", "matmul_flops", "block_matmul_flops",
               "attention_flops", "head_recompute_flops", "forward_ops", "block_ops", "backward_flops",
               "attention_backward_flops")

    def __getattr__(self, name: str):
        if name in Extrapolated._LINEAR:
            return self._lin(lambda t: getattr(t, name))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _records(self, f):
        """f (a sum over a trace's records) of the whole model: the shared records once per kind of layer that
        brings them, the others per layer."""
        shared = f(self.one.part(True))
        for _, d in self._increments(lambda t: f(t.part(True))):
            shared = _add(shared, d, 1)
        return _add(self._lin(lambda t: f(t.part(False))), shared, 1)

    def _by_strategy(self, strategy: str, f):
        # Under "fast" the policy's compressor counted the layers' saves, shared or not: per layer, no records.
        return (self._lin if strategy == "fast" else self._records)(f)

    def activations(self, strategy: str) -> Dict[str, int]:
        return self._by_strategy(strategy, lambda t: t.activations(strategy))

    def saved_bytes(self, strategy: str) -> int:
        return self._by_strategy(strategy, lambda t: t.saved_bytes(strategy))

    def offloaded_bytes(self) -> int:
        return self._records(lambda t: t.offloaded_bytes())

    def fast_compressed(self) -> int:
        return self._lin(lambda t: t.fast_compressed())

    def fast_codes(self) -> int:
        return self._lin(lambda t: t.fast_codes())

    def structure(self) -> List[list]:
        """Its traces' records (and those under "fast") without their sizes, in order: two batch sizes' agree
        where each storage of one is a storage of the other scaled (plan/activity.py). last_dim is a size too
        (the flattened labels' is the batch's tokens)."""
        def records(t: Optional[Trace]) -> Optional[list]:
            return None if t is None else [sorted(str(dataclasses.replace(r, nbytes=0, last_dim=0))
                                                  for r in t.records.values()), records(t.fast)]
        return [records(t) for t in self._traces()]

    @property
    def routed(self) -> bool:
        return self.one.routed

    @property
    def has_fast(self) -> bool:
        return all(t.fast is not None for t in self._traces()) and (self.step is None or self.step.has_fast)

    @property
    def selective_refused(self) -> bool:
        return any(t.selective_refused for t in self._traces()) or bool(self.step and self.step.selective_refused)

    def block_bytes(self) -> int:
        """The largest decoder layer's internally saved bytes."""
        if self.step is not None:
            return self.step.block_bytes()
        return max((b for t in (self._traces()[1:] or [self.one]) for b in t.block_bytes()), default=0)

    def largest(self, kind: Optional[str] = None) -> int:
        if self.step is not None:
            # the decoder layers' kinds as the other loss's traces of them saw them; the rest as here
            inside = max((self.step.largest(k) for k in _LAYER_KINDS if kind in (None, k)), default=0)
            return max(self.one.largest(kind), inside)
        return max(t.largest(kind) for t in (self._traces()[1:] or [self.one]))


def _diff(b, a):
    return {k: b[k] - a[k] for k in a} if isinstance(a, dict) else b - a


def _add(a, d, times: int):
    return {k: a[k] + times * d[k] for k in a} if isinstance(a, dict) else a + times * d
