"""OffloadAdam: Adam/AdamW whose fp32 master weights and moments live in host memory."""
import contextlib
import math
import os
import threading
from typing import Dict, Iterator, Optional, Tuple, Union

import torch
from torch import Tensor

from effmem.optim import _clip_route
from effmem.optim import _offload_distributed as _dist
from effmem.optim import _validate
from effmem.optim._adam_base import AdamBase
from effmem.optim._offload_checkpoint import OffloadCheckpoint
from effmem.optim._offload_forward import OffloadForward
from effmem.optim._offload_lifetime import OffloadLifetime
from effmem.optim._offload_guards import OffloadGuards
from effmem.optim._offload_build import OffloadBuild
from effmem.optim._offload_resident import OffloadResident
from effmem.optim._offload_state import update_queued
from effmem.optim.clip import clip_coefficient
from effmem.optim.fused_adam import ParamsT

_local = _validate.local_tensor


# delay=True's exact steps first (the docstring's delay_warmup); delay_correction's predictions miss most in a run's
# first steps (the new gradient's share of Adam's v, (1-beta2)/(1-beta2^k) at step k; a learning-rate warm-up).
DELAY_WARMUP, CORRECTION_WARMUP = 0, 40


class OffloadAdam(OffloadBuild, OffloadResident, OffloadCheckpoint, OffloadForward, OffloadLifetime, OffloadGuards, AdamBase):
    """Adam / AdamW with the optimizer state on the CPU and the update run there by a C++ engine.

    The GPU keeps only the parameters (bf16, fp16 or fp32). The fp32 master
    weights, exp_avg and exp_avg_sq live in host memory, allocated once (in
    buckets of parameters, in backward order). During backward, as each
    parameter's gradient is accumulated, it is copied to page-locked host
    staging in its own dtype on a side stream and the GPU gradient is freed,
    so full gradients never exist on the GPU at once. ``step()`` runs the
    vectorised CPU Adam (the FusedAdam kernel: the same math, bit for bit)
    over each bucket on a C++ thread pool, writes the new low-precision
    weights over the staged gradients and copies them back on a second
    stream, ordered before any later kernel that reads them. PCIe traffic
    per step for a bf16 model: 2 bytes/param down, 2 up (``counters()``).

    The ordinary loop works unchanged::

        loss.backward(); opt.step(); opt.zero_grad()

    with LR schedulers, param groups, gradient accumulation over several
    backward calls before ``step()`` (accumulated on the host in the
    gradient's dtype, as ``.grad +=`` would on the GPU), and clipping by
    global norm with ``opt.clip_grad_norm_(max_norm)`` (computed on the host
    from the staged gradients and applied inside the next step).

    Gradients are not left in ``p.grad``: after backward they live in the engine. ``torch.nn.utils.clip_grad_norm_``,
    ``effmem.clip_grad_norm_`` and accelerate's (Hugging Face's Trainer) are routed to ``opt.clip_grad_norm_`` when
    given this optimizer's parameters (a name bound before ``import effmem`` keeps torch's function); torch's clip
    once per step, after the last micro-batch. ``torch.amp.GradScaler`` (which inspects ``p.grad``) works with
    ``stream_grads=False`` only (fp16 parameters: the update unscales, as FusedAdam's); streamed, it is refused at
    ``step()``: use bf16, which needs no loss scaling.

    Args:
        params, lr, betas, eps, weight_decay, decoupled_weight_decay,
        bias_correction: as for :class:`effmem.FusedAdam`. ``lr`` may be a
            tensor; it is read on the host at each step.
        overlap: run each bucket's update during backward, as soon as all
            its parameters' gradients have landed, instead of in ``step()``.
            The math is unchanged, but (1) a bucket's update uses the
            hyper-parameters (lr...) as they were when backward began, so
            change them before ``backward()``, not between it and ``step()``;
            (2) parameters change during backward, once their gradient is
            complete (a use that takes no gradient, ``w.detach()``, later in
            the same backward reads the new weights: use the default or
            ``async_step``), and are whole again only once ``step()`` (or
            ``zero_grad()``) returns: do not read them in between; (3) it
            rules out clipping by global norm (``clip_grad_norm_`` raises, as
            the norm needs every gradient before any update; ``max_norm=inf``
            returns NaN with a warning) and
            accumulation across backward calls unless all but the last run
            inside ``with opt.accumulating():``; (4) a backward that raises
            midway (a user hook, an out-of-memory error) has already updated
            the buckets it completed: further steps are then refused with an
            error until you restore a checkpoint (the model's weights and
            ``load_state_dict``) or call ``accept_partial_step()``.
        delay: delayed parameter update. ``step()`` queues the CPU update
            and returns at once; the update runs during the next step's
            forward and backward passes, and each parameter's new weights
            are copied in during the next step's last backward (the one not
            inside ``accumulating()``), as soon as its gradient is complete
            (a detached use of it later in that backward reads them). This
            hides the CPU update behind a whole step of forward and
            backward, but changes the math: the next step still
            runs on the weights before this update, so each gradient is one
            step stale (the update of step k applies the gradient taken at
            the weights of step k-1, as in ZeRO-Offload's delayed parameter
            update). With gradient accumulation, wrap all but the last
            micro-batch in ``with opt.accumulating():`` (otherwise the
            weights change after the first one). Costs a second gradient
            staging buffer in host memory (2 B/param for bf16). Clipping
            works. Before reading the parameters outside training
            (evaluation, saving the model) call ``flush()``, or
            ``attach(model)`` once, which flushes at ``model.state_dict()``
            and at an eval-mode forward without gradients;
            ``state_dict()``, ``load_state_dict()`` and ``close()`` flush
            too. A flush installs the pending weights at once, so the step
            after it reads them and is exact rather than one step stale: a
            run that saves checkpoints takes slightly different steps from
            one that does not (a run resumed from a checkpoint takes the
            same steps as the one that saved it). A saved model and
            optimizer state always belong to the same step.
        async_step: ``step()`` queues the CPU update and returns at once, and
            the next forward waits, module by module, for the new weights of
            the parameters it reads: exact math (no stale gradients, clipping
            by global norm works), with the update hidden behind the next
            forward as far as it keeps ahead of it. The engine updates the
            buckets in forward order (the first layers first). Needs
            ``opt.attach(model)``: forward pre-hooks on the modules owning
            the parameters install their weights; a parameter read outside
            its module's forward (a functional call) must not be, or
            backward raises. Costs a second gradient staging buffer in host
            memory, as ``delay``. Call ``flush()`` before reading the
            parameters outside training.
        delay_correction: with ``delay=True``, after ``delay_warmup``'s
            exact steps (40 by default; the first always is), the next forward runs on weights
            predicted from this step's gradient instead of one-step old ones
            (the host's update writes a prediction without that gradient,
            and the device adds its Adam step as backward hands it over:
            ``csrc/common/delay_correction_math.h``); the host's master and
            moments stay exact Adam. The first step after ``load_state_dict()``
            or ``state_dict()`` is exact too (a checkpoint holds no
            prediction: saving and resumed runs take the same steps); a
            parameter without a gradient in a step keeps its prediction for
            its next one. A flush installs the update's own weights (one
            between backward and ``step()`` makes that step install its own
            at once), and so does a ``zero_grad()`` that drops an unstepped
            backward's gradients. With accumulation on the host, buckets not
            kept by ``device_accumulation`` go up as plain delay's. Costs
            2 B/param more up the link per step, 4 B/param of pinned host
            memory (bf16) and host time; docs/offload_adam.md gives the figures.
        delay_warmup: with ``delay=True``, the number of exact steps taken
            first (each installs its weights before returning), counted from
            the first step or a loaded checkpoint's. Default: 0 for plain
            delay (no warm-up short of the run closed its gap on a small Llama),
            ``CORRECTION_WARMUP`` (40) with ``delay_correction``, whose
            predictions miss most in a run's first steps (docs/offload_adam.md: figures of
            bench/bench_delay_warmup.py and ``effmem demo``).
        state_bits: 32 (float32 moments) or 8 (8-bit moments with a float32 scale per 256
            elements, as FusedAdam's: about 6 bytes per parameter on the host with the fp32 master,
            instead of 12; the same bits as FusedAdam(state_bits=8) fed the same gradients).
        device_accumulation: bytes of device memory that gradients may keep during gradient
            accumulation (default 0). Inside ``accumulating()``, whole buckets (in backward order)
            whose gradients fit in this budget leave them in ``p.grad``, where autograd sums the
            micro-batches on the device, and hand the sum over once, in the backward outside
            ``accumulating()`` (or at ``step()``): 2 B/param cross the link per step instead of 2 per
            micro-batch. The host would add the same gradients in the same order and dtype: bit-identical.
        device_state: bytes of device memory (default 0) for the optimizer state of the first parameters
            (the optimizer's order: for ``model.parameters()``, the embedding and the first blocks, which the
            next forward reads first): their fp32 master and moments stay on the device, their gradients
            stay in ``p.grad``, and FusedAdam's kernel steps them there in ``step()``; the engine offloads
            the rest. A parameter costs 4 (master, for bf16/fp16) + 8 (float32 moments; about 2 with
            ``state_bits=8``) + its gradient's bytes per element; the longest prefix that fits is kept.
            Exact (the same bits as one FusedAdam over every parameter; with clipping, given the same clip
            factor: the norm is summed on the device and on the host, and can differ in its last bit) and shorter
            host updates: with ``async_step`` the forward no longer waits for the host to update the
            layers it reads first. ``counters()`` reports what was kept. Not with ``delay`` (its stale
            gradients would apply to part of the model only), FSDP2 parameters, ``attach_ddp`` or
            ``add_param_group``.
        stream_grads: copy gradients off during backward (hooks). False
            takes them from ``p.grad`` at ``step()`` instead. Default: True,
            except under torch.distributed with more than one rank, where
            DDP reads ``p.grad`` after the hooks would have taken it (FSDP2's
            sharded gradients arrive in ``p.grad`` either way).
        bucket_size: parameters (elements) per bucket, the unit of host memory and of overlapped work.
        num_threads: CPU threads for the update (default ``torch.get_num_threads()``).
        pin_state: page-lock the master weights and moments too. Default
            False: only what crosses the bus must be page-locked (the staging,
            and the master of fp32 parameters, whose weights go up from it,
            are either way); the rest is read by the CPU alone, as fast from
            pageable memory, and locking it would take that memory from the
            operating system (108 GB of a 128 GB host for a 7B model with
            async_step).
        backend: "cuda" (parameters on a GPU) or "host" (CPU parameters;
            copies by a thread: the whole pipeline without a GPU). Chosen
            from the parameters' device when None.

    ``state_dict()`` has torch.optim's layout plus ``master`` for bf16/fp16
    parameters, exactly FusedAdam's: checkpoints of either load into the
    other. For FSDP2's DTensor parameters the state tensors are DTensors of
    the same mesh and placements around this rank's host shards. Only the
    caller's current CUDA stream is ordered after the weight uploads; code
    that reads the parameters on another stream must wait on it.
    ``close()`` (or ``with OffloadAdam(...) as opt:``) frees the engine and
    the host state; tensors already taken from ``state_dict()`` stay valid.
    The engine updates the memory each parameter had when the optimizer was
    built: giving a parameter new memory later (``p.data = ...``,
    ``model.half()``, ``model.to(...)``) makes the next backward (or a
    ``step()`` without one) raise; build the optimizer after such changes.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: Union[float, Tensor] = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = True,
        bias_correction: bool = True,
        overlap: bool = False,
        delay: bool = False,
        async_step: bool = False,
        stream_grads: Optional[bool] = None,
        bucket_size: int = 1 << 23,
        num_threads: Optional[int] = None,
        pin_state: bool = False,
        backend: Optional[str] = None,
        delay_warmup: Optional[int] = None,
        delay_correction: bool = False,
        device_accumulation: int = 0,
        state_bits: int = 32,
        device_state: int = 0,
        _host_delay_us: float = 0.0,
    ):
        _validate.offload_modes(overlap=overlap, delay=delay, async_step=async_step, pin_state=pin_state,
                                delay_correction=delay_correction, stream_grads=stream_grads)
        bucket_size = _validate.whole(bucket_size, "bucket_size", 1, "elements")
        num_threads = _validate.whole(torch.get_num_threads() if num_threads is None else num_threads,
                                      "num_threads", 1)
        if num_threads > 1024:   # the engine starts them: 100000 failed as "Resource temporarily unavailable"
            raise ValueError(f"num_threads: expected an int in [1, 1024] (threads the engine starts), got "
                             f"{num_threads}")
        self._engine = None
        self.state_bits = _validate.state_bits(state_bits)
        self._config = dict(backend=backend, num_threads=num_threads, pin_state=pin_state, bucket_size=bucket_size,
                            host_delay_us=_host_delay_us, state_bits=self.state_bits)
        self._overlap = bool(overlap)
        # async_step runs on delay mode's machinery (double staging, weights installed later), installing
        # in the forward (attach()) instead of the next backward.
        self._async = bool(async_step)
        self._delay = bool(delay) or self._async
        self._forward_hooks = []
        self._attached = None  # the model given to attach() (weakly), re-attached by add_param_group
        if delay_warmup is None:
            delay_warmup = CORRECTION_WARMUP if delay_correction is True else DELAY_WARMUP
        self._delay_warmup = _validate.whole(delay_warmup, "delay_warmup", 0, "steps")
        self._delay_correction = delay_correction
        self._device_accumulation = _validate.whole(device_accumulation, "device_accumulation", 0, "bytes")
        self._device_state = _validate.whole(device_state, "device_state", 0, "bytes")
        if self._device_state and self._delay and not self._async:
            raise ValueError("device_state: not with delay=True, whose stale gradients would apply to the "
                             "offloaded parameters only; use async_step=True (exact) or device_state=0")
        self._resident, self._resident_opt, self._first, self._accumulating = [], None, 0, False
        self._step_count = 0  # steps taken (restored by load_state_dict): the warm-up's clock
        # delay_correction: the next step installs its weights at once (the first, and the first after a load:
        # their forwards have no update to predict from)
        self._exact_next = True
        self._hooks, self._ddp_handles, self._lock = [], [], threading.Lock()
        self._ddp_error: Optional[BaseException] = None
        self._streamed = set()  # params whose gradient a DDP comm hook handed over in this round
        self._autograd_grads = set()  # async_step: params autograd gave a gradient this round (GradHook marks)
        self._clip_held = {}  # stream_grads=False: index -> (p.grad the clip sent and left, its norm then)
        self._queued = set()  # params whose gradient the engine got since the last step (their state entries)
        # the clip's factor, and (norm, [max_norm]) for _scaled_clip
        self._in_backward, self._clip_scale, self._clip_norms = False, 1.0, None
        self._torch_clipped = self._clip_outdated = False   # torch's clip, then a gradient: _check_clip_order
        # backward graph tasks under way (nested ones too), until their end: (thread, depth, accumulating) at open
        self._open_tasks: Dict[int, Tuple[int, int, bool]] = {}
        self._raised_tasks: set = set()   # graph tasks freed without reaching their end (_track_backward)
        self._updates_at_open = 0
        self._broken: Optional[str] = None  # why steps are refused (overlap: a backward failed midway)
        self._plain_backwards, self._warned_mixed = 0, False   # delay: backwards since step() outside accumulating()
        self._warned_unstepped = False   # overlap: zero_grad() after a backward that updated, with no step()
        self._warned_norm = False        # overlap: clip_grad_norm_(inf) has no norm to give (_unknown_norm)
        self._warned_host = False        # delay_correction: buckets accumulated on the host (_warn_host_accumulation)
        self._stale_next = self._round_stale = False   # delay: gradients taken at stale weights (_mid_step_save)
        self._state_seen: dict = {}   # opt.state's entries as the optimizer left them (_check_state)
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay, bias_correction)
        self._stream_asked = stream_grads
        self._stream_grads = _dist.stream_grads_choice(stream_grads)
        self._pid = os.getpid()   # the process whose engine threads these are (a fork has none)
        self._build()
        # indices whose fp32 master is still to be read from the parameter, at the first use (so that
        # weights loaded into the model after the optimizer, or after its checkpoint, are the ones trained)
        self._masters_pending = set(range(len(self._params)))
        self._masters_check = set()   # indices whose master a load set, checked at the first use (_init_masters)

    # ------------------------------------------------------------------ gradients

    def _begin_backward(self) -> None:
        """Once per backward: masters, (overlap) the hyper-parameters the updates will use, and accelerate's clip
        routed (a Trainer made after import effmem). Locked: DDP's comm-hook callbacks may come on several threads."""
        if self._in_backward:
            return
        with self._lock:
            if self._in_backward:
                return
            self._check_open()
            self._check_consistent()
            self._check_params()
            self._init_masters()
            if self._overlap:
                self._sync_groups()
            self._round_stale = self._stale_next
            _clip_route.install_accelerate()
            self._in_backward = True

    def attach_ddp(self, ddp_module: torch.nn.Module) -> None:
        """Under DDP, hand each bucket's gradients to the engine as soon as its all-reduce completes.

        Registers a DDP communication hook (the default mean all-reduce, then the
        hand-over) and a forward pre-hook on ``ddp_module``. Without it, DDP's
        averaged gradients are taken at ``step()``. DDP keeps its own gradient
        buckets on the device either way; what this adds is that the copies and
        the host's work start during backward. Gradient accumulation works with
        or without ``ddp_module.no_sync()``, provided every backward follows a
        forward through ``ddp_module`` itself (its pre-hook orders the next
        backward's writes into DDP's buckets after the copies still reading
        them). Not with ``find_unused_parameters`` or ``static_graph``.
        Non-contiguous parameters are taken at ``step()``.
        """
        self._check_open()
        _dist.attach_ddp(self, ddp_module)

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward calls inside only accumulate gradients (needed with overlap=True for all but
        the last micro-batch; harmless otherwise). Nested blocks stay accumulating until the outermost
        one ends (an inner one ending turned it off: overlap updated early, delay installed early)."""
        self._check_open()
        self._warn_host_accumulation()
        outer = self._accumulating
        self._engine.set_accumulating(True)
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = outer
            self._engine.set_accumulating(outer)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Global L2 norm of the pending gradients, from the host copies; the clip factor
        ``min(1, max_norm / (norm + 1e-6))`` is applied inside the next ``step()``.

        With stream_grads=False they stay in p.grad until step(), which refuses them changed since (GradScaler's
        unscale_ after the clip). Returns the norm as a float32 CPU tensor. Under FSDP2 the
        sums of squares of sharded parameters are all-reduced over the mesh dimensions they are sharded on (not
        over replicas, as in HSDP), so every rank clips by the global norm.
        """
        _validate.max_norm(max_norm)
        self._check_open()
        if self._overlap:
            if float(max_norm) == math.inf:   # (a tensor's read: this call refuses or returns NaN anyway)
                return self._unknown_norm()
            raise RuntimeError("OffloadAdam(overlap=True) updates each bucket during backward, before every "
                               "gradient exists, so it cannot clip by the global norm; use overlap=False")
        self._take_leftover_grads(keep=not self._grads_leave_in_backward())
        sq = _dist.global_sq_sum(self._params, self._engine.grad_sq_sums()) + self._resident_sq_sum()
        total = torch.tensor(math.sqrt(sq), dtype=torch.float32)
        # FusedAdam's float32 arithmetic (a tensor max_norm read here: the host waits for the gradients anyway)
        self._clip_scale = float(clip_coefficient(total, float(max_norm)))
        self._clip_norms = (total, [float(max_norm)])
        return total

    # ------------------------------------------------------------------ step

    # torch.amp.GradScaler: _step_supports_amp_scaling and _refuse_grad_scaler (_offload_guards.OffloadGuards)

    # torch.compile(opt.step): the engine's step is host work; compiled, dynamo did not replay the bookkeeping
    # of opt.state (_note_state) and the second call refused a state the user never touched
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        """Updates every parameter with a pending gradient; returns the closure's loss, if any."""
        # GradScaler's attributes: found_inf too, which is all it sets after unscale_ (accelerate wraps step(),
        # and with fp16 the HF Trainer unscales to clip), where a check of grad_scale alone let inf steps through
        inv_scale = self._take_grad_scaler()
        if inv_scale is False:   # found_inf: skipped
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        if self._async and not self._forward_hooks:
            raise RuntimeError("OffloadAdam(async_step=True): the forward installs each module's new weights; "
                               "call opt.attach(model) once before the first step")
        self._check_consistent()
        self._check_params()
        self._check_state()
        if not self._queued and all(p.grad is None for p in self._all_params):
            # No gradient since the last step: nothing to update, as torch's optimizers skip a parameter without
            # one; not counted either (delay_warmup's clock), nor are delay's weights installed (its flush)
            self._clip_scale, self._clip_norms = 1.0, None
            return loss
        self._init_masters()
        self._take_leftover_grads()
        self._sync_groups()
        scale, self._clip_scale, self._clip_norms = self._scaled_clip(inv_scale), 1.0, None
        # device_state's parameters first: their kernel runs on the device while the host updates the rest
        self._step_resident(scale)
        # delay_correction: a flush since backward replaced the prediction, so this step's weights go up at
        # once; no prediction for a warm-up step's backward (its synchronize supersedes it)
        replaced = self._delay_correction and self._engine.prediction_replaced()
        try:
            self._engine.step(scale, predict=self._step_count + 2 > self._delay_warmup)
        except Exception:
            raise   # refused, or a worker failed: no step taken
        except BaseException:
            # Ctrl-C: the engine runs without the GIL and checks no signals, so a KeyboardInterrupt lands as its
            # call returns, the step taken; skipping the bookkeeping left the next backward on the old settings
            self._step_taken(replaced)
            raise
        self._step_taken(replaced)
        return loss

    def _step_taken(self, replaced: bool) -> None:
        """step()'s bookkeeping once the engine took the step. replaced: a flush replaced the prediction."""
        try:
            # the engine writes their memory: a graph that saved one before now refuses a backward, as torch's
            torch.autograd.graph.increment_version([self._local[i] for i in self._queued])
            self._sync_state(self._queued)
        finally:   # the step is taken: counted (delay's warm-up clock) whatever interrupts its bookkeeping
            # the plain stores first: a signal lands as a call returns (clear()), not between these
            self._step_count += 1
            exact, self._exact_next = (self._exact_next or replaced) and self._delay_correction, False
            self._end_round()
        if self._delay and not self._async and (self._step_count <= self._delay_warmup or exact):
            # warm-up: install the new weights now, so the next step's gradients are exact
            self._synchronize()
        else:
            self._stale_next = self._delay and not self._async   # (a flush before the next backward clears it)
        update_queued(self)   # opt.state's next use waits for the update (async_step, delay)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the pending gradients held by the engine (and in p.grad, where model.zero_grad() looks;
        device_state's dropped, not zeroed, as the engine drops the others': _drop_resident_grads)."""
        super().zero_grad(set_to_none=set_to_none)
        self._drop_resident_grads()
        self._drop_pending()   # (the engine's half: _offload_build)

    # ------------------------------------------------------------------ checkpoints
    # state_dict() and load_state_dict(): _offload_checkpoint.OffloadCheckpoint; attach(): _offload_forward
    # counters(), close(), the context manager: _offload_lifetime.OffloadLifetime
