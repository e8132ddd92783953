"""effmem plan's OffloadAdam(device_state=BYTES) candidates: the first trained tensors' step state kept on the
GPU (with async_step as much as the host's share of the update needs to fit behind the next forward, otherwise
as much as the room holds), counted byte for byte (GPU and host), timed as the host's share plus the kept part's
GPU step, and applied as planned."""
import dataclasses

import pytest
import torch

import effmem
from effmem.optim._offload_resident import resident_bytes
from effmem.plan import costs, step_model
from effmem.plan.rates import rates_for
from effmem.plan.report import code_for

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)


def _pair(plan, **want):
    """The candidate with device_state matching `want` and the one without, otherwise the same."""
    kept = next(c for c in plan.candidates if c.config.device_state and all(
        getattr(c.config, k) == v for k, v in want.items()))
    base = next(c for c in plan.candidates if c.config == dataclasses.replace(kept.config, device_state=0))
    return kept, base


def test_device_state_candidates_count_what_they_keep_and_time_the_host_share_only():
    p = effmem.plan("llama-1b", batch=32, seq=2048, accum=4, gpu_memory="80GB", host_memory="128GB", device="cuda")
    kept, base = _pair(p, precision="bf16", activations="none", loss="standard", state_bits=32, micro_batch=8,
                       optimizer="offload_async")
    assert "state-on-gpu" in kept.name and kept.fits
    numels = [q.trainable for q in p.spec.params if q.trainable]
    n, _, used = costs.resident(kept.config, dataclasses.replace(costs.Model(0, 0, {}, 0, 0, 0, 0, 0, 0),
                                                                 trainable_numels=tuple(numels)))
    assert used == kept.config.device_state and 0 < n < p.trainable_params
    # on the GPU: master 4 + moments 8 + gradient 2 per kept element; off the host: master, moments, 2 stagings
    assert kept.cost.allocated_bytes - base.cost.allocated_bytes == 14 * n == used
    assert base.cost.host_bytes - kept.cost.host_bytes == (4 + 8 + 2 * 2) * n
    # what the forward could not hide is gone, at the price of the kept part's GPU step
    assert base.time_parts["optimizer"] > 0.1 > kept.time_parts["optimizer"]
    assert kept.step_time_s < base.step_time_s
    assert f"device_state={used})" in code_for(kept.config) and "opt.attach(model)" in code_for(kept.config)
    assert p.as_dict()["candidates"][p.candidates.index(kept)]["device_state"] == used
    # no more than the forward needs: the host's share fits behind it, one tensor fewer kept would not
    # backward: two forwards (products and elementwise ops alike), all trained
    fwd = (kept.time_parts["compute"] + kept.time_parts["elementwise"]) / (3 * kept.config.accumulation)
    per = step_model.host_adam_s(kept.config, p.rates, 1) + 2 / p.rates.link_bw
    last = numels[[sum(numels[:k + 1]) for k in range(len(numels))].index(n)]
    assert (p.trainable_params - n) * per <= fwd < (p.trainable_params - n + last) * per


def test_modes_that_wait_for_the_whole_update_keep_what_the_room_holds():
    """Plain OffloadAdam waits for the whole host update after backward: every tensor kept on the GPU shortens
    it, so its device_state candidate keeps the longest prefix the room under the budget holds."""
    from effmem.plan.planner import HEADROOM
    want = dict(precision="bf16", activations="none", loss="standard", state_bits=32, micro_batch=4,
                optimizer="offload", device_accumulation=0, device_state=0)
    probe = effmem.plan("llama-1b", batch=32, seq=2048, accum=8, gpu_memory="80GB", host_memory="128GB",
                        device="cuda")
    plain = next(c for c in probe.candidates if all(getattr(c.config, k) == v for k, v in want.items()))
    assert not any(c.config.device_state for c in probe.candidates if c.config.optimizer == "offload"
                   and c.config.micro_batch == 4)   # room for every tensor: FusedAdam is that candidate
    # 8 GB of room: part of the model's 14 B/param
    p = effmem.plan("llama-1b", batch=32, seq=2048, accum=8, gpu_memory=(plain.cost.peak_bytes + 8e9) / (1 - HEADROOM),
                    host_memory="128GB", device="cuda")
    want.pop("device_state")
    kept, base = _pair(p, **want)
    budget = p.gpu_memory * (1 - HEADROOM)
    numels = [q.trainable for q in p.spec.params if q.trainable]
    n = (kept.cost.allocated_bytes - base.cost.allocated_bytes) // 14
    nxt = numels[[sum(numels[:k + 1]) for k in range(len(numels))].index(n) + 1]
    assert kept.fits and kept.cost.peak_bytes <= budget < kept.cost.peak_bytes + 14 * nxt * (1 + costs.FRAGMENTATION)
    saved = (step_model.host_adam_s(kept.config, p.rates, n) + 2 * n / p.rates.link_bw
             - step_model.gpu_adam_s(kept.config, p.rates, n))
    assert base.time_parts["optimizer"] - kept.time_parts["optimizer"] == pytest.approx(saved, rel=1e-6)


def test_no_candidate_without_room_or_with_nothing_left_to_offload():
    """A GPU with no room left: none. A model whose whole state would be kept: none either (OffloadAdam refuses
    that; FusedAdam is the candidate there)."""
    p = effmem.plan("llama-1b", batch=32, seq=2048, accum=4, gpu_memory="80GB", host_memory="128GB", device="cuda")
    _, base = _pair(p, precision="bf16", activations="none", loss="standard", state_bits=32, micro_batch=8,
                    optimizer="offload_async")
    tight = effmem.plan("llama-1b", batch=32, seq=2048, accum=4, gpu_memory=base.cost.peak_bytes / 0.95 + 1e6,
                        host_memory="128GB", device="cuda")
    assert not any(c.config.device_state for c in tight.candidates
                   if c.config.micro_batch == 8 and c.config.activations == "none" and c.config.state_bits == 32
                   and c.config.loss == "standard" and c.config.precision == "bf16")
    slow_host = dataclasses.replace(rates_for("NVIDIA H100 80GB HBM3"), host_adam=1.0)
    small = effmem.plan(TINY, batch=4, seq=64, gpu_memory="80GB", host_memory="8GB", device="cuda", rates=slow_host)
    assert not any(c.config.device_state for c in small.candidates)


def test_apply_gives_offload_adam_the_planned_device_state():
    """Planned for a GPU whose forward hides about half of the host update, applied on the CPU (the host
    backend): OffloadAdam keeps exactly the elements the plan counted, and trains."""
    base = rates_for("NVIDIA H100 80GB HBM3")
    probe = effmem.plan(TINY, batch=4, seq=64, accum=1, gpu_memory="80GB", host_memory="8GB", device="cuda",
                        rates=base)
    c0 = next(c for c in probe.candidates if c.config.optimizer == "offload_async" and not c.config.device_state
              and c.config.precision == "bf16" and c.config.activations == "none" and c.config.micro_batch == 4)
    fwd = (c0.time_parts["compute"] + c0.time_parts["elementwise"]) / 3   # backward: two forwards, all trained
    # a host whose update of half the trained parameters (and their upload) takes one forward
    per = fwd / (probe.trainable_params / 2)
    rates = dataclasses.replace(base, host_adam=1 / (per - 2 / base.link_bw))
    p = effmem.plan(TINY, batch=4, seq=64, accum=1, gpu_memory="80GB", host_memory="8GB", device="cuda", rates=rates)
    c = next(c for c in p.candidates if c.config.device_state and c.config.precision == "bf16"
             and c.config.state_bits == 32 and c.config.optimizer == "offload_async")
    p.device = "cpu"
    from test_plan_apply import real_tiny
    model, opt = p.apply(real_tiny(TINY).to(torch.bfloat16), c.name)
    assert isinstance(opt, effmem.OffloadAdam) and opt._device_state == c.config.device_state
    kept = opt.counters()["device_state_params"]
    assert kept == sum(q.numel() for q in opt._resident) and kept >= p.trainable_params / 2 - 1
    assert opt.counters()["device_state_bytes"] == sum(resident_bytes(q, 32) for q in opt._resident)
    ids = torch.randint(0, TINY["vocab_size"], (2, 64))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    opt.close()
