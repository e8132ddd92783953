"""OffloadAdam(device_state=BYTES) (a mixin of OffloadAdam): the optimizer state of the first parameters stays
on their device and FusedAdam's kernel updates it there, the engine takes the rest.

Why: with exact math (async_step, clipping by global norm), the host update can only start once the last
gradient has landed, and the next forward reads the first layers' weights first. The host update of a 1.3B
model took 285 ms on the H100 machine, the first micro-batch's forward 90 ms: the forward waited for the
update layer by layer. The parameters the forward reads first are the ones whose host update it waits on
longest, so those are the ones kept on the device (updated in milliseconds by the GPU); the host then updates
only the later layers, which the forward reaches later. Same idea as DeepSpeed's ZeRO-Offload++ "twin-flow"
ratio, placed by a memory budget in forward order.

The split is a prefix of the optimizer's parameters (for ``model.parameters()``, registration order: the
embedding and the first blocks), so every parameter keeps its place in the optimizer: checkpoints, 8-bit
rounding salts and clipping are those of one FusedAdam over all of them, bit for bit.
"""
from typing import Any, Dict, List

import torch
from torch import Tensor

from effmem.optim import _adam8, _validate
from effmem.optim._offload_layout import leading_buckets
from effmem.optim.clip import _to_device, grad_norm

_HYPER = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "bias_correction")


def step_state_bytes(numel: int, master_bytes: int, grad_bytes: int, state_bits: int) -> int:
    """Device bytes of one tensor's step state: its fp32 master, Adam's moments (float32, or 8-bit codes and a
    float32 scale per block) and its gradient between backward and step (effmem plan counts with this too)."""
    moments = 8 * numel if state_bits == 32 else 2 * numel + 8 * _adam8.blocks(numel)
    return numel * (master_bytes + grad_bytes) + moments


def resident_bytes(p: Tensor, state_bits: int) -> int:
    """step_state_bytes of a parameter (a master for bf16/fp16 only); a frozen parameter needs none."""
    if not p.requires_grad:
        return 0
    n = _validate.local_tensor(p).numel()
    return step_state_bytes(n, 4 if p.dtype != torch.float32 else 0, p.element_size(), state_bits)


def resident_prefix(params: List[Tensor], budget: int, state_bits: int) -> int:
    """How many of the first parameters (the optimizer's order) fit together in `budget` device bytes."""
    return leading_buckets([resident_bytes(p, state_bits) for p in params], budget)


class OffloadResident:
    def _split_resident(self, everything: List[Tensor]) -> List[Tensor]:
        """Chooses the device-resident prefix and builds its FusedAdam; returns the engine's parameters."""
        from effmem.optim.fused_adam import FusedAdam

        r = resident_prefix(everything, self._device_state, self.state_bits) if self._device_state else 0
        if r and r == len(everything):
            need = sum(resident_bytes(p, self.state_bits) for p in everything)
            raise ValueError(f"device_state: {self._device_state} bytes hold the state of every parameter ({need} "
                             "bytes needed), leaving nothing to offload; use effmem.FusedAdam")
        if r and any(_validate.is_dtensor(p) for p in everything):
            raise ValueError("device_state: not supported with FSDP2 (DTensor) parameters yet; use device_state=0")
        self._resident: List[Tensor] = everything[:r]
        self._resident_opt = None
        self._resident_groups: List[int] = []   # the outer group of each of the FusedAdam's groups
        if r:
            groups, pos = [], 0
            for gi, g in enumerate(self.param_groups):
                mine = g["params"][:max(0, r - pos)]
                pos += len(g["params"])
                if mine:
                    groups.append({"params": mine, **{k: g[k] for k in _HYPER}})
                    self._resident_groups.append(gi)
            self._resident_opt = FusedAdam(groups, state_bits=self.state_bits)
            self._resident_opt._owner_name = "OffloadAdam"   # in its messages
        return everything[r:]

    def _resident_sq_sum(self) -> float:
        """Sum of squares of the device-resident gradients, in float64 as the engine keeps its own (one host
        read: the host's own sum waits for every gradient anyway). The square of their float32 norm, added to
        the engine's float64 sum, rounded the global norm off FusedAdam's by an ulp in 3 seeds of 20 (CPU)."""
        sq = [torch.linalg.vector_norm(_validate.local_tensor(p.grad), dtype=torch.float64).square()
              for p in self._resident if p.grad is not None]
        return float(torch.stack([s.cpu() for s in sq]).sum()) if sq else 0.0

    def _step_resident(self, scale: float) -> None:
        """FusedAdam's step on the device-resident parameters, with the outer groups' hyper-parameters as they
        are now and the clip factor the engine gets (the same float32 value)."""
        inner = self._resident_opt
        if inner is None:
            return
        for group, gi in zip(inner.param_groups, self._resident_groups):
            group.update({k: self.param_groups[gi][k] for k in _HYPER})
        if scale != 1.0:
            device = self._resident[0].device   # FusedAdam's groups hold one device each, OffloadAdam's all one
            inner._pending_grad_scale = {device: _to_device(torch.tensor(scale, dtype=torch.float32), device)}
        else:
            inner._pending_grad_scale = {}
        inner.step()
        for p in self._resident:
            if inner.state.get(p):
                self.state[p] = inner.state[p]
        self._drop_resident_grads()

    def _drop_resident_grads(self) -> None:
        """Taken by a step, as the engine takes the offloaded parameters' (_hand_off), and dropped by zero_grad
        whatever set_to_none says: a second step() without a backward, or one after zero_grad(set_to_none=False),
        stepped them on a stale or zeroed gradient where the offloaded ones were not stepped."""
        for p in self._resident:
            p.grad = None

    def _load_resident(self, state_dict: Dict[str, Any]) -> None:
        """A checkpoint's entries for the device-resident prefix, through FusedAdam's loader (checked as a whole
        by OffloadAdam's before anything changed). Positions in the checkpoint are the optimizer's own."""
        inner = self._resident_opt
        if inner is None:
            return
        ids = [sid for g in state_dict["param_groups"] for sid in g["params"]]
        groups, pos = [], 0
        for gi, g in enumerate(state_dict["param_groups"]):
            take = [ids[k] for k in range(pos, min(pos + len(g["params"]), len(self._resident)))]
            pos += len(g["params"])
            if take:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": take})
        saved = state_dict["state"]
        inner._load_checked({"state": {sid: saved[sid] for sid in ids[:len(self._resident)] if sid in saved},
                             "param_groups": groups}, warn=False)
        for p in self._resident:
            if inner.state.get(p):
                self.state[p] = inner.state[p]
            else:
                self.state.pop(p, None)

    def _resident_counters(self) -> Dict[str, int]:
        return {"device_state_params": sum(_validate.local_tensor(p).numel() for p in self._resident),
                "device_state_bytes": sum(resident_bytes(p, self.state_bits) for p in self._resident)}
