"""OffloadAdam's engine and its layout (a mixin of OffloadAdam): built over every parameter of every group,
built again over all of them when a group is added (the state carried over exactly), the state views torch's
optimizer API hands out, the fp32 masters read from the parameters at their first use, and what the engine takes
from the optimizer: the gradients the hooks hand over, and at a step the groups' hyper-parameters and gradients
left in p.grad."""
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional

import torch
from torch import Tensor

from effmem.optim import _offload_distributed as _dist
from effmem.optim import _adam8, _validate
from effmem.optim._adam_entries import take_masters_off_params
from effmem.optim._offload_layout import GradHook, build_engine, engine_device, keep_on_device
from effmem.optim._offload_lifetime import claim
from effmem.optim._offload_resident import step_state_bytes
from effmem.optim._offload_state import own_state

_local = _validate.local_tensor


class OffloadBuild:
    def _build(self) -> None:
        """Lays the engine out over every parameter of every group (less device_state's prefix, which a
        FusedAdam steps on the device: _offload_resident), and hooks the parameters."""
        self._all_params: List[Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._params: List[Tensor] = self._split_resident(self._all_params)
        self._first = len(self._all_params) - len(self._params)  # engine index i is the optimizer's i + _first
        self._index: Dict[Tensor, int] = {p: i for i, p in enumerate(self._params)}
        self._local = [_local(p) for p in self._params]
        self._engine = build_engine(self, **self._config)
        self._steps = self._engine.steps()
        self._keep_on_device = keep_on_device(self, self._device_accumulation)
        self._views = [self._engine.state(i) for i in range(len(self._params))]
        if self._delay:   # (async_step's too)
            own_state(self)
        self.state.clear()
        self._sync_state()
        claim(self, self._params)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._hooked = set()   # async_step: whose gradients autograd's are told from (_install_unread)
        if self._stream_grads or self._async:   # async_step's hooks mark, where they do not stream (GradHook)
            ref = weakref.ref(self)
            for i, p in enumerate(self._params):
                if p.requires_grad:   # (torch takes no hook on a frozen one; unfrozen later, it has none)
                    self._hooks.append(p.register_post_accumulate_grad_hook(GradHook(ref)))
                    self._hooked.add(i)
        _warn_frozen(self)

    @torch.no_grad()
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a group; after construction the engine is laid out again over all parameters
        (its host buffers are sized once), carrying every existing parameter's state over
        exactly. State tensors handed out before stay valid but no longer follow training."""
        if self._engine is None:  # during __init__
            super().add_param_group(param_group)
            return
        self._check_open()
        if self._resident_opt is not None:
            raise RuntimeError("OffloadAdam.add_param_group: with device_state, which parameters keep their state on "
                               "the device was chosen over the groups given at construction; build the optimizer "
                               "with every param group")
        if self._in_backward:
            raise RuntimeError("OffloadAdam.add_param_group: the engine holds gradients of a backward not yet "
                               "stepped; add param groups after step() or zero_grad()")
        self._synchronize()
        saved = [tuple(v.clone() for v in views) for views in self._views]
        steps = self._steps.clone()
        super().add_param_group(param_group)  # checks the new group; a refused one changes nothing
        try:   # what the new engine would refuse, before the old one goes
            engine_device([_local(p) for g in self.param_groups for p in g["params"]], self._config["backend"])
        except ValueError:
            self.param_groups.pop()
            raise
        self._engine.close()
        try:
            self._build()
        except BaseException:   # (host memory ran out): the optimizer as it was, on an engine of its own again
            self.param_groups.pop()
            self._build()
            self._restore(saved, steps)
            self._sync_state()
            raise
        self._restore(saved, steps)
        self._sync_state()
        self._masters_pending.update(range(len(saved), len(self._params)))
        self._exact_next = True   # delay_correction: the new engine holds no prediction to run the next forward on
        self._reattach()  # async_step after attach(): the new parameters' modules need installers too

    def _restore(self, saved, steps: Tensor) -> None:
        """The state of the first len(saved) parameters, as taken before the engine was built again."""
        for views, before in zip(self._views, saved):
            for dst, src in zip(views, before):
                dst.copy_(src)
        self._steps[:len(saved)] = steps

    def _sync_state(self, indices: Optional[Iterable[int]] = None) -> None:
        """opt.state as torch's optimizers keep it: an entry (views of the engine's memory) for each
        parameter stepped at least once, none for the others. torch.distributed.checkpoint depends on it:
        for an optimizer with no state it runs a step at lr 0 to make the entries it then loads into; a
        fresh OffloadAdam that showed entries for every parameter (and left the unstepped ones out of
        state_dict(), as torch does) got none loaded, without a word. indices: the parameters a step() was
        given gradients of (their entries exist at once, whether or not the engine has run the update yet:
        async_step, delay); None: those the engine has stepped. An empty entry (a read of opt.state[p] on
        torch's defaultdict before the first step) counts as none."""
        if indices is None:
            indices = [i for i, stepped in enumerate((self._steps > 0).tolist()) if stepped]
        try:
            for i in indices:
                if not self.state.get(self._params[i]):
                    self.state[self._params[i]] = self._state_of(i)
        finally:   # also after a KeyboardInterrupt among the entries: else _check_state took the optimizer's
            self._note_state()   # own entries for the caller's and refused every later step and state_dict()

    def _state_of(self, i: int) -> Dict[str, Tensor]:
        p = self._params[i]
        master, exp_avg, exp_avg_sq = (_dist.like_param(v, p) for v in self._views[i][:3])
        state = dict(zip(("step",) + _adam8.MOMENT_KEYS[self.state_bits], (self._steps[i], exp_avg, exp_avg_sq)))
        if self.state_bits == 8:  # the block scales of this rank's shard, as the engine holds them
            state["exp_avg_scale"], state["exp_avg_sq_scale"] = self._views[i][3:]
        if p.dtype != torch.float32:
            state["master"] = master
        return state

    @torch.no_grad()
    def _init_masters(self) -> None:
        """Masters from the parameters, at the first use rather than at construction (or at
        load_state_dict, for a checkpoint without them), so that weights loaded into the model
        afterwards are the ones trained."""
        for i in sorted(self._masters_pending):
            self._views[i][0].copy_(self._local[i])
        self._masters_pending.clear()
        if self._masters_check:   # a load's masters of bf16/fp16 parameters (take_masters_off_params says why)
            ids, self._masters_check = sorted(self._masters_check), set()
            take_masters_off_params("OffloadAdam", [(self._views[i][0], self._local[i]) for i in ids],
                                    [i + self._first for i in ids])

    def _sync_groups(self) -> None:
        _validate.groups(self.param_groups, state_bits=self.state_bits)  # all of them before the engine takes any
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            self._engine.set_group(gi, lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                                   weight_decay=float(group["weight_decay"]),
                                   decoupled=bool(group["decoupled_weight_decay"]),
                                   bias_correction=bool(group["bias_correction"]))

    @torch.no_grad()
    def _hand_off(self, p: Tensor) -> None:
        i = self._index[p]
        g = p.grad
        if _validate.is_dtensor(g) and g.placements != p.placements:
            g = g.redistribute(p.device_mesh, p.placements)  # e.g. a Partial gradient: reduce it first
        self._taking = None
        try:
            self._send(i, _local(g))
        except Exception:
            raise   # refused: the gradient stays in p.grad
        except BaseException:   # Ctrl-C as the engine's call returned (see _send): the engine holds it
            if self._taking == i:
                p.grad = None   # else the next clip or step() hands it over again, counted twice
            raise
        p.grad = None

    def _send(self, i: int, g: Tensor) -> None:
        """Hands this rank's gradient of param i to the engine, in the param's layout and dtype."""
        local_p = self._local[i]
        self._clip_outdated |= self._torch_clipped   # (DDP's comm hook sends here too, not through _hand_off)
        g = _validate.grad_like(local_p, g)
        if g.dtype != local_p.dtype:   # set by hand (grad_dtype=None), or autograd's under a grad_dtype
            if local_p.dtype != torch.float32:   # rounded: FusedAdam steps a float32 one as it is (float16: inf)
                how = ("has grad_dtype" if getattr(self._params[i], "grad_dtype", None) is not None
                       else "got a gradient of dtype")
                raise ValueError(
                    f"OffloadAdam: parameter {i} (shape {tuple(local_p.shape)}) {how} {g.dtype}, not its own "
                    f"{local_p.dtype}: the engine takes gradients in the parameter's dtype and sums micro-batches "
                    "there, so the gradient would be rounded (to inf in float16 past 65504). Leave grad_dtype "
                    "unset, cast the gradient to the parameter's dtype, or use FusedAdam, which steps it as it is")
            g = g.to(local_p.dtype)  # into a float32 staging: exact
        if self._overlap or self._delay:
            # first: a backward after one that raised (the loop never reached zero_grad) is judged before its
            # gradients land, where the engine refused a parameter the failed one had queued (a message naming
            # micro-batches and no way out)
            self._track_backward()
        # Counted first: in delay mode grad_ready waits, without the GIL, for the previous update, and a Ctrl-C
        # meanwhile lands as it returns, the gradient taken (_taking tells _hand_off so; _queued may hold i from
        # an earlier micro-batch, which says nothing of this one)
        queued = i in self._queued
        self._queued.add(i)
        self._taking = i
        try:
            self._engine.grad_ready(i, g)
        except Exception as e:
            self._taking = None
            if not queued:
                self._queued.discard(i)   # refused: not taken
            model = self._attached() if self._attached is not None else None
            if model is not None and "never installed" in str(e):   # the engine knows indices, the model names
                name = next((n for n, q in model.named_parameters(remove_duplicate=False) if q is self._params[i]),
                            None)
                if name is not None:
                    raise type(e)(f"{e} (parameter {i} is the model's {name})") from None
            raise

    def _take_leftover_grads(self, keep: bool = False) -> None:
        """Gradients that reached p.grad without the hooks (FSDP2, stream_grads=False, set by hand). keep
        (clip_grad_norm_ of gradients that wait for step()): they stay in p.grad too, as torch's clip leaves
        them, where torch.amp.GradScaler unscales and checks them; step() drops them there (_drop_clip_held)."""
        held = self._clip_held
        if held and all(self._params[i].grad is not g for i, (g, _) in held.items()):
            # Every gradient a clip sent was replaced: the step it was for never came (GradScaler skipped it on
            # an inf, or the loop did) and model.zero_grad() dropped them from p.grad, not from the engine,
            # which would have summed them into this step's (or refused this step as changed since the clip)
            self._drop_pending()
        if not keep:
            self._drop_clip_held()
        elif held and self._changed_since_clip(held):
            # A clip again after another backward summed into p.grad (a norm logged per micro-batch, a step
            # not taken): the engine's copies are short of it, and the norm was theirs. p.grad holds the
            # whole of what the engine holds (nothing else reached it): dropped there and sent again below
            # (the round's other bookkeeping, autograd's marks among it, stays).
            if not self._queued <= set(held):
                self._drop_clip_held()   # refuses, naming the change
            self._engine.zero_grad()
            self._clip_held.clear()
            self._queued.clear()
        taken = []
        if self._async:
            self._install_unread()
        for i, p in enumerate(self._params):
            if p.grad is None or i in self._clip_held:
                continue
            if i in self._streamed:  # DDP's copy of what its comm hook already handed over
                p.grad = None
                continue
            g = p.grad
            self._begin_backward()
            self._hand_off(p)
            if keep:
                p.grad = g
                taken.append(i)
        if taken:
            grads = [self._params[i].grad for i in taken]
            self._clip_held.update(zip(taken, zip(grads, torch._foreach_norm([_local(g) for g in grads]))))
        self._check_clip_order()   # at a clip and at step(), with every gradient in

    def _install_unread(self) -> None:
        """async_step: the new weights of parameters whose gradient autograd did not make, before it is taken.
        A module that did not run (installing nothing) may still have one: DDP(find_unused_parameters=True)
        averages other ranks' gradients into it (an expert or branch this rank's batch skipped), or one set by
        hand. Its weights were not read, so the gradient is exact. One autograd made for pending weights (a read
        outside the module's forward) is refused by the engine: it was computed from the old weights. So is any
        gradient of a parameter without a hook to tell (frozen when the optimizer was built)."""
        unread = [i for i, p in enumerate(self._params) if p.grad is not None and i in self._hooked
                  and i not in self._autograd_grads and i not in self._streamed]
        if unread:
            self._engine.install_for_forward(unread)

    def _drop_pending(self) -> None:
        """The engine's pending gradients and this round's bookkeeping, dropped (zero_grad, without p.grad)."""
        self._check_open()
        # The engine first: delay_correction's predictions from the dropped gradients give way to the update's
        # own weights and are made again at the next backward. After a backward that raised, the synchronize
        # in _note_unfinished_backward installed them unpredictable, and that step ran a step stale.
        self._engine.zero_grad()
        self._note_unfinished_backward()  # a failed overlap backward stays refused at step()
        if self._resident_opt is not None:   # a clip factor not used goes with the gradients it came from
            self._resident_opt._pending_grad_scale = {}
        if self._overlap:   # buckets updated during backward (the engine has waited for them): their entries
            self._sync_state()
            self._note_unstepped_update()
        self._clip_scale, self._clip_norms = 1.0, None
        self._clip_held.clear()
        self._end_round()

    def _holds_gradients(self) -> bool:
        """Gradients handed over since the last step (taken off p.grad): torch.distributed.checkpoint asks
        (_dcp_route)."""
        return bool(self._queued)

    def _end_round(self) -> None:
        """The bookkeeping of a round of gradients handed over, started afresh: a step taken, its gradients
        dropped, a failed backward's accepted."""
        self._in_backward = self._round_stale = False
        self._torch_clipped = self._clip_outdated = False
        self._resident_seen = []   # (the gradients it held, not to be kept alive past the round)
        self._plain_backwards = 0
        self._queued.clear()
        self._streamed.clear()
        self._autograd_grads.clear()

    def _changed_since_clip(self, held) -> List[int]:
        """The parameters whose p.grad is not what the clip sent: replaced, or changed in place (their norms,
        taken again by the same kernel, tell; one host sync for all)."""
        now = {i: self._params[i].grad for i in held}
        changed = [i for i in held if now[i] is not held[i][0]]
        same = [i for i in held if now[i] is held[i][0]]
        if same:
            was = torch.stack([held[i][1] for i in same])
            norms = torch.stack(torch._foreach_norm([_local(now[i]) for i in same]))
            kept = (norms == was) | (norms.isnan() & was.isnan())
            if not bool(kept.all()):
                changed += [i for i, k in zip(same, kept.tolist()) if not k]
        return changed

    def _drop_clip_held(self) -> None:
        """The gradients clip_grad_norm_ sent and left in p.grad, dropped there, once checked unchanged: the
        engine holds what it was sent. GradScaler's unscale_ after the clip changed them in place (so would
        another backward): stepped, the engine's copies were still scaled, an inf among them reaching the
        weights. Their norms, taken again by the same kernel, tell."""
        held, self._clip_held = self._clip_held, {}
        if not held:
            return
        changed = self._changed_since_clip(held)
        if changed:
            self.zero_grad()
            raise RuntimeError(
                f"OffloadAdam: the gradient of parameter {changed[0]} changed in p.grad after opt.clip_grad_norm_() "
                "had sent it to the host (torch.amp.GradScaler's unscale_ does this when it comes after the clip, "
                "and so does scaler.step(opt) without an unscale_ before the clip; so does another backward). Call "
                "scaler.unscale_(opt) before opt.clip_grad_norm_(), as torch's AMP recipe has it, and clip after "
                "the last micro-batch. This step's gradients were dropped.")
        for i in held:
            self._params[i].grad = None


def _warn_frozen(opt) -> None:
    """Once per optimizer: the engine keeps host state for frozen parameters too (laid out once, for every
    parameter, so that one unfrozen later trains): per element an fp32 master, the moments and a staging copy
    (two with delay), 14 B for bf16, so a LoRA fine-tune of a 7B model given model.parameters() took about 100 GB
    of host memory for its few million trained weights (a reviewer's run). Under 16 MiB (a frozen position table):
    not worth a word."""
    if getattr(opt, "_warned_frozen", False):
        return
    frozen = [p for p in opt._params if not p.requires_grad]
    # device_state's count of a step's state, on the host: the staging copy (two with delay) holds the gradient
    held = sum(step_state_bytes(p.numel(), 4, p.element_size() * (2 if opt._delay else 1), opt.state_bits)
               for p in frozen)
    if held < 16 * 2 ** 20:
        return
    opt._warned_frozen = True
    n, total = sum(p.numel() for p in frozen), sum(p.numel() for p in opt._params)
    warnings.warn(f"OffloadAdam: {len(frozen)} of the parameters given ({n:,} of {total:,} elements) are frozen "
                  f"(requires_grad=False); the engine keeps an fp32 master, Adam's moments and a staging buffer for "
                  f"them as for the others (at least {held / 2 ** 20:,.0f} MiB of host memory), so that one unfrozen "
                  f"later trains. Give it the trained ones alone to save it: "
                  f"OffloadAdam([p for p in model.parameters() if p.requires_grad], ...)", stacklevel=4)
