"""apply_activation_policy(model, memory_budget=...): per decoder layer, plain, "fast" or "min", whichever
mix holds the decoder layers' saved activations within a budget at the least time.

The bytes of each choice are measured, not modelled: at the first forward with gradients for a given input
shape, the first layer's forward runs twice more on the real inputs (random state forked, outputs dropped)
with its saves counted, once as it is and once under the "fast" hooks; "min" keeps the layer input's 8-bit
codes, known exactly. The time of each choice is a fixed fraction of a plain layer's forward + backward
(COST below: "fast" quantises and rebuilds elementwise outputs, "min" recomputes the whole forward, about a
third of a layer's work); bench/bench_activations.py measures the real figures. Among all counts of "min",
"fast" and plain layers that fit, the cheapest wins (layers are alike, so counts are all that matter); a
budget below every layer in "min" raises, naming the least that fits.

The budget is a fraction of the layers' plain saved bytes (a float in (0, 1], as torch's
activation_memory_budget) or a number of bytes (an int) for the decoder layers at the current shape.
"""
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from effmem.activations.checkpoint import _layer_forward as compressed_layer_forward
from effmem.activations.fast import FastCompressor, param_shapes
from effmem.compress import _codec
from effmem.compress.tracker import storage_key

MODES = ("plain", "fast", "min")
# Extra time per layer, as a fraction of one plain layer's forward + backward.
COST = {"plain": 0.0, "fast": 0.05, "min": 0.36}


def check_budget(budget) -> Union[float, int]:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"memory_budget: expected a fraction in (0, 1] (float) or a number of bytes (int), "
                        f"got {type(budget).__name__}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"memory_budget: a fraction of the plain saved bytes must be in (0, 1], got {budget}")
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"memory_budget: bytes must be >= 0, got {budget}")
    return budget


def choose(layers: int, nbytes: Dict[str, int], budget: int) -> Optional[List[str]]:
    """The per-layer modes of least COST whose bytes fit `budget` (None if none does): min first, then fast."""
    best: Optional[Tuple[float, int, int]] = None
    for n_min in range(layers + 1):
        for n_fast in range(layers - n_min + 1):
            n_plain = layers - n_min - n_fast
            total = n_min * nbytes["min"] + n_fast * nbytes["fast"] + n_plain * nbytes["plain"]
            if total > budget:
                continue
            cost = n_min * COST["min"] + n_fast * COST["fast"]
            if best is None or cost < best[0]:
                best = (cost, n_min, n_fast)
    if best is None:
        return None
    _, n_min, n_fast = best
    return ["min"] * n_min + ["fast"] * n_fast + ["plain"] * (layers - n_min - n_fast)


def _count_plain(run, inputs: Sequence[Tensor]) -> int:
    """Bytes of the distinct storages a forward saves, leaving out parameters and the given inputs."""
    skip = {storage_key(t) for t in inputs}
    seen: Dict[tuple, int] = {}

    def pack(t: Tensor):
        param = (t.requires_grad and t.is_leaf) or (t._base is not None and t._base.requires_grad and t._base.is_leaf)
        key = storage_key(t)
        if not param and key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


class BudgetPolicy:
    """The per-shape choices of one model under memory_budget; layers call through forward()."""

    def __init__(self, budget, layers: int, comp: FastCompressor, bits: int, group_size: int):
        self.budget, self.layers, self.comp = check_budget(budget), layers, comp
        self.bits, self.group_size = bits, group_size
        self.choices: Dict[tuple, dict] = {}  # shape key -> {"modes", "bytes", "budget_bytes", "predicted"}

    def latest(self) -> Optional[dict]:
        return next(reversed(self.choices.values()), None)

    def _calibrate(self, layer, original, hidden: Tensor, others: List[Tensor], args, kwargs) -> dict:
        devices = [hidden.device] if hidden.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            # the hidden state counts: a plain layer's saves are what keeps it alive
            plain = _count_plain(lambda: original(*args, **kwargs), others)
        probe = FastCompressor(bits=self.bits, group_size=self.group_size)
        with torch.random.fork_rng(devices=devices), probe.layer("probe", hidden, others, param_shapes(layer), True):
            original(*args, **kwargs)
        n = hidden.numel()
        g = self.group_size
        rows, cols = (n // g, g) if n % g == 0 else (1, n)
        nbytes = {"plain": plain, "fast": probe.stats.total_bytes_after,
                  "min": _codec.packed_bytes(rows, cols, self.bits, g)}
        budget = self.budget if isinstance(self.budget, int) else int(self.budget * self.layers * plain)
        modes = choose(self.layers, nbytes, budget)
        if modes is None:
            raise ValueError(f"memory_budget: {budget} bytes for {self.layers} layers at input shape "
                             f"{tuple(hidden.shape)} is below the least any choice holds: "
                             f"{self.layers * nbytes['min']} bytes with every layer under 'min'")
        predicted = sum(nbytes[m] for m in modes)
        return {"modes": modes, "bytes": nbytes, "budget_bytes": budget, "predicted_bytes": predicted,
                "shape": tuple(hidden.shape)}

    def forward(self, layer, original, index: int, name: str, shapes, hidden: Tensor, others: List[Tensor],
                args, kwargs):
        key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        choice = self.choices.get(key)
        if choice is None:
            choice = self.choices[key] = self._calibrate(layer, original, hidden, others, args, kwargs)
        mode = choice["modes"][index]
        if mode == "fast":
            with self.comp.layer(name, hidden, others, shapes, index == choice["modes"].index("fast")):
                return original(*args, **kwargs)
        if mode == "min":
            return compressed_layer_forward(layer, original, self.bits, self.group_size, *args, **kwargs)
        return original(*args, **kwargs)

