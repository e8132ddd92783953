"""plan.apply(model): the chosen configuration, ready for a training loop."""
import contextlib
from typing import Optional, Tuple

import torch
from torch import nn

from effmem import _checks
from effmem.activations import apply_activation_policy, min_refusal
from effmem.activations.cache import no_training_cache
from effmem.compress import compress_activations
from effmem.compress.api import _module_call_frame, _on_stack
from effmem.linear_ce_hf import fuse_linear_cross_entropy
from effmem.optim import FusedAdam, OffloadAdam
from effmem.optim._validate import whole
from effmem.plan.model import Trainable, find_blocks, techniques_on
from effmem.plan.report import plan_code


class _SaveOnCpu:
    """Forward hooks that run the model's forward inside torch.autograd.graph.save_on_cpu."""

    def __init__(self, model: nn.Module, pin: bool):
        self.open = []   # per call of the model: (the save_on_cpu entered or None, the frame of that call)
        self.pin = pin
        model.register_forward_pre_hook(self.enter)
        model.register_forward_hook(self.exit, always_call=True)

    def enter(self, module, args):
        caller = _module_call_frame()
        if self.open and not _on_stack(self.open[0][1], caller):
            # a forward interrupted past its exit hook (Ctrl-C: torch runs always_call hooks on an Exception
            # only) left its context entered: each one more save_on_cpu for every later save of the thread
            for ctx, _ in reversed(self.open):
                if ctx is not None:
                    ctx.__exit__(None, None, None)
            self.open.clear()
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=self.pin) if torch.is_grad_enabled() else None
        if ctx is not None:
            ctx.__enter__()
        self.open.append((ctx, caller))

    def exit(self, module, args, output):
        if self.open:
            ctx, _ = self.open.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)


def _check_runnable(plan, model: nn.Module, cfg) -> None:
    """Before anything changes: a model with values, as it was built (none of the techniques the candidate
    chooses among already on it), on a machine with the device the plan was made for."""
    meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise ValueError(f"model: {meta} is on the meta device (no values: a model built to be planned); build "
                         "it with its weights (from_pretrained, or to_empty() and load them) to apply the plan")
    on = techniques_on(model, fused_loss=cfg.loss != "standard")
    if on:
        # kept, the model would not be the one whose memory and time the candidate predicts (a policy left on
        # under an "activations: none" pick), or refused by the step that applies the candidate's own, after
        # the cast and the freezing had changed the model
        raise ValueError(f"model: {'; '.join(on)} already on it; apply() prepares the model as it was built, "
                         f"with {cfg.name}'s techniques only: undo that first")
    refused = min_refusal(getattr(model, "config", None)) if cfg.activations == "checkpoint8" else None
    if refused:   # refused by apply_activation_policy after the fused loss had gone on (a reviewer's run)
        raise ValueError(f"candidate: {cfg.name} puts the layers under the 'min' policy, and for this model {refused}")
    _check_attention(plan, model)
    check_device(plan)


def _check_attention(plan, model: nn.Module) -> None:
    """The attention kernel the plan traced: eager attention keeps the [seq, seq] scores, several times what
    sdpa's kernels save (1.64x the planned activations of a small Llama at 512 tokens, a reviewer's run)."""
    planned = plan.spec.attention if plan.spec is not None else None
    have = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not (isinstance(planned, str) and isinstance(have, str)) or have == planned:
        return
    if planned == "sdpa" and have.startswith("flash"):   # planned as sdpa, whose flash kernel saves the same
        return
    raise ValueError(f"model: its attention runs as {have!r} (config._attn_implementation), the plan's as "
                     f"{planned!r}, whose saved activations and time it counted; build the model with "
                     f"attn_implementation={planned!r}, or plan this one")


def check_device(plan) -> None:
    """The device the plan was made for is here."""
    if plan.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("plan: made for a CUDA GPU (gpu_memory given, or found then), but this process sees "
                           "none; plan with device='cpu' to train on the CPU")


# the optimizer's arguments a candidate sets itself, and OffloadAdam's modes (a FusedAdam candidate has none)
_CANDIDATE_KWARGS = {"params", "state_bits", "optimizer_class"}
_OFFLOAD_MODES = {"overlap", "async_step", "device_accumulation", "device_state"}


def apply(plan, model: nn.Module, candidate: Optional[str] = None, lr: float = 3e-4,
          **optimizer_kwargs) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """Prepare `model` as the pick (or the named candidate) of `plan` says; returns (model, optimizer).

    Moves and casts the model (bf16 weights, or fp32 ones to run under autocast), freezes what the
    plan's ``trainable`` leaves frozen, checkpoints, compresses or offloads activations, computes the
    loss with effmem.linear_cross_entropy (a "fused-ce" pick; "fused-ce-grad-in-fwd": grad_in_forward=True),
    and builds FusedAdam or OffloadAdam over the trained parameters. The key/value cache is off in forwards
    with gradients (hooks; the config is left as it was, and inference keeps its cache), whichever the
    candidate: effmem.activations.restore_training_cache(model) turns it back on for a candidate without an
    activation policy (under one, a layer run again refuses a cache: remove_activation_policy(model) undoes
    both). Run ``accumulation`` micro-batches of
    ``micro_batch`` sequences per optimizer step (``plan.pick.config``), each inside
    ``plan.micro_batch(opt, j, accumulation)``, float inputs (pixels, audio features) in the weights' dtype,
    as plan() traced them and verify() passes them (a bf16 candidate's convolution refuses float32 images).
    """
    c = plan.pick if candidate is None else plan.candidate(candidate)
    if c is None:
        raise RuntimeError(f"plan: nothing fits {plan.gpu_memory / 1e9:.1f} GB, so there is nothing to apply "
                           f"(see str(plan) for how far each candidate is over)")
    cfg = c.config
    _checks.module(model)
    chosen = sorted(optimizer_kwargs.keys() & (_CANDIDATE_KWARGS | _OFFLOAD_MODES))
    if chosen:   # passed on, they met the candidate's own: "got multiple values for keyword argument"
        which = ("OffloadAdam's, not options of the candidate's FusedAdam" if cfg.optimizer == "gpu"
                 and set(chosen) <= _OFFLOAD_MODES else "the candidate's to choose")
        raise ValueError(f"{', '.join(chosen)}: {which} ({c.name}); plan with the option you want among the "
                         "candidates, or apply one that has it")
    _check_same_model(plan, model)
    if cfg.sharding != "none":
        _check_distributed(plan, c.name)
    _check_runnable(plan, model, cfg)
    spec = plan.spec
    which = Trainable.parse(spec.trainable_text) if spec is not None and spec.trainable_text else None
    if which is not None:
        if which.partial:
            raise ValueError(f"trainable: {which.text!r} trains part of a parameter (#a:b); apply() freezes "
                             "whole parameters only")
        for name, p in model.named_parameters():
            p.requires_grad_(which.numel(name, tuple(p.shape)) > 0)
    device = torch.device("cuda" if plan.device == "cuda" else "cpu")
    model = model.to(device=device, dtype=torch.bfloat16 if cfg.precision == "bf16" else torch.float32)
    no_training_cache(model)   # a training forward needs no key/value cache (the config is left as it was)
    if cfg.loss != "standard":   # first: the activation strategies wrap or hook the model it patches
        fuse_linear_cross_entropy(model, grad_in_forward=True if cfg.loss == "fused_gif" else None)
    if cfg.activations in ("checkpoint", "selective"):
        apply_activation_policy(model, cfg.activations)   # torch's checkpoint per decoder layer, any model
    elif cfg.activations == "checkpoint8":
        apply_activation_policy(model, "min")
    elif cfg.activations == "fast":
        apply_activation_policy(model, "fast")
    elif cfg.activations == "fast_offload":
        apply_activation_policy(model, memory_budget=c.cost.activation_budget)
    elif cfg.activations.startswith("compress"):
        model = compress_activations(model, bits=int(cfg.activations[len("compress"):]))
    elif cfg.activations == "save_on_cpu":
        model._effmem_save_on_cpu = _SaveOnCpu(model, pin=device.type == "cuda")
    if cfg.sharding in ("zero2", "zero3"):
        _fully_shard(model, reshard=cfg.sharding == "zero3", device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.sharding == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(params, optimizer_class=FusedAdam, lr=lr, state_bits=cfg.state_bits,
                                      **optimizer_kwargs)
    elif cfg.optimizer == "gpu":
        opt = FusedAdam(params, lr=lr, state_bits=cfg.state_bits, **optimizer_kwargs)
    else:
        opt = OffloadAdam(params, lr=lr, overlap=cfg.optimizer == "offload_overlap",
                          async_step=cfg.optimizer == "offload_async", state_bits=cfg.state_bits,
                          device_accumulation=cfg.device_accumulation, device_state=cfg.device_state,
                          **optimizer_kwargs)
        if cfg.optimizer == "offload_async":
            opt.attach(model)
    if cfg.sharding in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel
        # Gradients as views of DDP's buckets: no second copy of them (what the plan counted).
        model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    return model, opt


def micro_batch(opt, index: int, accumulation: int):
    """The context for micro-batch `index` (from 0) of `accumulation`: OffloadAdam's ``accumulating()``
    for all but the last, which its overlap mode needs and under which device_accumulation keeps gradients
    on the GPU; nothing otherwise."""
    # an index past the last (or an accumulation of 0) put every micro-batch outside accumulating(): OffloadAdam
    # sent the gradients each time, or never left accumulating, without a word
    accumulation, index = whole(accumulation, "accumulation", 1), whole(index, "index", 0)
    if index >= accumulation:
        raise ValueError(f"index: expected a micro-batch in 0..{accumulation - 1} (accumulation = {accumulation}), "
                         f"got {index}")
    if isinstance(opt, OffloadAdam) and index < accumulation - 1:
        return opt.accumulating()
    return contextlib.nullcontext()


def _check_same_model(plan, model: nn.Module) -> None:
    """Refuse a model other than the planned one: its memory is not what the plan counted (an nn.Linear, or a
    Llama of another size, was prepared without a word). The total parameter count (tied weights once, as the
    plan counts them) does not depend on what is frozen or on the device or dtype, so the planned model itself,
    from a config or as a module, always passes."""
    n = sum(p.numel() for p in model.parameters())
    # within 5%: a vocabulary resized for a tokenizer's added tokens, LoRA's adapters, are still that model
    if abs(n - plan.params) > 0.05 * plan.params:
        raise ValueError(f"model: {type(model).__name__} has {n:,} parameters, the plan's {plan.model} "
                         f"{plan.params:,}: apply() prepares the model that was planned (plan this one first)")


def _check_distributed(plan, name: str) -> None:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        c = plan.candidate(name)
        code = plan_code(plan, c)
        raise ValueError(f"candidate {name}: a sharded configuration is applied on every rank after "
                         f"torch.distributed.init_process_group (torchrun); it is not initialised here. The "
                         f"lines each rank runs:\n{code}")
    if dist.get_world_size() != plan.gpus:
        raise ValueError(f"candidate {name}: planned for {plan.gpus} ranks, torch.distributed has "
                         f"{dist.get_world_size()}")


def _fully_shard(model: nn.Module, reshard: bool, device: torch.device) -> None:
    """FSDP2: each decoder layer its own unit, then the rest; reshard=False keeps the gathered weights
    from forward to backward (ZeRO-2: sharded gradients and state), True gathers them again (ZeRO-3)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in find_blocks(model)[1]:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
