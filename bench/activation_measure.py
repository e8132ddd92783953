"""The instruments of bench/bench_activations.py: what each row's memory and hook time are measured with.

sampled_peak (the CPU's peak bytes in use, sampled), count_saves (the distinct storages autograd saves in
one forward, inside and outside the decoder layers, torch_sac's cache included), wrap_sac / unwrap_sac
(torch's selective checkpointing per layer, its caches kept countable), state_bytes (parameters and
optimizer state) and hook_overhead (the "fast" policy's CPU time per saved tensor).
"""
import contextlib
import functools
import threading
import time
import warnings

import torch
from torch.utils.checkpoint import checkpoint

from common import sync
from effmem.activations import activation_stats, selective
# glibc mallinfo2's bytes in use (None off glibc): what effmem plan --verify measures the CPU with
from effmem.plan.verify import _host_in_use as host_in_use, bytes_in_use as in_use  # noqa: F401

# torch_sac: torch's selective checkpointing with effmem's "selective" rule (matmul and attention outputs
# saved, norms, rotary and SiLU recomputed), wrapped here by hand so that its caches can be counted.


@contextlib.contextmanager
def sampled_peak(out: dict):
    """CPU: the largest in-use count seen by a thread that samples every 0.2 ms while the block runs.
    Torch's ops release the GIL, so the sampler runs beside them; a peak shorter than a sample is missed."""
    done, peak = threading.Event(), [host_in_use() or 0]

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], host_in_use())
            time.sleep(0.0002)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        out["peak"] = max(peak[0], host_in_use())


class SacCaches:
    """The caches of torch_sac's checkpointed layers, collected only while saves are counted (kept
    longer, they would keep every step's saved outputs alive)."""
    def __init__(self):
        self.active, self.contexts = False, []


def wrap_sac(model, caches: SacCaches):
    """torch_sac: each decoder layer's forward checkpointed with the selective policy; undone by unwrap."""
    def context_fn():
        fwd, recompute = selective.context()
        if caches.active:
            caches.contexts.append(fwd)
        return fwd, recompute
    for layer in model.model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, context_fn=context_fn)


def unwrap_sac(model):
    for layer in model.model.layers:
        layer.__dict__.pop("forward", None)


@contextlib.contextmanager
def count_saves(model, result: dict, layer_inputs: bool, sac: SacCaches):
    """Around one forward: distinct storages autograd saves (parameters excluded), split into inside and
    outside the decoder layers. Checkpointing's own hooks hide what it drops; what it keeps is added:
    each layer's input (layer_inputs) and the outputs a selective policy cached (sac)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, depth = {}, [0]

    def note(t, inside):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            seen.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), inside))

    def pack(t):
        note(t, depth[0] > 0)
        return t

    def pre(mod, args, kwargs):
        depth[0] += 1
        if layer_inputs:
            note(args[0] if args else kwargs.get("hidden_states"), True)

    def post(mod, args, kwargs, out):
        depth[0] -= 1
    sac.active = True
    handles = [h for layer in model.model.layers for h in (
        layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post, with_kwargs=True))]
    try:
        with warnings.catch_warnings(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            warnings.simplefilter("ignore", FutureWarning)  # SAC: "hooks will see its cache in a future release"
            yield
    finally:
        sac.active = False
        for h in handles:
            h.remove()
    for ctx in sac.contexts:
        for outs in ctx.storage.values():
            for leaf in torch.utils._pytree.tree_leaves(outs):
                note(getattr(leaf, "val", None), True)
    sac.contexts.clear()
    stats = activation_stats(model)  # "fast" keeps its layers' saves in its own hooks, inside ours
    fast = stats.total_bytes_after if stats is not None else 0
    result["layer_saved_bytes"] = sum(n for n, inside in seen.values() if inside) + fast
    result["saved_bytes"] = sum(n for n, _ in seen.values()) + fast


def state_bytes(model, opt):
    tensors = list(model.parameters()) + [v for st in opt.state.values() for v in st.values()
                                          if torch.is_tensor(v)]
    return sum(t.nbytes for t in tensors)


def hook_overhead(model, x, device) -> dict:
    """The "fast" policy's CPU time in its saved-tensor hooks per saved tensor, over one forward + backward,
    less the time inside the quantise/dequantise calls and the rebuilt outputs' ops (on a GPU those only
    launch kernels): the C++ store times its kernel calls itself (SavedTensors.work_ns), the Python ones are
    timed around each call here. Issue 10's target: at most 10 us per save."""
    from effmem.compress import _codec
    comp = model._effmem_fast
    clock = {"hooks": 0.0, "work": 0.0, "saves": 0, "depth": 0}
    now = time.perf_counter

    def hook(fn, count):
        # the outermost hook call's time (a rebuild unpacks its inputs through the hooks again)
        def wrapper(arg):
            if count:
                clock["saves"] += 1
            if clock["depth"]:
                return fn(arg)
            clock["depth"] = 1
            t = now()
            try:
                return fn(arg)
            finally:
                clock["hooks"] += now() - t
                clock["depth"] = 0
        return wrapper

    def work(fn):
        def wrapper(*a, **k):
            t = now()
            try:
                return fn(*a, **k)
            finally:
                clock["work"] += now() - t
        return wrapper

    add = comp.add_recipe

    def add_recipe(out, fn, inputs, node=None):  # the rebuild's own ops are work, not hook overhead
        return add(out, work(fn), inputs, node)
    saved = (_codec.quantize, _codec.dequantize)
    # the hooks autograd calls (C++, falling back to Python's rules), and add_recipe's packing of its inputs
    hooks = comp._pack_hook, comp._unpack_hook
    comp._pack_hook, comp._unpack_hook = hook(hooks[0], True), hook(hooks[1], False)
    comp.add_recipe = add_recipe
    _codec.quantize, _codec.dequantize = work(_codec.quantize), work(_codec.dequantize)
    cpp_work = comp._saves.work_ns
    try:
        model(input_ids=x, labels=x).loss.backward()
        sync(device)
    finally:
        _codec.quantize, _codec.dequantize = saved
        comp._pack_hook, comp._unpack_hook = hooks
        comp.__dict__.pop("add_recipe", None)
        model.zero_grad(set_to_none=True)
    clock["work"] += (comp._saves.work_ns - cpp_work) * 1e-9
    # a recipe packs its inputs through the pack hook too: those calls count as saves, as autograd's do
    return {"hook_saves": clock["saves"], "hook_us_per_save": (clock["hooks"] - clock["work"]) / max(1, clock["saves"])
            * 1e6}
