"""What OffloadAdam refuses to go on with, silently wrong otherwise (a mixin of OffloadAdam).

A backward that raised midway under overlap=True has already updated the buckets it completed;
a parameter given new memory after the optimizer was built would no longer be trained.
"""
import math
import sys
import threading
import warnings
import weakref
from typing import Tuple

import torch

from effmem.optim import _validate
from effmem.optim.clip import clip_coefficient


# The Python frame of every backward() and grad() call (torch 2.3 and later); None: nesting not judged.
_ENGINE_RUN = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__", None)


def _backward_depth() -> int:
    """How many backward() / grad() calls are under way on this thread's Python stack. A reentrant backward
    (torch.utils.checkpoint's, a Function whose backward calls backward) runs inside the node of the
    outer one, on the same thread, one call deeper. CUDA's gradients reach the hooks on autograd's device
    thread (made in C++: a threading._DummyThread to Python), whose stack lacks the outer call's frame: it
    counts as one, so that the outer backward is 1 on every device and a reentrant one inside it 2."""
    n = 1 if isinstance(threading.current_thread(), threading._DummyThread) else 0
    frame = sys._getframe(1)
    while frame is not None and _ENGINE_RUN is not None:
        n += frame.f_code is _ENGINE_RUN
        frame = frame.f_back
    return n


def _nested(where: Tuple[int, int], outer: Tuple[int, int]) -> bool:
    """Whether a graph task opened at `where` (thread, depth) runs inside one opened at `outer`."""
    return _ENGINE_RUN is None or (where[0] == outer[0] and where[1] > outer[1])


class _TaskEnd:
    """Held by a graph task's end-of-backward callback (and only there): freed with the task."""

    def __init__(self):
        self.reached = False


def _fence_unless_reached(state, engine, raised: set, task: int) -> None:
    if state["reached"]:
        return
    raised.add(task)   # freed without reaching its end: it raised
    if not engine.closed:
        try:
            engine.fence()
        except RuntimeError:   # a failed update: the engine raises it at the caller's next call, not here
            pass


class OffloadGuards:
    def _warn_host_accumulation(self) -> None:
        """accumulating() under delay_correction with buckets that device_accumulation does not keep: those go
        up as plain delay's (the device holds only the last micro-batch's gradient), as docs/offload_adam.md says;
        said once, since nothing else shows that the correction is off for them (a reviewer measured plain delay's
        loss with it on)."""
        # cheap tests first (accumulating() runs per micro-batch); stream_grads=False: every gradient adds up in
        # p.grad on the device; frozen parameters have no gradient to lose
        if (not self._delay_correction or self._warned_host or not self._grads_leave_in_backward()
                or len(self._keep_on_device) == len(self._params)):
            return
        host = sum(p.requires_grad and i not in self._keep_on_device for i, p in enumerate(self._params))
        if host:
            self._warned_host = True
            need = sum(t.numel() * t.element_size() for t in self._local)
            warnings.warn(f"OffloadAdam(delay_correction=True): the gradients of {host} of {len(self._params)} "
                          f"parameters accumulate on the host (device_accumulation={self._device_accumulation}) "
                          "and go up as plain delay's, uncorrected: the device holds only the last micro-batch's "
                          f"gradient. device_accumulation={need} keeps them all on the device", stacklevel=4)

    def _track_backward(self) -> None:
        """Overlap and delay mode upload weights during backward (and overlap updates buckets).
        Once per backward (autograd graph task), queue a callback for its end that orders the caller's
        stream after the uploads, so that the next forward (say of the next micro-batch, with no step() in
        between) reads whole weights, and that marks the task as finished: autograd runs it only when the
        task completes, so a task whose callback never ran raised midway.

        A new task while another is open may be nested in it (reentrant checkpointing runs its recompute's
        backward as a graph task of its own, inside the outer one, on the same thread one backward() call
        deeper: _nested), which is fine, or follow one that raised. Taken for a failure, a nested task made
        overlap refuse a backward that had not failed, and delay install weights that the running backward
        still had to read (wrong gradients). Overlap judges a task that is not nested at once; delay leaves
        it to step() and zero_grad(), where no backward runs and the tasks still open are the ones that
        raised (_note_unfinished_backward).
        Outside a backward (DDP's comm hooks) attach_ddp's forward pre-hook fences instead."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task in self._open_tasks:
            return
        where = (threading.get_ident(), _backward_depth())
        if self._overlap and self._open_tasks and not _nested(where, self._open_tasks[max(self._open_tasks)]):
            # overlap: a backward after one that raised, judged at once (its updates counted apart from this
            # one's, and this one refused if they broke the state). Not delay: noting installs the pending
            # weights, which this backward may still have to read.
            self._note_unfinished_backward()
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if not self._open_tasks:
            self._updates_at_open = self._engine.param_updates
            if where[1] <= 1:   # not a reentrant checkpoint's inner backward (one per layer, inside one backward)
                self._note_mixed_micro_batches()
        self._open_tasks[task] = (*where, self._accumulating)
        engine, ref, end = self._engine, weakref.ref(self), _TaskEnd()

        def finished(end=end):
            end.reached = True
            opt = ref()
            if opt is not None:
                opt._open_tasks.pop(task, None)
            if not engine.closed:
                engine.fence()

        # A task that raised drops its callbacks unrun: the finalizer of the object they hold fences instead,
        # or the weights its hooks installed (delay) would still be in flight when the next forward reads them.
        # On the CPU autograd frees the task before backward() raises; on a GPU the device thread may free it a
        # little later, which is why attach(model)'s forward pre-hook fences too (_Flush).
        weakref.finalize(end, _fence_unless_reached, end.__dict__, engine, self._raised_tasks, task)
        torch.autograd.Variable._execution_engine.queue_callback(finished)

    def _note_mixed_micro_batches(self) -> None:
        """delay=True: the first backward after a step outside accumulating() installs the pending weights, so
        a second one before step() ran its forward on newer weights than the first: neither exact nor one step
        stale. Documented, but a loop that cannot mark micro-batches (Hugging Face's Trainer) met it silently."""
        if not self._delay or self._async or self._accumulating:
            return
        self._plain_backwards += 1
        if self._plain_backwards == 2 and self._step_count > self._delay_warmup and not self._warned_mixed:
            self._warned_mixed = True
            warnings.warn("OffloadAdam(delay=True): a second backward before step() outside opt.accumulating(); "
                          "the first installed the pending weights, so this micro-batch ran on newer weights than "
                          "the first. Wrap all but the last micro-batch in `with opt.accumulating():`; where the loop "
                          "cannot (Hugging Face's Trainer with gradient_accumulation_steps > 1), use "
                          "async_step=True (exact, and hides the update behind the forward)", stacklevel=4)

    def _note_unstepped_update(self) -> None:
        """overlap=True, at zero_grad(): a backward since the last step() updated parameters, which zero_grad()
        cannot undo. A GAN's discriminator phase run through the generator stepped the generator's optimizer
        twice per iteration, silently. Not after a backward that raised (step() refuses it, with its reason)."""
        if (self._queued and self._engine.param_updates > self._updates_at_open and self._broken is None
                and not self._warned_unstepped):
            self._warned_unstepped = True
            warnings.warn("OffloadAdam(overlap=True): zero_grad() after a backward that updated parameters, with no "
                          "step() between: overlap updates each bucket during backward, and zero_grad() does not "
                          "undo that. For a model this backward must not train (a GAN's generator in the "
                          "discriminator's phase), detach its output or set requires_grad_(False) on it; to skip "
                          "steps (a NaN loss), use another mode", stacklevel=3)

    def _note_unfinished_backward(self) -> None:
        """Backwards that never reached their end (called where none runs): with overlap=True, buckets they
        completed were already updated with their gradients. The state no longer matches any sequence of
        whole steps, so further steps are refused until the caller chooses (see _check_consistent)."""
        if not self._open_tasks:
            return
        outside = any(not accumulating for _, _, accumulating in self._open_tasks.values())
        self._open_tasks.clear()
        self._raised_tasks.clear()
        if self._overlap or outside:
            # overlap: bucket updates run on the engine's workers: wait for those the failed backward queued,
            # or they would be missed by the count below (seen as a rare flaky test). delay (async_step too):
            # a backward outside accumulating() installs each parameter's weights as its gradient completes, so
            # one that raised is finished as a whole one would have been; inside it, a whole one installs none
            self._synchronize()
        updates = self._engine.param_updates - self._updates_at_open
        if self._overlap and updates > 0:
            self._broken = (
                f"OffloadAdam(overlap=True): a backward raised after {updates} parameter updates had already "
                "been applied during it (overlap updates each bucket as soon as its gradients land), so the "
                "parameters and the optimizer state now hold part of a step. Further steps are refused: restore "
                "the model's weights and opt.load_state_dict(...) from a checkpoint (torch.distributed.checkpoint's "
                "set_optimizer_state_dict reads opt.state_dict() first, refused too: call accept_partial_step() "
                "before it), or call opt.accept_partial_step() to go on from the parameters as they are.")

    def _check_consistent(self) -> None:
        self._note_unfinished_backward()
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def _check_saved_state(self) -> None:
        """state_dict(): refused where step() would be, judging only backwards known to have raised (freed
        without reaching their end): it may be called while one runs (a hook, another thread), which
        _check_consistent would take for a failure and break the optimizer over."""
        if any(t in self._raised_tasks for t in self._open_tasks):
            self._note_unfinished_backward()
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def accept_partial_step(self) -> None:
        """After a backward raised under overlap=True: go on from the parameters and state as they
        are (the buckets it completed keep their update), dropping its other gradients."""
        self._check_open()
        self._broken = None
        self._open_tasks.clear()
        self._raised_tasks.clear()
        self._engine.zero_grad()
        self._sync_state()   # the buckets the failed backward completed were updated
        self._end_round()

    def _note_state(self) -> None:
        """Remember opt.state's entries as the optimizer made them (views of the engine's memory), for
        _check_state: after each change the optimizer makes to them."""
        self._state_seen = {p: (e, tuple(e.items())) for p, e in self.state.items() if e}

    def _check_state(self) -> None:
        """opt.state's tensors are views of the engine's host memory (FusedAdam's inner state for
        device_state's parameters). An entry assigned, replaced, deleted or cleared does not reach the engine
        by itself (the next step went on from the old state, silently): at step() and state_dict() it is
        loaded into it (_adopt_state), as torch's optimizers go on from what opt.state holds."""
        seen = self._state_seen
        changed = [p for p, (e, items) in seen.items()
                   if self.state.get(p) is not e or len(e) != len(items)
                   or any(e.get(k) is not v for k, v in items)]
        changed += [p for p, e in self.state.items() if e and p not in seen]
        if changed:
            self._adopt_state(changed)

    @torch.no_grad()
    def _adopt_state(self, changed) -> None:
        """The changed entries (the others as they are) loaded into the engine as load_state_dict loads a
        checkpoint's, checked first; a deleted or cleared one starts afresh, as in torch. What
        ZeroRedundancyOptimizer's load_state_dict does (it assigns the entries), and a reset by
        opt.state.clear(), then take effect. Not under overlap=True (its backward updates before step()) nor
        for device_state's parameters: refused."""
        index = {p: k for k, p in enumerate(self._all_params)}
        first = index.get(changed[0], "?")
        what = (f"OffloadAdam: opt.state was changed by assignment, del or clear() ({len(changed)} parameter(s), "
                f"the first is parameter {first})")
        foreign = next((p for p in changed if p not in index), None)
        if foreign is not None:
            raise ValueError(f"OffloadAdam: opt.state has an entry for a tensor that is not one of its parameters "
                             f"(shape {tuple(foreign.shape) if isinstance(foreign, torch.Tensor) else foreign!r}); "
                             "state goes by parameter: del that entry")
        if self._overlap or any(p not in self._index for p in changed):
            why = ("overlap=True cannot take: its backward updates the state before step()" if self._overlap else
                   "device_state's parameters cannot take: their state is a FusedAdam's on the device")
            raise RuntimeError(f"{what}, which {why}. Change the tensors in place "
                               "(opt.state[p]['exp_avg'].zero_()), load a state with opt.load_state_dict(...), or "
                               "build a new OffloadAdam to start afresh.")
        self._synchronize()   # an update in flight writes the entries' memory: let it land first
        self._forget_predictions()   # made from the state replaced here
        entries = {}
        for p in changed:
            entry = dict(self.state.get(p) or {})
            if not entry:
                continue
            handed = dict(self._state_seen.get(p, (None, ()))[1])
            if entry.get("master") is not None and entry.get("master") is handed.get("master") \
                    and self._index[p] in self._masters_pending:
                del entry["master"]   # the engine's, never filled: the parameter is read at first use
            entries[index[p]] = entry
        groups = [dict(g, params=[index[p] for p in g["params"]]) for g in self.param_groups]
        try:
            plan = _validate.checkpoint(self, {"state": entries, "param_groups": groups}, "OffloadAdam")
        except (TypeError, ValueError) as err:
            raise type(err)(f"{what}, and what it holds now cannot be loaded into the optimizer's host memory: "
                            f"{err}") from None
        todo = set(changed)
        # cloned before any is copied in: an entry may view another parameter's memory (two entries swapped)
        plan = [(p, None if saved is None else {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                for k, v in saved.items()}, step)
                for p, saved, step in plan if p in todo]
        for p, saved, step in plan:
            self._load_entry(p, saved, step)
        self._note_state()

    def _check_params(self) -> None:
        """The engine updates the memory each parameter had when the optimizer was built. A
        parameter given new memory since (p.data = ..., model.half(), model.to(...)) would no
        longer be trained, silently: refuse. So is one taken out of (or put into) a param group's list
        by hand, which FusedAdam would follow; and a step count written in place into opt.state."""
        listed = [p for g in self.param_groups for p in g["params"]]
        if len(listed) != len(self._all_params) or any(a is not b for a, b in zip(listed, self._all_params)):
            raise RuntimeError(
                f"OffloadAdam: param_groups' 'params' lists hold {len(listed)} tensors where the optimizer was "
                f"built over {len(self._all_params)} (or others): the engine trains the parameters it was given, "
                "so a change made to those lists would be ignored. Use add_param_group() for new parameters, or "
                "build a new optimizer (carrying the state over with state_dict() / load_state_dict()).")
        self._check_steps()
        for i, (p, held) in enumerate(zip(self._params, self._local)):
            t = p._local_tensor if _validate.is_dtensor(p) else p
            if t.data_ptr() == held.data_ptr() and t.dtype == held.dtype and t.shape == held.shape and all(
                    a == b for a, b, n in zip(t.stride(), held.stride(), t.shape) if n > 1):
                continue   # (the strides of dims of size > 1: p.data = p.data.t() of a square one, other elements)
            changes = [f"{what} {a} -> {b}" for what, a, b in (
                ("dtype", held.dtype, t.dtype), ("device", held.device, t.device),
                ("shape", tuple(held.shape), tuple(t.shape)), ("strides", held.stride(), t.stride())) if a != b] \
                or ["its memory"]
            gi = next(k for k, g in enumerate(self.param_groups) if any(q is p for q in g["params"]))
            raise RuntimeError(
                f"OffloadAdam: parameter {i} (param group {gi}, shape {tuple(held.shape)}) was replaced after the "
                f"optimizer was built ({', '.join(changes)}; p.data = ..., model.half() or model.to() do this). The "
                "engine updates the memory it was given, so that parameter would silently stop training. Build "
                "the optimizer after changing the model, carrying its state over with state_dict() / "
                "load_state_dict().")

    def _check_steps(self) -> None:
        """opt.state[p]['step'] is a view of the engine's float32 step count, which the update's bias
        corrections read: one written in place must be a whole number >= 0, as FusedAdam requires of its own
        (a negative or non-finite one made the weights NaN, silently; a fraction stepped as step 1.5)."""
        # One copy, read once: under overlap the worker pool advances these counts while backward's buckets
        # update, and a count read twice (s, then s.floor()) could be 14 once and 15 the next time.
        s = self._steps.clone()
        i = _validate.first_bad_count(s)
        if i is not None:
            raise ValueError(f"OffloadAdam: opt.state[p]['step'] of parameter {i + self._first} holds "
                             f"{float(s[i])!r}; expected a whole number >= 0 (a step count)")

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch.amp.GradScaler's question. Where the gradients wait in p.grad for step() (stream_grads=False,
        no overlap, no attach_ddp), no: its own path is exact, as for torch's AdamW (it unscales them in place,
        checks them and skips step() on an inf). But not for fp16 parameters, whose gradients it refuses to
        unscale in place (for torch's AdamW too): yes, and step() takes its grad_scale and found_inf as
        FusedAdam does (_take_grad_scaler). Where they left during backward that path found none and
        failed with "No inf checks were recorded"; yes makes it call step() with its grad_scale and found_inf
        attributes set, refused there with a reason (_refuse_grad_scaler)."""
        return self._grads_leave_in_backward() or any(p.dtype == torch.float16 for p in self._all_params)

    def _take_grad_scaler(self):
        """GradScaler's attributes at step(): None without them (or after its unscale_), the inverse scale the
        update applies (a float32 tensor), or False for a step that found_inf skips: the gradients a clip had
        sent are dropped from the engine, and p.grad keeps them, as torch's skipped step leaves them."""
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if grad_scale is None and found_inf is None:
            return None
        if self._grads_leave_in_backward():
            self._refuse_grad_scaler()
        if found_inf is not None and float(found_inf) != 0.0:   # the host step waits for the gradients anyway
            self._check_open()
            self._drop_pending()
            return False
        return None if grad_scale is None else grad_scale.double().reciprocal().float().cpu()

    def _scaled_clip(self, inv_scale) -> float:
        """The factor step() applies to the gradients: the clip's, and under GradScaler's inv_scale (gradients
        still scaled) inv_scale times the clip's factor taken from the unscaled norm, in FusedAdam's float32
        arithmetic (its step with inv_scale after clip_grad_norm_)."""
        if inv_scale is None:
            return self._clip_scale
        factor = inv_scale
        if self._clip_norms is not None:
            total, max_norms = self._clip_norms
            total = total * inv_scale
            for max_norm in max_norms:   # torch's clip called again in one step: on the clipped gradients
                coef = clip_coefficient(total, max_norm)
                factor, total = factor * coef, total * coef
        return float(factor)

    def _grads_leave_in_backward(self) -> bool:
        return self._stream_grads or self._overlap or bool(self._ddp_handles)

    def _note_torch_clip(self) -> None:
        """After torch's clip (routed here): if it clipped, gradients from here to step() are refused."""
        if self._clip_scale != 1.0:
            self._torch_clipped = True
            # device_state's gradients stay in p.grad (not sent): a backward after the clip shows there
            self._resident_seen = [(g, g._version) for g in (p.grad for p in self._resident) if g is not None]

    def _check_clip_order(self) -> None:
        """torch.nn.utils.clip_grad_norm_ (routed to this optimizer) clipped, then another backward gave
        gradients (a clip after each micro-batch, not only the last): torch's clip scales p.grad in place, so
        the later gradients add to the clipped sum, c1*g1 + g2; the engine holds g1 + g2 and the factor for
        step(), and no one factor makes the one from the other (it stepped 5x farther from torch's AdamW than
        no clipping at all: a reviewer's run). Refused at the next clip or step(), the step's gradients
        dropped. opt.clip_grad_norm_ leaves the gradients as they are (FusedAdam's), so its order is free."""
        if self._torch_clipped and not self._clip_outdated:
            now = [(g, g._version) for g in (p.grad for p in self._resident) if g is not None]
            self._clip_outdated = len(now) != len(self._resident_seen) or any(
                g is not h or v != w for (g, v), (h, w) in zip(now, self._resident_seen))
        if not self._clip_outdated:
            return
        factor = self._clip_scale
        self.zero_grad()
        raise RuntimeError(
            f"OffloadAdam: torch.nn.utils.clip_grad_norm_ clipped this step's gradients (factor {factor:.4g}), "
            "then another backward added to them. torch's clip scales the partial sum in p.grad, so the next "
            "micro-batch adds to the clipped one; this optimizer holds the sum on the host and applies the factor "
            "at step(), so it cannot. This step's gradients were dropped. Clip once per step, after the last "
            "micro-batch (with accelerate: under `if accelerator.sync_gradients:`, as the Trainer does), use "
            "opt.clip_grad_norm_, whose factor applies to the whole sum (FusedAdam's), or pass "
            "stream_grads=False, which keeps the gradients in p.grad until step(). (A step skipped after the clip "
            "drops its gradients with opt.zero_grad(): model.zero_grad() reaches only p.grad.)")

    def _refuse_grad_scaler(self) -> None:
        # GradScaler deletes its attributes after a step() that returns: left set, every later step() is refused
        for name in ("grad_scale", "found_inf"):
            self.__dict__.pop(name, None)
        how = ("overlap=True" if self._overlap else "attach_ddp" if self._ddp_handles else "stream_grads")
        message = (f"OffloadAdam: torch.amp.GradScaler needs the gradients in p.grad at step(), to unscale them "
                   f"and skip the step on an inf; this OffloadAdam took them during backward ({how}). Train in "
                   "bf16, which needs no loss scaling, or pass stream_grads=False (without overlap or attach_ddp), "
                   "where GradScaler works as with torch's AdamW (and with fp16 parameters as with FusedAdam). ")
        self._check_consistent()
        self._synchronize()   # overlap's bucket updates run on the workers: all of them counted
        if self._overlap and self._engine.param_updates > self._updates_at_open:
            self._broken = (message + "overlap=True had already updated the parameters during backward with the "
                            "scaled gradients, so further steps are refused: restore the model's weights and "
                            "opt.load_state_dict(...) from a checkpoint, or call opt.accept_partial_step().")
            raise RuntimeError(self._broken)
        self.zero_grad()
        raise RuntimeError(message + "This step's gradients were dropped: scaled, any later step would apply "
                                     "them too large.")

    def _unknown_norm(self) -> torch.Tensor:
        """overlap=True: a call that asks for the norm alone (max_norm=inf: transformers' Trainer makes one at
        every step to log grad_norm, clipping or not, and was refused, naming a clip it did not ask for). The
        gradients are gone into their buckets' updates: NaN, with a warning once."""
        if not self._warned_norm:
            self._warned_norm = True
            warnings.warn("OffloadAdam(overlap=True): clip_grad_norm_(max_norm=inf) returns NaN: each bucket's "
                          "gradients went into its update during backward, so there is no global norm to measure "
                          "(a logged grad_norm is nan); use overlap=False to see it", stacklevel=4)
        return torch.tensor(math.nan, dtype=torch.float32)
