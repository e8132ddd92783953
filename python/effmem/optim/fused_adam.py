"""FusedAdam: Adam/AdamW with fp32 master weights in one fused kernel."""
import weakref
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import Tensor

from effmem import ops
from effmem.optim import _adam8, _adam_checks, _validate
from effmem.optim._adam_base import AdamBase
from effmem.optim._adam_entries import (_ENTRY_KEYS, _as_kept, _exact_float32_weights, _laid_out_elsewhere, _local,
                                        _match_layout, _restore_state, take_masters_off_params,
                                        warn_zero_moments)
from effmem.optim._refusals import RefusalMonitor, capturing as _capturing
from effmem.optim.clip import _to_device, clip_coefficient, grad_norm

ParamsT = Union[Iterable[Tensor], Iterable[Dict[str, Any]]]


def _same(kept: Tuple, state: Dict[str, Any], keys: Tuple[str, ...]) -> bool:
    """Whether the entry holds the tensors `kept` refers to, and lacks the keys it lacked (None in `kept`; a
    reference whose tensor was freed gives None: that key changed, whatever it holds now). A loop: the
    cheapest way, 0.4 us."""
    for ref, key in zip(kept, keys):
        if ref is None:
            if key in state:
                return False
            continue
        t = ref()
        if t is None or t is not state.get(key):
            return False
    return True


class FusedAdam(AdamBase):
    """Adam / AdamW whose whole update is one fused kernel per device and dtype.

    Parameters may be float32, bfloat16 or float16, mixed in one optimizer, on
    CPU or CUDA. For bf16/fp16 parameters the optimizer keeps an fp32 master
    copy (``state["master"]``); each step reads grad, master, exp_avg and
    exp_avg_sq once and writes master, exp_avg, exp_avg_sq and the parameter
    (master rounded to nearest even), so a bf16 parameter always equals
    ``master.to(torch.bfloat16)``. Adam's moments are float32, or with
    ``state_bits=8`` bytes (see below).

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr: learning rate (float, or a one-element tensor; a CUDA tensor lets a
            step be captured in a CUDA graph and changed without recapture).
        betas: coefficients of the running averages, each in [0, 1).
        eps: added to the denominator; must be > 0.
        weight_decay: decay coefficient, >= 0 (default 0, as apex's and DeepSpeed's FusedAdam; torch's
            AdamW defaults to 0.01).
        decoupled_weight_decay: True for AdamW (``p *= 1 - lr * wd``), False for
            Adam's L2 penalty (``grad += wd * p``).
        bias_correction: divide the moments by ``1 - beta^t``.
        state_bits: 32 (float32 moments) or 8: each moment one byte per
            element plus a float32 scale per block of 256 elements
            (csrc/common/adam8_math.h: square-law codes, stochastic rounding
            seeded per tensor and step), 2.03 bytes per parameter instead of
            8. The fp32 master stays. Checkpoints hold the codes and scales and
            restore bit for bit; a float32-moment checkpoint loads into an
            8-bit optimizer (encoded) and an 8-bit one into a float32 optimizer
            (decoded).

    The step count is kept per parameter as a float32 tensor on the parameter's
    device, and the step runs without any host synchronisation. Gradient
    scaling: ``step(inv_scale=..., found_inf=...)`` multiplies gradients by
    ``inv_scale`` and skips the step on the device when ``found_inf`` is
    nonzero; ``torch.amp.GradScaler.step(opt)`` supplies both automatically.

    An lr tensor is checked (finite, >= 0) when it is given or assigned to a
    param group; one changed in place later is checked on the device: the
    kernel leaves the parameters unchanged for that step (and does not count
    it), and the next ``step()`` raises. A CPU lr tensor is checked at every step (by the kernel under
    ``torch.compile``, where reading it in Python would break the graph). ``load_state_dict`` checks the whole
    checkpoint (shapes, dtypes, step counts, hyper-parameters) before it
    changes anything.
    """

    _step_supports_amp_scaling = True

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
        state_bits: int = 32,
    ):
        self.state_bits = _validate.state_bits(state_bits)
        self._pending_grad_scale: Dict[torch.device, Tensor] = {}
        self._pending_clip: Optional[Tuple[Tensor, float]] = None   # clip_grad_norm_'s norm and max_norm
        self._pending_outside_capture = False
        self._interrupted_load: Optional[str] = None   # why steps are refused (_load_checked)
        self._refusals = RefusalMonitor("FusedAdam")
        self._lr_checked: Dict[int, Tensor] = {}  # per group, the lr tensor whose value was checked
        # per parameter, its dtype, shape and device and weak references to its entry's tensors, last checked
        self._kept: Dict[int, Tuple] = {}
        self._memory_checked: Optional[Tuple] = None   # the stepped parameters' (data_ptr, strides), last checked
        self._masters_loaded: List[Tensor] = []   # parameters whose master a load set, checked at the next step
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay, bias_correction)

    def __getstate__(self) -> Dict[str, Any]:
        """copy.deepcopy, pickle and torch.save(opt): torch keeps defaults, state and param_groups; the
        moments' format, a clip factor not yet used and a failed load's refusal of steps go along too."""
        return {**super().__getstate__(), "state_bits": self.state_bits,
                "_pending_grad_scale": self._pending_grad_scale, "_pending_clip": self._pending_clip,
                "_pending_outside_capture": self._pending_outside_capture,
                "_interrupted_load": self._interrupted_load}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("state_bits", 32)
        self.__dict__.setdefault("_pending_grad_scale", {})
        self.__dict__.setdefault("_pending_clip", None)
        self.__dict__.setdefault("_interrupted_load", None)
        self.__dict__.setdefault("_pending_outside_capture", False)
        # per-process bookkeeping, built afresh for a copy; torch's load_state_dict also calls __setstate__,
        # which must not drop a refusal a step in flight may still report
        self.__dict__.setdefault("_refusals", RefusalMonitor("FusedAdam"))
        self.__dict__.setdefault("_lr_checked", {})
        self.__dict__.setdefault("_kept", {})
        self.__dict__.setdefault("_memory_checked", None)
        self.__dict__.setdefault("_masters_loaded", [])

    def _init_state(self, p: Tensor, compiling: bool) -> Dict[str, Tensor]:
        state = self.state[p]
        # An entry's tensors are checked again only when one of them was replaced: the step's fast path finds
        # them the ones last checked (weak references: a freed tensor's id may come back on a new one). Not
        # under torch.compile (`compiling`), which would guard on the references (a recompile per
        # load_state_dict).
        keys = _ENTRY_KEYS[self.state_bits]
        kept = None if compiling else self._kept.get(id(p))
        # p's dtype, shape and device too: p.data replaced (model.float(), a resize, a move) needs the entry
        # converted or refused naming the parameter, which the kernel's own check did after other groups stepped
        if (state and kept is not None and kept[0] == (p.dtype, p.shape, p.device, p.stride())
                and _same(kept[1], state, keys)):
            return state
        if (not state or (p.dtype != torch.float32 and "master" not in state)) and _capturing():
            raise RuntimeError("FusedAdam.step: a parameter's state (moments, or the fp32 master of a checkpoint "
                               "without one) would be made inside a CUDA graph capture, and every replay would "
                               "make it again (zero moments, a master rounded to the parameter); run one step "
                               "before capturing (torch's warm-up iterations do)")
        m_key, v_key = _adam8.MOMENT_KEYS[self.state_bits]
        if state and not _as_kept(state, p, self.state_bits):
            # an entry assigned as it is (ZeroRedundancyOptimizer's load; torch's loader casts moments to a
            # bf16 parameter's dtype) in the other format, with codes under torch's names, a checkpoint's scales
            # by rows, other dtypes or a Python step: checked and converted as load_state_dict checks and
            # converts a checkpoint's, or refused naming the parameter
            index = self._salts()[id(p)]
            saved, step, _ = _validate.entry(state, p, f"opt.state[p] of parameter {index}")
            restored = _restore_state(saved, p, step, self.state_bits, index)
            state.clear()
            state.update(restored)
            # model.float() in place: the master goes into the parameter, as a checkpoint's load puts it
            _exact_float32_weights([(p, saved, step)])
        if not state:
            # zeros_like keeps p's strides, so all tensors of a param share a layout.
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            moment = torch.float32 if self.state_bits == 32 else torch.uint8
            state[m_key] = torch.zeros_like(p, dtype=moment)
            state[v_key] = torch.zeros_like(p, dtype=moment)
            if self.state_bits == 8:
                n = _adam8.blocks(_local(p).numel())
                state["exp_avg_scale"] = torch.zeros(n, dtype=torch.float32, device=p.device)
                state["exp_avg_sq_scale"] = torch.zeros(n, dtype=torch.float32, device=p.device)
        if p.dtype != torch.float32 and "master" not in state:   # new, or loaded from a checkpoint without one
            state["master"] = p.detach().to(torch.float32, memory_format=torch.preserve_format)
        if _laid_out_elsewhere(state, p, self.state_bits):   # an entry, or p.data, given other strides
            _match_layout(state, p, self.state_bits, self._salts()[id(p)] if self.state_bits == 8 else 0)
        if not compiling:
            self._kept[id(p)] = ((p.dtype, p.shape, p.device, p.stride()),
                                 tuple(weakref.ref(state[k]) if k in state else None for k in keys))
        return state

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Global L2 norm of all gradients; the clip is folded into the next step.

        Returns the total norm of the gradients as they are (a float32 tensor,
        no host sync). The clip factor ``min(1, max_norm / (norm + 1e-6))``
        multiplies the gradients inside the next ``step()`` kernel instead of in
        a separate pass over them, so the gradients themselves are left as they
        are. A step that unscales them (``inv_scale``, or a GradScaler whose
        ``unscale_`` was not called: fp16 gradients it cannot unscale in place)
        clips by the unscaled norm, ``norm * inv_scale``; one after
        ``scaler.unscale_(opt)`` by the norm of the gradients as they are then.
        """
        _validate.max_norm(max_norm)
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = grad_norm(grads)
        coef = clip_coefficient(total, max_norm)
        self._pending_grad_scale = {d: _to_device(coef, d) for d in {g.device for g in grads}}
        self._pending_clip = (total, max_norm)   # for a step that unscales: its factor from the unscaled norm
        self._pending_outside_capture = not _capturing()
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad, and a clip factor from clip_grad_norm_ not yet used is dropped with the
        gradients it was computed from (a loop that skips a step on a spiking norm must not carry it on)."""
        self._pending_grad_scale, self._pending_clip = {}, None
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None, *, inv_scale: Optional[Tensor] = None,
             found_inf: Optional[Tensor] = None):
        """One optimizer step.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            inv_scale: float32 one-element tensor multiplying every gradient (a
                Python number is taken as one); its value is not read on the
                host (no sync), so a negative or NaN one is the caller's (a
                number's is checked). A
                clip from ``clip_grad_norm_`` pending for this step takes its
                factor from the norm times inv_scale (the norm of the gradients
                this step applies).
            found_inf: float32 one-element tensor (or a number); nonzero skips
                the step (and does not advance the step count), decided on the
                device.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.amp.GradScaler sets these attributes around step() for
        # optimizers with _step_supports_amp_scaling (grad_scale is None once
        # the user has unscaled the gradients).
        # GradScaler's unscale_ ran this step (it sets found_inf alone then), perhaps after clip_grad_norm_
        unscaled_by_scaler = (inv_scale is None and getattr(self, "grad_scale", None) is None
                              and getattr(self, "found_inf", None) is not None)
        if inv_scale is None and getattr(self, "grad_scale", None) is not None:
            inv_scale = self.grad_scale.double().reciprocal().float()
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        inv_scale = _adam_checks.one_value(inv_scale, "inv_scale")
        found_inf = _adam_checks.one_value(found_inf, "found_inf")
        if self._pending_grad_scale and self._pending_outside_capture and _capturing():
            raise RuntimeError("FusedAdam.step is being captured in a CUDA graph while a clip from "
                               "clip_grad_norm_() called outside the graph is pending; the graph would keep "
                               "reading that one clip factor. Call opt.clip_grad_norm_() inside the captured "
                               "region, before step().")
        if self._interrupted_load is not None:
            raise RuntimeError(self._interrupted_load)
        self._refusals.check()
        self._check_groups()
        if not torch.compiler.is_compiling() and self._masters_loaded and not _capturing():   # (no guard on it)
            loaded, self._masters_loaded = self._masters_loaded, []
            pairs = [(self.state[p]["master"], p) for p in loaded if "master" in self.state.get(p, ())]
            # (OffloadAdam's device_state prefix: its own name, the indices the same)
            take_masters_off_params(getattr(self, "_owner_name", "FusedAdam"), pairs,
                                    [self._salts()[id(p)] for _, p in pairs])
        # Every group's entries are checked (and an assigned one converted) before any is stepped: a refused
        # step changes nothing, and keeps its pending clip for the step that follows the fix.
        buckets = [self._buckets(group) for group in self.param_groups]
        _adam_checks.cpu_steps(self, buckets)
        # Compiled, torch 2.11's dynamo refuses any assignment to an attribute of the optimizer (2.13 allows it):
        # the memory check is eager only, and the pending clip is taken by mutating what holds it.
        if not torch.compiler.is_compiling():
            self._memory_checked = _adam_checks.memory(buckets, self._memory_checked)
        _adam_checks.kernels(self, buckets)
        pending = taken = dict(self._pending_grad_scale)   # taken: put back by a refused call
        self._pending_grad_scale.clear()
        clip = self._pending_clip
        if clip is not None:
            self._pending_clip = None
        if pending and clip is not None and inv_scale is not None:
            # clipped while scaled: the factor from the norm of the gradients this step applies
            total, max_norm = clip
            pending = {d: clip_coefficient(_to_device(total, d) * _per_device(inv_scale, d), max_norm)
                       for d in pending}
        elif pending and clip is not None and unscaled_by_scaler:
            # scaler.unscale_(opt) after the clip took its norm from the scaled gradients (0.22x the update in a
            # reviewer's run): the norm of the gradients as they are now, the clip's own where unscale_ came first
            total = grad_norm([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None])
            pending = {d: clip_coefficient(_to_device(total, d), clip[1]) for d in pending}
        per_device: Dict[torch.device, Tuple] = {}  # (scale, found_inf) of each device, once per step
        number, first_call = 0, True   # of the group's first parameter; _adam_checks.kernels checked the others
        for group, group_buckets in zip(self.param_groups, buckets):
            lr = group["lr"]
            per_group: Dict[torch.device, Tuple] = {}  # (lr, lr_tensor, advance) of each device
            beta1, beta2 = group["betas"]
            for key, b in group_buckets.items():
                device = key[0]
                if device not in per_device:
                    scale = _per_device(inv_scale, device)
                    if device in pending:
                        scale = pending[device] if scale is None else scale * pending[device]
                    per_device[device] = (scale, _per_device(found_inf, device))
                scale, inf = per_device[device]
                if device not in per_group:
                    per_group[device] = _lr_and_advance(lr, device, inf)
                step_lr, lr_tensor, advance = per_group[device]
                # The tensor-list overload: the one-tensor-scalar overload of _foreach_add_ reads the scalar on
                # the host (a sync per step, seen on an H100).
                advances = 1.0 if advance is None else [advance] * len(b["steps"])
                torch._foreach_add_(b["steps"], advances)
                eight = {} if self.state_bits == 32 else dict(
                    exp_avg_scales=b["exp_avg_scales"], exp_avg_sq_scales=b["exp_avg_sq_scales"], salts=b["salts"])
                try:
                    ops.adam_step_(
                        b["params"], b["grads"], b["exp_avgs"], b["exp_avg_sqs"], b["masters"], b["steps"],
                        lr=0.0 if lr_tensor is not None else step_lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                        bias_correction=group["bias_correction"], lr_tensor=lr_tensor, inv_scale=scale,
                        found_inf=inf, status=self._refusals.status(device), **eight,
                    )
                except (ValueError, TypeError) as err:
                    if not first_call or torch.compiler.is_compiling():
                        raise
                    # refused before it wrote: nothing else moved, and the clip waits for the step after the fix
                    torch._foreach_sub_(b["steps"], advances)
                    self._pending_grad_scale.update(taken)
                    self._pending_clip = clip
                    raise _adam_checks.named(err, number, group, key, self.state_bits) from None
                first_call = False
            number += len(group["params"])
        for device in per_device:
            self._refusals.launched(device)
        return loss

    def _check_groups(self) -> None:
        """Every group's settings, before any is stepped: a refused step changes nothing (no step counts
        advanced, no group updated). An lr held in a CPU tensor is read each step (no sync); one in a
        CUDA tensor when it is given or assigned (one host sync), later changes on the device are the
        kernel's to refuse. Under torch.compile every lr tensor's value is the kernel's to check: reading it
        here would break the compiled graph (a CPU tensor's at every step, a CUDA one's at the first)."""
        _validate.groups(self.param_groups, check_lr=False, state_bits=self.state_bits)
        compiling = torch.compiler.is_compiling()
        if not compiling:
            _validate.listed_once(self.param_groups)
        for gi, group in enumerate(self.param_groups):
            lr = group["lr"]
            if isinstance(lr, Tensor) and compiling:   # the value is the kernel's to check
                _validate.lr_tensor_shape(lr, f"param_groups[{gi}]['lr']")
            elif not (isinstance(lr, Tensor) and lr.is_cuda):
                _validate.lr_value(lr, f"param_groups[{gi}]['lr']")
            elif self._lr_checked.get(gi) is not lr and not _capturing():
                _validate.lr_value(lr, f"param_groups[{gi}]['lr']")
                self._lr_checked[gi] = lr

    def _buckets(self, group: Dict[str, Any]) -> Dict[Tuple, Dict[str, List[Tensor]]]:
        """Params with a gradient, grouped by (device, param dtype, grad dtype): one kernel call each."""
        buckets: Dict[Tuple, Dict[str, List[Tensor]]] = defaultdict(lambda: defaultdict(list))
        salts = self._salts() if self.state_bits == 8 else None
        m_key, v_key = _adam8.MOMENT_KEYS[self.state_bits]
        compiling = torch.compiler.is_compiling()
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = _validate.grad(p)
            state = self._init_state(p, compiling)
            if state[m_key].stride() != p.stride():   # a moment relaid in place (`.data =`): the entry check misses it
                _match_layout(state, p, self.state_bits, salts[id(p)] if salts is not None else 0)
            b = buckets[(p.device, p.dtype, grad.dtype)]
            w, m, v, master = p, state[m_key], state[v_key], state.get("master")
            if _validate.is_dtensor(p):   # FSDP2: this rank's shards (_as_kept: its state is DTensors too)
                w, grad, m, v = _local(p), _local(grad), _local(m), _local(v)
                master = None if master is None else _local(master)
            b["params"].append(w)
            b["grads"].append(grad)
            b["exp_avgs"].append(m)
            b["exp_avg_sqs"].append(v)
            b["steps"].append(state["step"])
            if master is not None:
                b["masters"].append(master)
            if salts is not None:
                b["exp_avg_scales"].append(state["exp_avg_scale"])
                b["exp_avg_sq_scales"].append(state["exp_avg_sq_scale"])
                b["salts"].append(salts[id(p)])
        return buckets

    def _salts(self) -> Dict[int, int]:
        """Each parameter's place in the optimizer: with the step count, the seed of its 8-bit rounding
        (the same after a checkpoint is loaded into an optimizer built over the same parameters)."""
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim's layout plus ``master`` per bf16/fp16 parameter; under FSDP2, 8-bit block scales as
        DTensors (_adam8.scales_for_checkpoint), so that torch.distributed.checkpoint keeps every rank's."""
        def finish(sd):
            sd["state"] = {k: v for k, v in sd["state"].items() if v}   # an empty entry: a read of opt.state[p]
            return _adam8.checkpoint_out(sd, [p for g in self.param_groups for p in g["params"]])
        return self._hooked_state_dict(finish)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state dict from FusedAdam (or torch.optim.Adam/AdamW).

        torch.optim's loader casts floating state to the parameter's dtype,
        which would round fp32 masters and moments of bf16 parameters; here
        they are restored in float32 exactly as saved. A checkpoint without
        float32 masters (torch.optim.AdamW's, or FusedAdam's carried through
        it, which rounds them) takes them from the parameters at their next
        step, so model weights loaded after this are the ones trained on.
        torch's load_state_dict pre- and post-hooks run as for its optimizers.
        """
        self._hooked_load(state_dict, self._load_checked)

    def _load_checked(self, state_dict: Dict[str, Any], warn: bool = True) -> None:
        # everything checked before any change (warn=False: OffloadAdam's device_state prefix, warned of already)
        plan = _validate.checkpoint(self, state_dict, "FusedAdam", warn=warn)
        if warn:
            warn_zero_moments("FusedAdam", plan)
        salts = self._salts()
        self._load_groups(state_dict["param_groups"])   # drops the old state: one state in memory at a time
        self._lr_checked, self._kept = {}, {}
        try:
            for p, saved, step in plan:
                if saved is not None:
                    self.state[p] = _restore_state(saved, p, step, self.state_bits, salts[id(p)])
            _exact_float32_weights(plan)
            # checked against their parameters at the next step (take_masters_off_params says why)
            self._masters_loaded = [p for p, saved, _ in plan
                                    if saved and "master" in saved and p.dtype != torch.float32]
        except BaseException as e:   # out of memory, an interrupt: part of the checkpoint is in, part is not
            self._interrupted_load = (
                f"FusedAdam: a load_state_dict failed while making the state ({type(e).__name__}), after the "
                "checkpoint had been checked: the optimizer holds part of it, and its steps are refused until a "
                "load_state_dict completes")
            raise
        self._interrupted_load = None


def _lr_and_advance(lr, device: torch.device, inf: Optional[Tensor]):
    """A group's lr for the kernels on `device` (a float, or a float32 tensor there) and by how
    much the step counts advance (None: by 1): by 0 on the device for a step the kernel skips,
    for found_inf (GradScaler sums it over devices, so it may exceed 1) or an lr it refuses."""
    if isinstance(lr, Tensor) and lr.device.type == "cpu" and device.type != "cpu" \
            and not torch.compiler.is_compiling():   # compiled, the 4-byte copy is the graph's, a read would break it
        lr = float(lr)  # a host read; copying it to the GPU would block on a pageable copy
    lr_tensor = lr.to(device=device, dtype=torch.float32) if isinstance(lr, Tensor) else None
    advance = None if inf is None else inf == 0
    if lr_tensor is not None and device.type != "cpu":
        lr_ok = torch.isfinite(lr_tensor) & (lr_tensor >= 0)
        advance = lr_ok if advance is None else advance & lr_ok
    return lr, lr_tensor, None if advance is None else advance.to(torch.float32).reshape(())


def _per_device(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    if t is None:
        return None
    return _to_device(t.to(torch.float32), device).reshape(1)

