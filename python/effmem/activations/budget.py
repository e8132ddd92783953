"""apply_activation_policy(model, memory_budget=...): per decoder layer, plain, "fast", "offload" or
"min", whichever mix holds the decoder layers' saved activations within a budget at the least time.

The bytes of each choice are measured, not modelled: at the first forward with gradients for a given input
shape, the first layer's forward runs twice more on copies of its inputs (random state forked, buffers kept,
outputs dropped; forward hooks inside it run too, and one of the user's is warned of)
with its saves counted, once as it is and once under the "fast" hooks (that one twice on a GPU or under
torch.compile, timed on its second run); "min" keeps the layer input's 8-bit
codes, known exactly; "offload" is "fast" with the 8-bit codes moved to page-locked host memory on a side
stream and brought back (prefetched one layer ahead) in backward (effmem.activations.offload), so the
device keeps only what "fast" keeps uncompressed (statistics, small tensors). The time of each choice is
a fixed fraction of a plain layer's forward + backward (COST below: "fast" quantises and rebuilds
elementwise outputs, "min" recomputes the whole forward, about a third of a layer's work);
bench/bench_activations.py measures the real figures.

Offload is offered only as far as the link hides it, never to buy memory with time: the probe's forward
is timed, and with c = a layer's codes / the host link's bandwidth (effmem.plan's rates for this GPU), t =
one layer's forward, the earliest k layers may be offloaded where k * c <= (layers - 1) * t (their copies
out run behind the later layers' forward; the last layer is never offloaded, backward needs it first) and
c <= 2 t (each copy back runs behind one layer's backward, about two forwards). On a CPU device there is
no link: no layer is offloaded.

Among all counts of "offload", "min", "fast" and plain layers that fit, the cheapest wins (layers are
alike, so counts are all that matter; offloaded layers come first); a budget below every layer in
"min" (and all that may be offloaded) raises, naming the least that fits.

The budget is a fraction of the layers' plain saved bytes (a float in (0, 1], as torch's
activation_memory_budget) or a number of bytes (an int) for the decoder layers at the current shape.
"""
import contextlib
import functools
import numbers
import sys
import time
import warnings
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from effmem.activations import relu
from effmem.activations.checkpoint import _layer_forward as compressed_layer_forward, buffers_kept, routes_tokens
from effmem.activations.compiled import compiled_forward, drops_out
from effmem.activations.fast import FastCompressor, param_shapes
from effmem.activations.offload import Offloader, _parts, aligned_bytes
from effmem.compress import _codec
from effmem.compress.tracker import storage_key

MODES = ("plain", "fast", "offload", "min")
# Extra time per layer, as a fraction of one plain layer's forward + backward. "offload": "fast" and the
# launches and bookkeeping of its copies (a small margin, so that "fast" wins where both fit); the copies
# themselves are hidden, or the layer is not offered offload.
COST = {"plain": 0.0, "fast": 0.05, "offload": 0.06, "min": 0.36}
# Choices kept, one per input shape (and mask, dtype, mode...): lengths that vary freely made one each, for good
MAX_CHOICES = 256


def check_budget(budget) -> Union[float, int]:
    if isinstance(budget, numbers.Integral) and not isinstance(budget, bool):
        budget = int(budget)          # numpy's integers too
    elif isinstance(budget, numbers.Real) and not isinstance(budget, bool):
        budget = float(budget)        # numpy's float32 too
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"memory_budget: expected a fraction in (0, 1] (float) or a number of bytes (int), "
                        f"got {type(budget).__name__}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"memory_budget: a fraction of the plain saved bytes must be in (0, 1], got {budget}"
                         + (f" (bytes go as an int: memory_budget={int(budget)})"
                            if budget > 1.0 and budget.is_integer() else ""))
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"memory_budget: bytes must be >= 0, got {budget}")
    return budget


def choose(layers: int, nbytes: Dict[str, int], budget: int, max_offload: int = 0,
           allow_min: bool = True) -> Optional[List[str]]:
    """The per-layer modes of least COST whose bytes fit `budget` (None if none does): the offloaded layers
    first (at most max_offload), then min (if allowed), then fast."""
    best: Optional[Tuple[float, int, int, int]] = None
    for n_off in range(min(max_offload, layers) + 1):
        for n_min in range(layers - n_off + 1 if allow_min else 1):
            for n_fast in range(layers - n_off - n_min + 1):
                n_plain = layers - n_off - n_min - n_fast
                total = (n_off * nbytes["offload"] + n_min * nbytes["min"] + n_fast * nbytes["fast"]
                         + n_plain * nbytes["plain"])
                if total > budget:
                    continue
                cost = n_off * COST["offload"] + n_min * COST["min"] + n_fast * COST["fast"]
                if best is None or cost < best[0]:
                    best = (cost, n_off, n_min, n_fast)
    if best is None:
        return None
    _, n_off, n_min, n_fast = best
    return (["offload"] * n_off + ["min"] * n_min + ["fast"] * n_fast
            + ["plain"] * (layers - n_off - n_min - n_fast))


def hidden_layers(layers: int, layer_s: float, nbytes: int, link: float) -> int:
    """How many of the earliest layers may offload `nbytes` each over a link of `link` B/s with the
    copies hidden behind compute (one layer's forward: layer_s; see the module's docstring)."""
    if layers < 2 or link <= 0 or nbytes <= 0:
        return 0
    c = nbytes / link
    if c > 2 * layer_s:
        return 0
    return min(layers - 1, int((layers - 1) * layer_s / c))


def _splits_graph(layer: nn.Module) -> bool:
    """Whether a module of the layer has a forward pre-hook that runs between compiled graphs (attach()'s)."""
    return any(getattr(h, "splits_compiled_graph", False)
               for m in layer.modules() for h in m._forward_pre_hooks.values())


def _link_rate(device: torch.device) -> float:
    """Host <-> device bytes per second in one direction: effmem plan's rates for this GPU (its
    calibration, else the committed H100 figure); 0 for a CPU."""
    if device.type != "cuda":
        return 0.0
    from effmem.plan.rates import rates_for
    return rates_for(torch.cuda.get_device_name(device)).link_bw


@contextlib.contextmanager
def _unrecorded():
    """The probes' extra runs of a layer leave no trace in the model's outputs: transformers (5 and later)
    records some modules' outputs (router logits, attentions, hidden states) with forward hooks into one
    collector per model forward, which the probes would add to (a Mixtral's auxiliary loss would count
    layer 0's router three times). What they add is cut off again."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(getattr(capturing, "_active_collector", None), "get", lambda: None)()
    lengths = {k: len(v) for k, v in collector.items() if isinstance(v, list)} if isinstance(collector, dict) else {}
    try:
        yield
    finally:
        for key, n in lengths.items():
            del collector[key][n:]


def _copies(hidden: Tensor, others: List[Tensor], args, kwargs):
    """The layer's inputs for the probes, each tensor a copy (with its graph, so that what needs a gradient
    still does): a layer that changes its input in place (x.mul_, an in-place ReLU) changed the real one once
    per probe, three times in all, and the forward's values with it. Parameters are passed as they are.
    The hidden state's copy needs a gradient whatever the real one does: the layer measured stands for the
    later ones, whose input comes from a layer with weights to train. Measured on a first layer fed frozen
    embeddings, a LoRA-style stack (down_proj trained) stored 2.1x its budget (a reviewer's run)."""
    from torch.utils._pytree import tree_map
    made: Dict[int, Tensor] = {}
    if hidden.is_floating_point() and not hidden.requires_grad:   # (not a leaf: no parameter to the counts)
        made[id(hidden)] = hidden.detach().requires_grad_(True).clone()

    def copy(x):
        if not isinstance(x, Tensor) or isinstance(x, torch.nn.Parameter):
            return x
        if id(x) not in made:
            made[id(x)] = x.clone()
        return made[id(x)]
    args, kwargs = tree_map(copy, (args, kwargs))
    return copy(hidden), [copy(t) for t in others], args, kwargs


_LIBRARIES = ("torch.", "transformers.", "accelerate.", "effmem.", "peft.", "deepspeed.", "torchao.",
              "bitsandbytes.", "liger_kernel.")


def _warn_hooks(layer) -> None:
    """The probes run the forward of the first layer that records a graph twice more, hooks and all (they may be
    what the forward needs: an input cast, FSDP's or DeepSpeed's gathers): one of the user's that accumulates (an
    activation regulariser) counts those runs too (loss 1.28 where plain's is 1.19). Said once per calibration."""
    for name, m in layer.named_modules():
        if m is layer:   # the probes call the layer's forward, not the layer: its own hooks do not run again
            continue
        for hook in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()):
            fn = hook.func if isinstance(hook, functools.partial) else hook
            if not (getattr(getattr(fn, "__func__", fn), "__module__", None) or "").startswith(_LIBRARIES):
                warnings.warn(f"memory_budget: forward hooks inside the layer it measures (on {name}) run "
                              "again while the budget measures that layer: its forward runs twice more on a copy "
                              "of its inputs at each new input shape. A hook that accumulates (a regulariser, a "
                              "capture) counts those runs too; keep such hooks off that layer, or choose a "
                              "policy", stacklevel=2)
                return


def _count_plain(run, inputs: Sequence[Tensor]) -> int:
    """Bytes of the distinct storages a forward saves, leaving out parameters and the given inputs."""
    skip = {storage_key(t) for t in inputs}
    seen: Dict[tuple, int] = {}

    def pack(t: Tensor):
        param = (t.requires_grad and t.is_leaf) or (t._base is not None and t._base.requires_grad and t._base.is_leaf)
        key = storage_key(t)
        if not param and key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        # detached: a node holding its own output (attention's, the fused RMSNorm's) as the tensor itself
        # makes a cycle through C++ that no garbage collection frees, and every calibration's probe graph of
        # a layer stayed alive for good (one per input shape). Kept alive: no address is reused meanwhile.
        return t.detach()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


class BudgetPolicy:
    """The per-shape choices of one model under memory_budget; layers call through forward()."""

    def __init__(self, budget, stack: List[nn.Module], comp: FastCompressor, bits: int, group_size: int,
                 allow_min: bool = True):
        # allow_min=False: a model whose loss uses tensors a layer makes besides its output (MoE router
        # logits), which "min" cannot backpropagate
        self.budget, self.layers, self.comp, self.allow_min = check_budget(budget), len(stack), comp, allow_min
        self.stack = list(stack)   # the layers, whose training modes a forward's key holds (_inputs_of_forward)
        self.bits, self.group_size = bits, group_size
        self.choices: Dict[tuple, dict] = {}  # shape key -> {"modes", "bytes", "budget_bytes", "predicted"}
        self.offloader = Offloader()
        self.used: Optional[tuple] = None  # the key of the last forward's choice (not the last one made)
        self._forward_inputs: Optional[tuple] = None   # this forward's first layer's other inputs (_inputs_of_forward)
        self._forward_hidden: Optional[tuple] = None   # and its index and hidden shape
        self._last_index = -1
        # what this forward's layers so far hold, and would hold plain, under their choices: a choice made later
        # in the forward (the hidden dtype changed: T5 in fp16 keeps wo in fp32) has the rest of the budget
        self._forward_held = self._forward_plain = 0
        self._outputs: Dict[int, Optional[weakref.ref]] = {}   # each layer's last output in this forward
        self.forward_hook = None   # the model's forward pre-hook that forgets them (new_forward)
        # this forward asks the layers for outputs besides their hidden state (output_router_logits=True passed
        # to the model's forward, as the config's flag at apply time): "min" is left out for it (new_forward)
        self.side_outputs = False

    def __getstate__(self):
        """A pickle (torch.save(model)) or copy without the last forward's outputs: weak references do not
        pickle, and a copy's next forward starts afresh anyway."""
        return dict(self.__dict__, _outputs={})

    def new_forward(self, module, args, kwargs) -> None:
        """The model's forward pre-hook (with its kwargs): the layers' outputs of an earlier forward forgotten, so
        that a model called again on its own output (a recurrent loop over a one-layer stack) is not taken for a
        layer looped inside one forward; and whether this forward asks for router logits or attention weights.
        Compiled, the hook is traced and does nothing: the layers run out of the graph
        (activations._compiled_budget_layer), where the check still sees a loop inside one forward."""
        if not torch.compiler.is_compiling():
            self._outputs.clear()
            self._forward_inputs = None   # a new forward (layerdrop may skip the layers its index rule needs)
            self.side_outputs = any(kwargs.get(f) is True for f in ("output_router_logits", "output_attentions"))

    def latest(self) -> Optional[dict]:
        choice = self.choices.get(self.used)
        return None if choice is None else dict(choice, offload_counters=dict(self.offloader.counters))

    def _calibrate(self, layer, plain_fn, fast_fn, hidden: Tensor, others: List[Tensor], args, kwargs,
                   warm: bool, start: int, compiled: bool = False) -> dict:
        """The modes of this input shape's layers from a run of layer `start`, the first that records a graph:
        the layers before it, frozen with no gradient flowing in, save nothing and run plain."""
        hidden, others, args, kwargs = _copies(hidden, others, args, kwargs)
        devices = [hidden.device] if hidden.device.type == "cuda" else []
        sync = (lambda: torch.cuda.synchronize(hidden.device)) if devices else (lambda: None)
        with torch.random.fork_rng(devices=devices):
            # the hidden state counts: a plain layer's saves are what keeps it alive
            plain = _count_plain(lambda: plain_fn(*args, **kwargs), others)

        def probe_run():
            probe, masks = FastCompressor(bits=self.bits, group_size=self.group_size), []
            with torch.random.fork_rng(devices=devices), probe.layer("probe", hidden, others, param_shapes(layer),
                                                                     True):
                # the ReLU masks a "min" layer keeps for its recompute (relu.relu_masks), counted below
                with probe.collecting() as entries, relu.relu_masks(masks, replay=False):
                    fast_fn(*args, **kwargs)
            return probe, entries, masks
        if warm:  # the timed run is not the first: no compilation or first kernel loads in layer_s
            probe_run()
        sync()
        t0 = time.perf_counter()
        probe, entries, masks = probe_run()
        sync()
        layer_s = time.perf_counter() - t0
        codes = sum(p.numel() * p.element_size() for e in entries for p in _parts(e))
        host_per_layer = sum(aligned_bytes(_parts(e)) for e in entries)
        g = self.group_size
        cols = hidden.shape[-1] if hidden.dim() and hidden.shape[-1] else 1
        rows = hidden.numel() // cols   # "min" keeps the layer input as quantize's rows (checkpoint.py)
        fast = probe.stats.total_bytes_after
        if compiled and (drops_out(layer) or _splits_graph(layer)):
            # compiled with dropout, "fast" runs torch's selective checkpointing eagerly, which keeps what it saves
            # out of the hooks the probe counts with (activations.compiled), and so do the pieces of a layer whose
            # graph OffloadAdam.attach's hooks split: counted as plain's, an upper bound (a 0.2 budget held 2.2x
            # and 4.7x, 'min' never chosen, a reviewer's run)
            fast = codes = plain
        nbytes = {"plain": plain, "fast": fast, "offload": fast - codes,
                  "min": (hidden.numel() * hidden.element_size() if routes_tokens(layer)   # kept as it is
                          else _codec.packed_bytes(rows, cols, self.bits, g)
                          + sum(packed.numel() for _, packed in masks))}
        link = _link_rate(hidden.device)
        layers = self.layers - start   # those that save something
        max_offload = hidden_layers(layers, layer_s, codes, link)
        # less what the layers before it in this forward hold under the choices they ran by (a second choice
        # in one forward took the whole budget again: 1.07x an int budget, a reviewer's fp16 layer 0)
        whole = (self.budget if isinstance(self.budget, int)
                 else int(self.budget * (self._forward_plain + layers * plain)))
        budget = max(whole - self._forward_held, 0)
        # "min"'s codes take float32, bf16 and fp16 hidden states (a float64 model: "fast" keeps what it cannot code)
        coded = hidden.dtype in _codec.FLOAT_DTYPES
        allow_min = self.allow_min and not self.side_outputs and coded
        modes = choose(layers, nbytes, budget, max_offload, allow_min)
        if modes is None:
            # the mode of fewest bytes: "plain" where "fast" keeps more (float64, whose values it keeps)
            least_mode = min(("plain", "fast", "min") if allow_min else ("plain", "fast"), key=nbytes.get)
            n_off = max_offload if nbytes["offload"] < nbytes[least_mode] else 0
            least = n_off * nbytes["offload"] + (layers - n_off) * nbytes[least_mode]
            how = (f"the first {n_off} layers offloaded (as many as the host link hides) and the rest under "
                   f"'{least_mode}'" if n_off else f"every layer under '{least_mode}'")
            if not allow_min:
                how += (" ('min' is left out: " + ("the model uses tensors a layer makes besides its output: a "
                                                   "router's loss, keys and values later layers share)"
                        if coded else f"its 8-bit codes take float32, bfloat16 or float16 hidden states, not "
                        f"{hidden.dtype})"))
            raise ValueError(f"memory_budget: {budget} bytes for {layers} layers at input shape "
                             f"{tuple(hidden.shape)} is below the least any choice holds: {least} bytes "
                             f"with {how}" + (f" (a fraction goes as a float: memory_budget={budget}.0)"
                                              if type(self.budget) is int and self.budget in (0, 1) else ""))
        predicted = sum(nbytes[m] for m in modes)
        modes = ["plain"] * start + modes
        if "offload" in modes:
            self.offloader.reserve(modes.count("offload") * host_per_layer, hidden.device)
        return {"modes": modes, "bytes": nbytes, "budget_bytes": budget, "predicted_bytes": predicted,
                "shape": tuple(hidden.shape), "max_offload": max_offload, "layer_forward_s": layer_s,
                "link_bytes_per_s": link, "start": start}

    def forward(self, layer, original, index: int, name: str, shapes, hidden: Tensor, others: List[Tensor],
                args, kwargs, compiled: bool = False):
        """The layer's forward under this shape's choice. compiled (inside a torch.compile'd model): each
        mode runs the layer as a compiled graph of its own (activations.compiled), "fast" and "offload"
        with the selective checkpointing that makes the partitioner rebuild elementwise outputs.

        A layer run again on its own output (ALBERT's one shared layer, looped through the depth) is refused:
        the budget counts each layer once, so its choice would hold that layer's saves as many times as the
        loop runs, over the budget (12 times for ALBERT-base), silently."""
        last = self._outputs.get(index)
        if last is not None and last() is hidden:
            raise ValueError(f"memory_budget: {name} ran again on its own output (one layer looped through the "
                             "model's depth, as ALBERT's shared layer is): the budget counts each layer once, so "
                             "its choice would hold more than the budget. Give a policy instead "
                             "(apply_activation_policy(model, policy='fast' or 'min'), which compress every run)")
        out = self._forward(layer, original, index, name, shapes, hidden, others, args, kwargs, compiled)
        # the hidden state out: the output, or its first entry (as "min" takes it); a layer that returned its
        # input (skipped, or a no-op) is no loop's step
        first = out[0] if isinstance(out, tuple) and out else out
        self._outputs[index] = weakref.ref(first) if isinstance(first, Tensor) and first is not hidden else None
        return out

    def _inputs_of_forward(self, index: int, hidden: Tensor, others: List[Tensor]) -> tuple:
        """The shapes and dtypes of this forward's first layer's other inputs of 2 dims or more (masks, tables),
        for its choice's key: a padded batch's 4-D mask makes transformers' attention repeat k and v to every
        head (grouped without one), and a choice made without it held 15% over an int budget. Not index vectors:
        a packed batch's cu_seq_lens, one longer per sequence, made a choice per count. One per forward, not per
        layer: layers get different ones (T5's first has no position bias, sliding-window layers a mask the
        others do not), and a choice for each held the whole budget each. A forward starts where the model's
        pre-hook said so, or (compiled: it does not run) at a layer index no later than the last one's, and the
        statistics start there too. With every layer's train/eval mode (a first forward in eval mode, no dropout
        masks, measured other bytes than training), once per forward too: keyed on each layer's own, layers in
        eval mode among training ones made a second choice in a forward, each holding the whole budget."""
        if self._forward_inputs is None or index <= self._last_index:
            # (the modes as bytes: a key hashed at every layer call, whose hash bytes keep)
            self._forward_inputs = (tuple((tuple(t.shape), t.dtype) for t in others if t.dim() >= 2),
                                    bytes(layer.training for layer in self.stack))
            self._forward_hidden = (index, tuple(hidden.shape))
            self._forward_held = self._forward_plain = 0
            self.comp.reset_stats()
        elif self._forward_hidden[1] != tuple(hidden.shape):
            # one layer measured for all: a stack whose blocks widen (a CNN's stages) made a choice per shape in
            # one forward, each holding the whole budget (1.62x an int budget, every layer plain). A dtype that
            # changes is let be (T5 loaded in fp16 keeps its wo in fp32: a choice for layer 0, one for the rest)
            first, shape = self._forward_hidden
            raise ValueError(f"memory_budget: the layers' hidden state changes shape along the stack (layer {first} "
                             f"got {shape}, layer {index} {tuple(hidden.shape)}): the budget measures one layer and "
                             "counts it for all, so it chooses among alike layers only. Give a policy instead "
                             "(apply_activation_policy(model, policy='fast' or 'min'))")
        self._last_index = index
        return self._forward_inputs

    def _forward(self, layer, original, index: int, name: str, shapes, hidden: Tensor, others: List[Tensor],
                 args, kwargs, compiled: bool):
        plain_fn = fast_fn = original
        if compiled:
            plain_fn, fast_fn = compiled_forward(original, selective=False), compiled_forward(original, selective=True)
        dev = hidden.device.type
        # autocast too: under it the layer saves other dtypes, and other bytes
        amp = torch.get_autocast_dtype(dev) if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) else None
        key = (tuple(hidden.shape), hidden.dtype, hidden.device, compiled, amp, self.side_outputs,
               self._inputs_of_forward(index, hidden, others))
        choice = self.choices.get(key)
        if choice is not None and key != self.used:   # used again: the last of the choices to go (MAX_CHOICES)
            self.choices[key] = self.choices.pop(key)
        if choice is None or index < choice["start"]:
            if not (hidden.requires_grad or any(t.requires_grad for t in others)
                    or any(p.requires_grad for p in layer.parameters())):
                # Frozen, and no gradient flows in (LoRA on later layers only): it saves nothing. Calibrated here,
                # it measured 0 bytes, the budget was 0 x the layers and every layer ran plain over it, silently.
                return plain_fn(*args, **kwargs)
            choice = None   # (a layer frozen when the choice was made trains now, gradual unfreezing: made again)
        if choice is None:
            _warn_hooks(layer)
            while len(self.choices) >= MAX_CHOICES:   # lengths that vary freely: the oldest choices go
                del self.choices[next(iter(self.choices))]
            with _unrecorded(), buffers_kept(layer.buffers()):
                choice = self.choices[key] = self._calibrate(layer, plain_fn, fast_fn, hidden, others, args,
                                                             kwargs, warm=compiled or hidden.device.type == "cuda",
                                                             start=index, compiled=compiled)
        self.used = key
        mode = choice["modes"][index]
        self._forward_held += choice["bytes"][mode]
        self._forward_plain += choice["bytes"]["plain"]
        if mode == "fast":   # (the statistics are reset at the forward's start: _inputs_of_forward)
            with self.comp.layer(name, hidden, others, shapes, False):
                out = fast_fn(*args, **kwargs)
        elif mode == "offload":
            if index == choice["modes"].index("offload"):   # the first offloaded layer (after any frozen ones)
                self.offloader.begin(hidden.device)
            with self.comp.layer(name, hidden, others, shapes, False):
                with self.comp.collecting() as entries:
                    out = fast_fn(*args, **kwargs)
            self.offloader.send(entries, hidden.device)
            return out
        elif mode == "min":
            out = compressed_layer_forward(layer, plain_fn, self.bits, self.group_size, *args, **kwargs)
        else:
            out = plain_fn(*args, **kwargs)
        if index and choice["modes"][index - 1] == "offload":
            self.offloader.prefetch_on_backward(out)  # the first layer after the offloaded ones
        return out
