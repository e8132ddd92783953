"""Randomised stress test of OffloadAdam's exact modes on the host backend (issue 12: every mode bit-exact
against FusedAdam fed the same gradients).

Per seed: plain or async_step, float32 or 8-bit moments, a device_state prefix or none, device
accumulation or none, random buckets, threads and copy delays; per step 1-3 micro-batches (all but the
last inside accumulating()), sometimes a new learning rate, clipping by global norm, zero_grad() without
a step, or a state_dict() round trip. The reference is one FusedAdam over the same model fed the same
micro-batches; after flush() weights and optimizer state must be bit-identical.
"""
import copy
import random

import pytest
import torch

from effmem import FusedAdam, OffloadAdam, demo_model
from effmem.optim._offload_resident import resident_bytes
from effmem.optim.clip import clip_coefficient
from offload_helpers import HP, assert_same_training, backward_both, batches, tiny_gpt


def _prefix_budget(rng: random.Random, params, bits: int) -> int:
    """device_state bytes that keep between one parameter and all but one (all of them is refused)."""
    sizes = [resident_bytes(p, bits) for p in params]
    keep = rng.randint(1, len(sizes) - 1)
    return sum(sizes[:keep])


@pytest.mark.parametrize("seed", range(16))
def test_exact_modes_random_schedules_match_fused_adam(seed):
    rng = random.Random(seed)
    mode = rng.choice(["plain", "async_step"])
    bits = rng.choice([32, 32, 8])
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    total = sum(p.numel() for p in model.parameters())
    cfg = dict(bucket_size=rng.choice([700, 3000, 20000]), num_threads=rng.randint(1, 3),
               _host_delay_us=rng.choice([0.0, 0.0, 40.0]), state_bits=bits)
    if rng.random() < 0.5:
        cfg["device_state"] = _prefix_budget(rng, list(model.parameters()), bits)
    if rng.random() < 0.4:
        cfg["device_accumulation"] = rng.choice([total, 2 * total])   # about half the buckets, or all
    if mode == "async_step":
        cfg["async_step"] = True
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), state_bits=bits, **HP)
    off = OffloadAdam(demo_model.decay_groups(model, 0.1), **cfg, **HP)
    if mode == "async_step":
        off.attach(model)
    data = iter(batches(40, seed=seed))
    try:
        for step in range(7):
            if rng.random() < 0.25:
                lr = rng.choice([1e-3, 3e-3, 1e-2])
                for opt in (fused, off):
                    for g in opt.param_groups:
                        g["lr"] = lr
            backward_both(ref, model, off, [next(data) for _ in range(rng.randint(1, 3))])
            if step > 0 and rng.random() < 0.12:   # a step abandoned: its gradients dropped on both sides
                for opt in (fused, off):
                    opt.zero_grad()
                continue
            if step == 0 or rng.random() < 0.5:   # the first step always clips, below the norm
                clip = 0.005 if step == 0 else rng.choice([0.01, 0.05, 1.0])
                total_norm = off.clip_grad_norm_(clip)
                fused_norm = fused.clip_grad_norm_(clip)
                assert float(fused_norm) == pytest.approx(float(total_norm), rel=1e-5)
                assert step > 0 or float(total_norm) > clip
                # both apply OffloadAdam's factor: the two norms are summed in different orders
                device = next(ref.parameters()).device
                fused._pending_grad_scale = {device: clip_coefficient(total_norm, clip).to(device)}
            for opt in (fused, off):
                opt.step()
                opt.zero_grad()
            if rng.random() < 0.2:   # a checkpoint round trip in place, mid-run
                off.load_state_dict(copy.deepcopy(off.state_dict()))
                fused.load_state_dict(copy.deepcopy(fused.state_dict()))
        off.flush()
        assert_same_training(ref, model, fused, off)
    finally:
        off.close()
