"""One parameter's FusedAdam state entry: whether it holds what the kernel takes, and how a checkpoint's (or
an assigned one) is restored in the optimizer's format and laid out as its parameter."""
import functools
import warnings
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from effmem.optim import _adam8, _validate


def _local(t: Tensor) -> Tensor:
    """This rank's shard of an FSDP2 (DTensor) parameter, gradient or state tensor, in place; else t.

    Adam is elementwise, so each rank updates its shard with the same kernel. The state stays a
    DTensor of the parameter's placements (zeros_like), which torch.distributed.checkpoint expects."""
    return t.to_local() if _validate.is_dtensor(t) else t


# the entry's keys whose tensors _as_kept checks, by state_bits
_ENTRY_KEYS = {32: ("step", *_adam8.MOMENT_KEYS[32], "master"),
               8: ("step", *_adam8.MOMENT_KEYS[8], "master", "exp_avg_scale", "exp_avg_sq_scale")}


def _as_kept(state: Dict[str, Any], p: Tensor, bits: int) -> bool:
    """Whether p's entry holds what the kernel takes, as _init_state makes it (checked at every step, so
    attribute reads only: its values are the kernel's to check)."""
    m_key, v_key = _adam8.MOMENT_KEYS[bits]
    step, m, v, master = state.get("step"), state.get(m_key), state.get(v_key), state.get("master")
    moment = torch.float32 if bits == 32 else torch.uint8
    shape = _local(p).shape
    if not (isinstance(step, Tensor) and step.dtype == torch.float32 and step.dim() == 0
            and step.device == p.device):
        return False
    if p.dtype == torch.float32 and master is not None:   # a float32 parameter is its own master
        return False
    sharded = _validate.is_dtensor(p)   # the step takes local shards of all or of none
    for t, dtype in ((m, moment), (v, moment)) + (((master, torch.float32),) if p.dtype != torch.float32 else ()):
        if not (isinstance(t, Tensor) and t.dtype == dtype and t.device == p.device
                and _validate.is_dtensor(t) == sharded and _local(t).shape == shape):
            return False
    if bits == 32:
        return "exp_avg_scale" not in state
    # other dtypes, devices or strides are converted as a checkpoint's are (OffloadAdam's load does so too)
    return all(isinstance(s, Tensor) and s.ndim == 1 and s.dtype == torch.float32 and s.device == p.device
               and s.is_contiguous() for s in (state.get("exp_avg_scale"), state.get("exp_avg_sq_scale")))


@torch.no_grad()
def take_masters_off_params(who: str, pairs: List[Tuple[Tensor, Tensor]], indices: List[int]) -> None:
    """At the first step after a load_state_dict, its float32 masters of bf16/fp16 parameters (pairs: master,
    parameter; indices: the parameters' in the optimizer). torch.distributed.checkpoint's partial load of torch
    AdamW's state (no masters) into a template whose masters its state-making step had set from a fresh model
    kept those, and the next step put the fresh weights back over the loaded ones (0.7 away: a reviewer's run).
    Such a master is a model's weights as they were (each element exactly a bf16/fp16 value) and not the
    parameter's now: taken from the parameter, with a warning. A trained master (the low bits of Adam's steps)
    stays even where the parameter differs: a loop that writes into its parameters between steps (a clamp) saves
    them so, and its next step overwrites the write, resumed or not."""
    off = _masters_off(pairs)
    for k in off:
        _local(pairs[k][0]).copy_(_local(pairs[k][1]))
    if off:
        index, shape, n = indices[off[0]], tuple(pairs[off[0]][1].shape), len(off)
        warnings.warn(f"{who}: {n} loaded float32 master{'s' if n > 1 else ''} (the first: of parameter {index}, "
                      f"shape {shape}) held other weights than the model's at the first step after load_state_dict, "
                      "as made from a model (not trained): a checkpoint without masters (torch's AdamW) loaded "
                      "partially into a state that had them (torch.distributed.checkpoint, allow_partial_load=True),"
                      " or a checkpoint taken before any step and other weights loaded into the model since. Taken "
                      "from the parameters, so the model's weights are the ones trained",
                      stacklevel=_validate._caller_level())


def warn_zero_moments(name: str, plan) -> None:
    """A load whose every stepped entry (step > 0) holds second moments of zeros: the state-making template of
    torch.distributed.checkpoint's partial load between 8-bit and float32 moments (the checkpoint's moments are
    under other keys than the template's, so only the step count loads). The next steps would divide by
    sqrt(v) of their own gradients alone at a late step's bias correction (a tiny MLP's fp32 -> 8-bit load:
    weights 0.014 off after one step at lr 1e-2). A real run holds v = 0 only where every gradient was 0. plan:
    _validate.checkpoint's (8-bit codes under torch's names, zero where a code or its block scale is)."""
    stepped = [saved for _, saved, step in plan if saved is not None and step > 0]
    if not stepped:
        return
    for saved in stepped:
        v, scale = saved["exp_avg_sq"], saved.get("exp_avg_sq_scale")
        if _local(v).count_nonzero() and (scale is None or _local(scale).count_nonzero()):
            return
    warnings.warn(f"{name}.load_state_dict: every parameter's second moment (exp_avg_sq) is 0 at step "
                  f"{max(step for *_, step in plan):g}: a state-making template that a partial load left as it "
                  "was (torch.distributed.checkpoint with allow_partial_load=True between 8-bit and float32 "
                  "moments, whose keys differ: only the step count loaded). The next steps run as if from "
                  "moments of zeros at that step count. Load such a checkpoint into an optimizer with its own "
                  "state_bits, or through load_state_dict, which converts it",
                  stacklevel=_validate._caller_level())


def _masters_off(pairs: List[Tuple[Tensor, Tensor]]) -> List[int]:
    """Indices of the pairs whose master is exactly a bf16/fp16 tensor (made from weights, not trained) that is
    not the parameter (NaN matching NaN); one host read per device."""
    flags: Dict[torch.device, List[Tuple[int, Tensor]]] = {}
    for k, (master, p) in enumerate(pairs):
        lp, lm = _local(p), _local(master)
        rounded = lm.to(dtype=lp.dtype)
        made = ((rounded.float() == lm) | lm.isnan()).all()
        rounded = rounded.to(lp.device)
        other = ((rounded != lp) & ~(rounded.isnan() & lp.isnan())).any()
        flags.setdefault(lp.device, []).append((k, other & made.to(lp.device)))
    off = []
    for entries in flags.values():
        hits = torch.stack([f for _, f in entries]).cpu().tolist()
        off += [k for (k, _), hit in zip(entries, hits) if hit]
    return sorted(off)


@torch.no_grad()
def _exact_float32_weights(plan) -> None:
    """A bf16/fp16 run's float32 master that _validate.checkpoint kept for a float32 parameter (which holds
    it rounded): into the parameter, its own master, so that nothing of that run's weights is lost."""
    for p, saved, _ in plan:
        if saved is not None and "master" in saved and p.dtype == torch.float32:
            _local(p).copy_(saved["master"])


def _laid_out_elsewhere(state: Dict[str, Tensor], p: Tensor, bits: int) -> bool:
    """Whether a moment or the master has other strides than p (a stride compare each: checked every step)."""
    m_key, v_key = _adam8.MOMENT_KEYS[bits]
    strides, master = p.stride(), state.get("master")
    return (state[m_key].stride() != strides or state[v_key].stride() != strides
            or (master is not None and master.stride() != strides))


def _match_layout(state: Dict[str, Tensor], p: Tensor, bits: int = 32, salt: int = 0) -> None:
    """Moments and master laid out as p (the kernels walk them along p's memory), as torch's optimizers take
    any layout: one put in opt.state by hand with other strides (zeros of p's shape for a channels_last p) is
    copied so once. 8-bit codes whose blocks ran along other memory (p.data = a column-major copy) are
    re-encoded along p's, as a checkpoint's are (_adam8.convert; the kernel refused them after the groups
    before had stepped, each retry stepping them again)."""
    if bits == 8 and _adam8._order(state[_adam8.CODE_KEYS["exp_avg"]]) != _adam8._order(p):
        new = _adam8.convert(_adam8.checkpoint_in(state, "state"), _local(p), 8, float(state["step"]), salt)
        for key, scale in _adam8.SCALE_KEYS.items():
            state[_adam8.CODE_KEYS[key]], state[scale] = new[key], new[scale]
    for key in (*_adam8.MOMENT_KEYS[bits], "master"):
        t = state.get(key)
        if isinstance(t, Tensor) and t.shape == p.shape and _local(t).stride() != _local(p).stride():
            state[key] = torch.empty_like(p, dtype=t.dtype).copy_(t)


def _restore_state(saved: Dict[str, Any], p: Tensor, step: float, state_bits: int = 32,
                   salt: int = 0) -> Dict[str, Tensor]:
    """A checkpoint's state for p, exactly as saved, in the format of state_bits: 8-bit moments are
    decoded for a float32 optimizer, float32 ones encoded for an 8-bit optimizer (effmem.optim._adam8).
    saved: this rank's shards (_validate.checkpoint); under FSDP2 the state are DTensors laid out as p."""
    def like_p(t: Tensor, dtype: torch.dtype) -> Tensor:
        out = torch.empty_like(p, dtype=dtype)
        _local(out).copy_(t)
        return out

    saved = _adam8.convert(saved, _local(p), state_bits, step, salt)
    state = {"step": torch.tensor(step, dtype=torch.float32, device=p.device)}
    f32 = functools.partial(like_p, dtype=torch.float32)
    if state_bits == 8:
        for key, scale in _adam8.SCALE_KEYS.items():
            state[_adam8.CODE_KEYS[key]] = like_p(saved[key], torch.uint8)
            state[scale] = saved[scale].to(device=p.device, dtype=torch.float32).clone()
    else:
        state["exp_avg"], state["exp_avg_sq"] = f32(saved["exp_avg"]), f32(saved["exp_avg_sq"])
    if p.dtype != torch.float32 and "master" in saved:   # else _init_state takes the parameter at its next step
        state["master"] = f32(saved["master"])
    return state
