"""OffloadAdam under torch.distributed: DDP's gradient hand-over, FSDP2's sharded norms and state."""
import warnings
import weakref
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from effmem.optim import _validate


def global_sq_sum(params: List[Tensor], sums: List[float]) -> float:
    """The global sum of squares: each rank's shards summed over the ranks holding the other
    shards; replicated and plain parameters counted once. Every rank makes the same
    collective calls in the same order (the parameters are in the same order)."""
    total = 0.0
    sharded: Dict[Tuple[int, Tuple[int, ...]], List] = {}
    for p, sq in zip(params, sums):
        dims = shard_dims(p)
        if dims:
            entry = sharded.setdefault((id(p.device_mesh), dims), [p.device_mesh, 0.0])
            entry[1] += sq
        else:
            total += sq
    for (_, dims), (mesh, sq) in sharded.items():
        t = torch.tensor([sq], dtype=torch.float64, device=mesh.device_type)  # the current device of that type
        for d in dims:
            torch.distributed.all_reduce(t, group=mesh.get_group(d))
        total += float(t.item())
    return total


def shard_dims(t: Tensor) -> Tuple[int, ...]:
    """The mesh dimensions a DTensor is sharded on (none for a plain tensor): a norm's sums of squares are
    all-reduced over these, not over replicas."""
    return tuple(d for d, pl in enumerate(t.placements) if is_shard_like(pl)) if _validate.is_dtensor(t) else ()


def is_shard_like(placement) -> bool:
    """Shard, or FSDP2's _StridedShard of a tensor-parallel parameter (whose is_shard() is False)."""
    from torch.distributed.tensor import placement_types
    check = getattr(placement_types, "_is_shard_like", None)
    return check(placement) if check is not None else placement.is_shard()


def like_param(view: Tensor, p: Tensor) -> Tensor:
    """A host state view as the parameter's kind: for a DTensor, a DTensor of the same mesh and
    placements around it, so distributed checkpointing sees sharded state. Built directly, as
    FSDP2 builds its CPU-offloaded parameters: DTensor.from_local would copy a host tensor to a
    GPU mesh's device, handing out a stale device copy instead of the engine's memory."""
    if not _validate.is_dtensor(p):
        return view
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    spec = DTensorSpec(p.device_mesh, tuple(p.placements),
                       tensor_meta=TensorMeta(p.shape, tuple(p.stride()), view.dtype))
    return DTensor(view, spec, requires_grad=False)


def ddp_stream_hook(ref: "weakref.ref"):
    """A DDP communication hook: DDP's own mean all-reduce of a bucket, then the hand-over of the
    reduced gradients to the engine (which copies them off on its side stream). A plain function:
    DDP inspects hooks by name and signature."""

    def offload_adam_stream_hook(group, bucket):
        group = group if group is not None else torch.distributed.group.WORLD
        buffer = bucket.buffer()
        buffer.div_(group.size())  # before the sum, as DDP's default hook does (no fp16 overflow)
        params, grads = bucket.parameters(), bucket.gradients()
        fut = torch.distributed.all_reduce(buffer, group=group, async_op=True).get_future()

        def hand_over(fut):
            reduced = fut.value()[0]
            opt = ref()
            if opt is not None and opt._engine is not None and not opt._engine.closed and opt._ddp_error is None:
                try:
                    take_reduced(opt, params, grads)
                except Exception as err:  # raised by step(): failing here would leave DDP mid-reduction
                    opt._ddp_error = err
            return reduced

        return fut.then(hand_over)

    return offload_adam_stream_hook


class DdpClearStreamed:
    """Forward pre-hook, for gradient accumulation: DDP copied the reduced gradients it streamed
    into p.grad; drop them, so the next backward does not add them in a second time. And the
    next backward overwrites DDP's buckets in place, which the copies still in flight read:
    the current stream waits for those copies first, at every forward (delay's step() returns
    before its copies are done, and clears what was streamed: waiting only while some was
    pending let the backward after a step overwrite buckets still being read)."""

    def __init__(self, ref: "weakref.ref"):
        self.ref = ref

    def __call__(self, module, args):
        opt = self.ref()
        if opt is None or opt._engine.closed:
            return
        if opt._overlap or opt._delay:
            opt._engine.fence()  # weights uploaded during the last backward, before this forward reads them
        opt._engine.order_after_downloads()
        for i in opt._streamed:
            opt._params[i].grad = None


def attach_ddp(opt, ddp_module) -> None:
    """OffloadAdam.attach_ddp's checks and hooks (see its docstring)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_module, DistributedDataParallel):
        raise TypeError(f"ddp_module: expected a DistributedDataParallel module, got {type(ddp_module).__name__}")
    if opt._resident_opt is not None:
        raise RuntimeError("attach_ddp: not with device_state, whose parameters' gradients must stay in p.grad; "
                           "without attach_ddp, DDP's averaged gradients are taken at step()")
    if opt._stream_grads:
        raise RuntimeError("attach_ddp: this optimizer streams gradients with backward hooks, which take them "
                           "before DDP's all-reduce; construct it with stream_grads=False")
    if ddp_module.find_unused_parameters or getattr(ddp_module, "static_graph", False):
        raise ValueError("ddp_module: attach_ddp does not support find_unused_parameters=True or "
                         "static_graph=True: DDP's bucket then holds zeros for an unused parameter, which "
                         "the engine would step (weight decay, momentum); leave gradients to step()")
    missing = [n for n, p in ddp_module.module.named_parameters() if p.requires_grad and p not in opt._index]
    if missing:
        raise ValueError(f"ddp_module: parameters {missing[:3]} are not in this optimizer")
    ref = weakref.ref(opt)
    ddp_module.register_comm_hook(ddp_module.process_group, ddp_stream_hook(ref))
    opt._ddp_handles.append(ddp_module.register_forward_pre_hook(DdpClearStreamed(ref)))


@torch.no_grad()
def take_reduced(opt, params: List[Tensor], grads: List[Tensor]) -> None:
    """Hands DDP's all-reduced gradients of one bucket to the engine."""
    for p, g in zip(params, grads):
        if not p.is_contiguous():
            # DDP's bucket holds such a gradient in the parameter's own strides, not
            # as bucket.gradients() views it: take it from p.grad at step() instead.
            continue
        i = opt._index[p]
        opt._begin_backward()
        opt._send(i, g.reshape(opt._local[i].shape))
        opt._streamed.add(i)


def _multi_rank() -> bool:
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def keep_streaming(opt) -> bool:
    """At each backward's first hooked gradient. stream_grads left to its default by an optimizer built before
    init_process_group, with several ranks now: its hooks would take each rank's local gradient before DDP's
    all-reduce (the replicas drifted apart, silently). They are removed, this backward's gradients and the
    next ones taken from p.grad at step(), and it warns once."""
    if opt._stream_asked is not None or not _multi_rank():
        return True
    if not opt._async:   # async_step's hooks go on marking (GradHook)
        for h in opt._hooks:
            h.remove()
        opt._hooks = []
    opt._stream_grads = False
    warnings.warn("OffloadAdam: built before torch.distributed.init_process_group, it streamed gradients off in "
                  "backward; with several ranks now (DDP all-reduces after its hooks) it takes them at step() "
                  "instead. Build it after init_process_group, or pass stream_grads=False, to say so.",
                  stacklevel=3)
    return False


def stream_grads_choice(stream_grads) -> bool:
    """OffloadAdam's stream_grads: by default on, except with several ranks (DDP reads p.grad after the
    hooks would have taken it); asked for with several ranks, it warns. (keep_streaming: the ranks came later.)"""
    multi_rank = _multi_rank()
    if stream_grads is None:
        return not multi_rank
    if stream_grads and multi_rank:
        warnings.warn("OffloadAdam(stream_grads=True) with several ranks: under DDP the hooks take each "
                      "rank's local gradient before DDP's all-reduce, and the replicas drift apart. Leave "
                      "stream_grads unset (False here) unless the parameters are not DDP's (FSDP2 "
                      "assigns its gradients without the hooks either way).", stacklevel=3)
    return bool(stream_grads)
