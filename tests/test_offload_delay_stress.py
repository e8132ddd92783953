"""Randomised stress test of OffloadAdam(delay=True) on the host backend.

Random parameter sizes and dtypes, two param groups, buckets, threads and copy
delays; 1-3 micro-batches per step, marked with accumulating() or not, random
parameters left out of each micro-batch; zero_grad() without step(), clipping,
lr changes, flush() between micro-batches, state_dict() round trips, and
float32 or 8-bit moments (state_bits). The
reference is FusedAdam fed exactly the gradients the engine was fed (each
computed from the weights that forward saw). Checked: every weight a forward
sees is one of the reference's versions of that parameter (never torn, never a
gradient installed as weights), and after flush() weights and optimizer state
are bit-identical to the reference.
"""
import copy
import random

import pytest
import torch

from effmem import FusedAdam, OffloadAdam
from effmem.optim.clip import clip_coefficient


def _groups(ps, split):
    g = [{"params": ps[:split], "lr": 1e-2, "weight_decay": 0.1}]
    if split < len(ps):
        g.append({"params": ps[split:], "lr": 3e-3, "weight_decay": 0.0})
    return g


def _version_of(w, versions):
    return [k for k, v in enumerate(versions) if torch.equal(w, v)]


@pytest.mark.parametrize("seed", range(24))
def test_delay_random_schedules_match_fused_adam(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    sizes = [rng.choice([1, 7, 31, 32, 33, 100, 257, 1000, 4099]) for _ in range(rng.randint(2, 9))]
    dtypes = [rng.choice([torch.bfloat16, torch.bfloat16, torch.float32]) for _ in sizes]
    params = [torch.nn.Parameter(torch.randn(n).to(dt)) for n, dt in zip(sizes, dtypes)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    split = rng.randint(1, len(params))
    hp = dict(betas=(0.9, 0.95), eps=1e-8)
    cfg = dict(bucket_size=rng.choice([1, 64, 500, 5000, 1 << 20]), num_threads=rng.randint(1, 3),
               _host_delay_us=rng.choice([0.0, 30.0, 300.0]), stream_grads=rng.random() < 0.8,
               delay_warmup=rng.choice([0, 0, 2, 5]), state_bits=rng.choice([32, 32, 8]))
    off = OffloadAdam(_groups(params, split), delay=True, **hp, **cfg)
    fused = FusedAdam(_groups(ref, split), state_bits=cfg["state_bits"], **hp)
    versions = [[r.detach().clone()] for r in ref]
    for k in range(14):
        acc = [None] * len(params)
        micro = rng.randint(1, 3)
        marked = rng.random() < 0.7
        for j in range(micro):
            used = [i for i in range(len(params)) if rng.random() < 0.75]
            if rng.random() < 0.03:
                off.flush()
            loss = 0.0
            for i in used:
                w = params[i].detach().clone()
                assert _version_of(w, versions[i]), f"step {k}: param {i} holds no version of its weights ({cfg})"
                if off._step_count <= cfg["delay_warmup"]:  # warm-up: every step installed at once
                    assert torch.equal(w, versions[i][-1]), f"step {k}: param {i} stale during warm-up ({cfg})"
                c = rng.uniform(0.5, 2.0)
                x = w.clone().requires_grad_()
                (c * (x.float() ** 2).sum() / 2).backward()
                acc[i] = x.grad if acc[i] is None else acc[i] + x.grad
                loss = loss + c * (params[i].float() ** 2).sum() / 2
            if used:
                with off.accumulating() if (marked and j < micro - 1) else torch.enable_grad():
                    loss.backward()
        if rng.random() < 0.1:
            off.zero_grad()  # a skipped step
            continue
        scale = rng.choice([1.0, 0.5, 2.0])
        for ga, gb in zip(off.param_groups, fused.param_groups):
            ga["lr"] = gb["lr"] = gb["lr"] * scale
        for p, g in zip(ref, acc):
            p.grad = g
        if rng.random() < 0.3:
            max_norm = rng.choice([0.1, 1.0, 100.0])
            total = off.clip_grad_norm_(max_norm)
            fused.clip_grad_norm_(max_norm)
            # The same coefficient on both sides: the two norms may differ in the last bit.
            fused._pending_grad_scale = {torch.device("cpu"): clip_coefficient(total, max_norm)}
        off.step()
        off.zero_grad()
        fused.step()
        fused.zero_grad()
        for i, p in enumerate(ref):
            if acc[i] is not None:
                versions[i].append(p.detach().clone())
        if rng.random() < 0.08:
            off.load_state_dict(copy.deepcopy(off.state_dict()))
    off.flush()
    for i, (p, q) in enumerate(zip(params, ref)):
        assert torch.equal(p, q), f"param {i} differs after flush ({cfg})"
    sa, sb = off.state_dict()["state"], fused.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        for name in sb[key]:
            assert torch.equal(sa[key][name].float(), sb[key][name].float()), (key, name, cfg)
    off.close()
