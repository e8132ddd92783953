"""How OffloadAdam wires its parameters to the C++ engine: one device, buckets of one dtype in
backward order, landing chunks for accumulated gradients, and the hook handing gradients over."""
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from effmem.optim._offload_distributed import keep_streaming


class GradHook:
    """Post-accumulate-grad hook: hands the gradient to the engine. Holds the optimizer weakly,
    so that parameters do not keep a dropped optimizer (and its engine) alive."""

    def __init__(self, ref):  # a weakref.ref to the optimizer
        self.ref = ref

    # Host work: where a compiled training step runs backward, dynamo would otherwise trace this hook at
    # each call and compile it again (the gradient it reads is gone after the hand-off), to its limit.
    @torch.compiler.disable
    def __call__(self, p: Tensor) -> None:
        opt = self.ref()
        if opt is None or p.grad is None or opt._engine is None or opt._engine.closed:
            return
        i = opt._index[p]
        if opt._async:   # a gradient of autograd's, perhaps taken at step() (_install_unread)
            opt._autograd_grads.add(i)
        if not opt._stream_grads or (opt._accumulating and i in opt._keep_on_device):
            return  # gradients left in p.grad for step(); device_accumulation: summed there until the last one
        if not opt._in_backward and not keep_streaming(opt):
            return  # ranks came after the optimizer: gradients stay in p.grad for step()
        opt._begin_backward()
        opt._hand_off(p)


# A gradient for a parameter whose host staging already holds one lands in one
# of these page-locked chunks first, then is added in on the host.
LANDING_CHUNK_NUMEL = 1 << 22
LANDING_CHUNKS = 8


def engine_device(tensors: Sequence[Tensor], backend: Optional[str]) -> Tuple[torch.device, str]:
    """The one device of an engine's parameters and its copy backend; refuses what no engine can take."""
    if not tensors:
        raise ValueError("params: OffloadAdam got no parameters")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"params: OffloadAdam offloads the parameters of one device, got {sorted(map(str, devices))}; "
                         "use one optimizer per device")
    device = devices.pop()
    wanted = "cuda" if device.type == "cuda" else "host"
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"params: expected CPU or CUDA parameters, got {device}")
    if backend is None:
        backend = wanted
    if backend not in ("cuda", "host"):
        raise ValueError(f"backend: expected 'cuda', 'host' or None, got {backend!r}")
    if backend != wanted:
        raise ValueError(f"backend: {backend!r} needs {'CUDA' if backend == 'cuda' else 'CPU'} parameters, "
                         f"but they are on {device}")
    return device, backend


def build_engine(opt, backend: Optional[str], num_threads: int, pin_state: bool, bucket_size: int,
                 host_delay_us: float, state_bits: int = 32):
    from effmem import _C

    device, backend = engine_device(opt._local, backend)
    group_of = [gi for gi, g in enumerate(opt.param_groups) for _ in g["params"]][opt._first:]
    bucket_of = opt._bucket_of = assign_buckets([(t.numel(), t.dtype) for t in opt._local], bucket_size)
    expects = [bool(p.requires_grad) for p in opt._params]
    # Landing chunks (for gradients accumulated over micro-batches): up to 4M
    # elements each, no larger than the largest parameter.
    chunk = max(1, min(LANDING_CHUNK_NUMEL, max(t.numel() for t in opt._local)))
    return _C.OffloadEngine(opt._local, bucket_of, group_of, expects, len(opt.param_groups), backend=backend,
                            device=device.index if device.type == "cuda" else -1, num_threads=num_threads,
                            pin_state=pin_state, overlap=opt._overlap, delay=opt._delay, landing_chunk_numel=chunk,
                            landing_chunks=LANDING_CHUNKS, host_delay_us=float(host_delay_us), seed=0,
                            state_bits=state_bits, install_in_forward=opt._async,
                            salt_base=opt._first, delay_correction=opt._delay_correction)


def assign_buckets(tensors: Sequence[Tuple[int, object]], bucket_size: int) -> List[int]:
    """The bucket of each tensor, given (numel, dtype) in registration order. Buckets hold one dtype and
    are filled in reverse registration order (roughly the order in which backward produces gradients),
    a new one where the next tensor would overflow it; numbered as they are opened. effmem plan lays out
    its model's buckets with this too (plan.costs.offload_buckets)."""
    bucket_of = [0] * len(tensors)
    open_bucket: Dict[object, Tuple[int, int]] = {}
    opened = 0
    for i in reversed(range(len(tensors))):
        numel, dtype = tensors[i]
        b, filled = open_bucket.get(dtype, (-1, 0))
        if b < 0 or (filled > 0 and filled + numel > bucket_size):
            b, filled = opened, 0
            opened += 1
        bucket_of[i] = b
        open_bucket[dtype] = (b, filled + numel)
    return bucket_of


def leading_buckets(sizes: Sequence[int], budget: int) -> int:
    """How many buckets, first to last (backward order), fit together in `budget` bytes."""
    used = 0
    for k, size in enumerate(sizes):
        if used + size > budget:
            return k
        used += size
    return len(sizes)


def keep_on_device(opt, budget: int) -> set:
    """Indices of the parameters whose gradients stay on the device during accumulation: whole buckets,
    first to last, while their gradients fit in `budget` bytes."""
    if budget <= 0:
        return set()
    sizes = [0] * (max(opt._bucket_of) + 1)
    for i, b in enumerate(opt._bucket_of):
        sizes[b] += opt._local[i].numel() * opt._local[i].element_size()
    kept = leading_buckets(sizes, budget)
    return {i for i, b in enumerate(opt._bucket_of) if b < kept}
