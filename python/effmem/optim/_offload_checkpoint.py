"""OffloadAdam's checkpoints (a mixin of OffloadAdam): torch.optim's layout plus ``master``,
read from and written into the engine's host memory, interchangeable with FusedAdam's."""
import warnings
from typing import Any, Dict

import torch

from effmem.optim import _adam8, _validate
from effmem.optim._adam_entries import warn_zero_moments


class OffloadCheckpoint:
    def state_dict(self) -> Dict[str, Any]:
        """torch.optim's layout plus ``master`` per bf16/fp16 parameter (FusedAdam's layout).

        The tensors are the engine's host memory, as torch optimizers hand out
        their own state: ``torch.save`` it, or clone it to keep a snapshot.
        Parameters that have not been stepped yet have no entry. Refused after an overlap=True backward that
        raised part way (Ctrl-C), as step() is: the state holds part of a step, which a checkpoint would carry
        past that refusal into every run resumed from it.
        """
        self._check_open()
        self._check_saved_state()
        self._check_state()
        stale = self._round_stale or self._stale_next   # delay's gradients at stale weights (the sync clears it)
        self._synchronize()   # (overlap: its workers' bucket updates all counted after it)
        self._mid_step_save(stale)
        self._forget_predictions()   # as a run resumed from this checkpoint: both then take the same steps
        self._sync_state()
        def finish(sd):
            sd["state"] = {k: v for k, v in sd["state"].items() if v}   # an empty entry: a read of opt.state[p]
            for i in self._masters_pending:   # loaded without one, not stepped since
                k = i + self._first   # the engine's parameter i is the optimizer's i + _first (device_state)
                if "master" in sd["state"].get(k, ()):
                    sd["state"][k] = dict(sd["state"][k], master=self._local[i].detach().float().clone())
            return _adam8.checkpoint_out(sd, self._all_params)
        return self._hooked_state_dict(finish)

    def _mid_step_save(self, stale: bool) -> None:
        """A checkpoint between a backward and its step(), warned of (a reviewer's resume fuzz; not refused: a
        hook may call it inside a backward, which an exception would break). overlap: the backward has updated
        the parameters already, so the state is the step's while the loop has yet to take it: a run resumed from
        it takes that step twice. delay (past its warm-up, `stale`): this step's gradients were taken at weights a
        step stale, which no checkpoint holds, so a run resumed from it takes them at the installed weights. The
        gradients are the engine's (queued) or wait in p.grad (stream_grads=False, FSDP2, a bucket accumulated
        on the device)."""
        if not self._queued and all(p.grad is None for p in self._params):
            return
        if self._overlap and self._engine.param_updates > self._updates_at_open:
            warnings.warn("OffloadAdam(overlap=True).state_dict() between a backward and its step(): the "
                          "backward has updated the parameters already (inside it, some of them), so the state "
                          "holds the step while the loop has yet to take it, and a run resumed from it and "
                          "taking this step would take it twice. Save after step() (inside opt.accumulating(), "
                          "before the last micro-batch, works too)", stacklevel=3)
        elif stale:
            warnings.warn("OffloadAdam(delay=True).state_dict() between a backward and its step(): this step's "
                          "gradients were taken at weights one step stale (predicted ones, with delay_correction), "
                          "which a checkpoint cannot hold, so a run resumed from it takes them at the updated "
                          "weights and does not repeat this one bit for bit; save after step() for that",
                          stacklevel=3)

    def _forget_predictions(self) -> None:
        """delay_correction, after a synchronize: no prediction (a checkpoint holds none, nor its update's
        learning rate and clip factor; a state replaced makes those kept from it wrong), and the next step's
        weights up at once."""
        if self._delay_correction:
            self._engine.discard_pending()
            self._exact_next = True

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a checkpoint of OffloadAdam, FusedAdam or torch.optim.Adam/AdamW, exactly.

        Values are copied into the engine's host memory (nothing is staged on
        the GPU). A checkpoint without float32 masters (torch's AdamW) takes
        them from the parameters at the first step; a parameter without saved
        state starts afresh. torch's load_state_dict hooks run as for its
        optimizers.
        """
        self._hooked_load(state_dict, self._load_checked)

    @torch.no_grad()
    def _load_checked(self, state_dict: Dict[str, Any]) -> None:
        self._check_open()
        plan = _validate.checkpoint(self, state_dict, "OffloadAdam")  # all checked, nothing changed
        warn_zero_moments("OffloadAdam", plan)
        # delay and async_step: an update not installed yet belongs to the run being replaced; installing it
        # would write over weights the caller may have loaded already (model first, then the optimizer)
        self._engine.discard_pending()
        self._stale_next = False   # the next backward runs at the weights loaded with this checkpoint
        try:
            self._load_groups(state_dict["param_groups"])
            self._load_resident(state_dict)   # device_state's prefix: FusedAdam's loader
            for p, saved, step in plan[self._first:]:
                self._load_entry(p, saved, step)
            # checked against their parameters at the first use (take_masters_off_params says why); an entry
            # assigned into opt.state keeps its master as given, as FusedAdam's does
            self._masters_check = {self._index[p] for p, saved, _ in plan[self._first:]
                                   if saved and "master" in saved and p.dtype != torch.float32}
        except BaseException as e:   # out of memory, an interrupt: the engine holds part of the checkpoint
            self._broken = (f"OffloadAdam: a load_state_dict failed while copying the state in ({type(e).__name__}), "
                            "after the checkpoint had been checked: the optimizer holds part of it, and its steps "
                            "are refused until a load_state_dict completes")
            raise
        self._step_count = int(max((step for _, _, step in plan), default=0))
        self._exact_next = True   # delay_correction: the dropped update's prediction went with it
        # A consistent state again: a failed overlap backward is behind us, opt.state is the engine's.
        self._broken = None
        self._open_tasks.clear()
        self._raised_tasks.clear()
        self._note_state()

    def _load_entry(self, p, saved, step: float) -> None:
        """One parameter's saved state (checked by _validate.checkpoint; None: none) into the engine's memory."""
        i = self._index[p]
        master, *moments = self._views[i]  # exp_avg, exp_avg_sq (and their block scales: 8-bit)
        if saved is None:
            for t in moments:
                t.zero_()
            self._steps[i] = 0.0
            self._masters_pending.add(i)
        else:
            saved = _adam8.convert(saved, moments[0], self.state_bits, step, i + self._first)
            keys = ("exp_avg", "exp_avg_sq") + (("exp_avg_scale", "exp_avg_sq_scale") if self.state_bits == 8
                                                else ())
            for t, key in zip(moments, keys):
                t.copy_(saved[key])
            self._steps[i] = step
            if "master" in saved:
                master.copy_(saved["master"])
                self._masters_pending.discard(i)
                if self._local[i].dtype == torch.float32:   # a bf16/fp16 run's, kept by _validate.checkpoint
                    self._local[i].copy_(saved["master"])   # for a parameter holding it rounded: exact now
            else:   # fp32 parameters (their own master) and torch's checkpoints: the parameter at first use
                self._masters_pending.add(i)
                # until then opt.state shows the parameter as it was at the load, not the buffer's last run or
                # zeros (state_dict() takes it as it is then: model weights loaded after the optimizer's)
                master.copy_(self._local[i])
        if step > 0:
            self.state[p] = self._state_of(i)
        else:
            self.state.pop(p, None)
