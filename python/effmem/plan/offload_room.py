"""OffloadAdam's options that keep part of its work on the GPU, sized by the room a candidate leaves under the
GPU budget: device_accumulation (gradients summed on the GPU over the micro-batches) and device_state (the first
trained tensors' step state kept and stepped there)."""
import dataclasses
from typing import List

from effmem.plan import costs, step_model


def variants(cfg: costs.Config, cost: costs.Cost, budget: float, m: costs.Model, rates) -> List[costs.Config]:
    """The candidate's OffloadAdam variants that fit in the room it leaves; none for FusedAdam, or under
    torch.distributed (OffloadAdam takes gradients at step() there, where nothing crosses the link during
    accumulation anyway, and device_state is not offered with sharding)."""
    if cfg.optimizer == "gpu" or cfg.sharding != "none":
        return []
    room = int((budget - cost.peak_bytes) / (1 + costs.FRAGMENTATION))  # the reserve grows with what is kept
    if room <= 0:
        return []
    out = []
    kept = _device_accumulation(cfg, room, m)
    if kept:
        out.append(dataclasses.replace(cfg, device_accumulation=kept))
    state = _device_state(cfg, room, m, rates)
    if state:
        out.append(dataclasses.replace(cfg, device_state=state))
    return out


def _device_accumulation(cfg: costs.Config, room: int, m: costs.Model) -> int:
    """Under accumulation: the gradient bytes to keep on the GPU between micro-batches (sent once per step
    instead of once per micro-batch), as many whole buckets as the room holds."""
    if cfg.accumulation < 2:
        return 0
    g_b = costs.PRECISIONS[cfg.precision][1]
    return costs.kept_on_device(dataclasses.replace(cfg, device_accumulation=room), m, g_b)


def _device_state(cfg: costs.Config, room: int, m: costs.Model, rates) -> int:
    """The bytes of step state to keep on the GPU for the first trained tensors. async_step: as much as the host's
    share of the update needs to fit behind the next forward (no more: the rest of the room stays headroom); the
    modes that wait for the whole host update: as much as the room holds. 0 where no tensor fits, or where
    nothing would be left to offload (OffloadAdam refuses that: FusedAdam is the candidate then)."""
    if not rates.link_bw:
        return 0
    need = 0   # no bound but the room's
    if cfg.optimizer == "offload_async":
        per_param = step_model.host_adam_s(cfg, rates, 1) + costs.PRECISIONS[cfg.precision][0] / rates.link_bw
        need = m.trainable - int(step_model.forward_s(m, rates, cfg.precision) / per_param)   # what fwd cannot hide
        if need <= 0:
            return 0
    kept_t, _, used = costs.resident(dataclasses.replace(cfg, device_state=room), m, enough=need)
    return used if 0 < kept_t < m.trainable else 0
