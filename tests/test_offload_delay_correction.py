"""OffloadAdam(delay=True, delay_correction=True) on the host transfer backend.

The host's master weights and moments are exact Adam fed the gradients the model made; those gradients are
taken at weights predicted from the previous gradient (common/delay_correction_math.h). The reference below
is FusedAdam whose model's forward runs on the same predictions (effmem.reference, float32 torch ops), so the
two agree bit for bit: which weights each forward reads, every loss, the state and the final weights.
"""
import copy

import pytest
import torch

from effmem import FusedAdam, OffloadAdam, demo_model
from effmem.cli import lr_lambda
from effmem.optim import _adam8
from effmem.optim.offload_adam import CORRECTION_WARMUP
from effmem.reference import delay_correction_weights
from offload_helpers import HP, assert_same_training, batches, finish_step, tiny_gpt, train


def corrected(model, **kw):
    """The OffloadAdam under test: delay with delay_correction, small buckets, the tests' hyper-parameters; no
    warm-up (predictions from the second step on) unless given."""
    kw = {"delay": True, "delay_correction": True, "delay_warmup": 0, "bucket_size": 5000, **kw}
    return OffloadAdam(demo_model.decay_groups(model, 0.1), **kw, **HP)


def moments(state):
    """Adam's moments from FusedAdam's state, 8-bit ones decoded (torch ops) as the engine's update decodes them."""
    if "exp_avg_codes" not in state:
        return state["exp_avg"], state["exp_avg_sq"]
    return tuple(_adam8.decode(state[f"{key}_codes"].reshape(-1), state[f"{key}_scale"], key == "exp_avg_sq")
                 .view_as(state[f"{key}_codes"]) for key in ("exp_avg", "exp_avg_sq"))


def train_predicted_reference(model, opt, data, *, accum=1, clip=None, sched=None, predict_clipped=True,
                              flush_after=(), errors=None):
    """FusedAdam on the gradients of a shadow model whose forward k reads the engine's prediction: exact
    weights at steps 1 and 2 (the first step is taken exactly: nothing to predict from), then the prediction
    made from the state before step k-1's update and step k-1's gradient (its sum over `accum` micro-batches),
    with step k-2's clip factor (1 without predict_clipped: the wrong one, for a test that it matters). After
    the steps in flush_after the next forward reads the exact weights (the flush put them up). `errors` gets,
    per prediction, its distance to the weights exact Adam reached with the same gradient over the length of
    that step (plain delay's forward, on the weights before it, would be 1)."""
    shadow = copy.deepcopy(model)
    params = list(model.parameters())
    forward = [p.detach().clone() for p in params]
    losses, lrs, factor = [], None, 1.0
    for k in range(1, len(data) // accum + 1):
        with torch.no_grad():
            for s, w in zip(shadow.parameters(), forward):
                s.copy_(w)
        for x, y in data[(k - 1) * accum:k * accum]:
            _, loss = shadow(x, y)
            (loss / accum).backward()
            losses.append(loss.item())
        if k >= 2:
            forward = []
            group_of = {p: (g, lr) for g, lr in zip(opt.param_groups, lrs) for p in g["params"]}
            for p, s in zip(params, shadow.parameters()):
                st = opt.state[p]
                group, lr = group_of[p]
                master = st["master"] if "master" in st else p.detach()
                forward.append(delay_correction_weights(master.float(), *moments(st), s.grad, p.dtype, group, lr,
                                                        float(st["step"]), factor))
        for p, s in zip(params, shadow.parameters()):
            p.grad, s.grad = s.grad, None
        lrs = [g["lr"] for g in opt.param_groups]   # what this step's update runs with
        if clip is not None:
            opt.clip_grad_norm_(clip)
            factor = float(next(iter(opt._pending_grad_scale.values()))) if predict_clipped else 1.0
        before = [p.detach().float().clone() for p in params]
        finish_step(opt, None, sched)
        if errors is not None and k >= 2:
            off = sum(((w.float() - p.detach().float()) ** 2).sum() for w, p in zip(forward, params))
            step = sum(((b - p.detach().float()) ** 2).sum() for b, p in zip(before, params))
            errors.append(float((off / step).sqrt()))
        if k == 1 or k in flush_after:
            forward = [p.detach().clone() for p in params]
    return losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("mode,device", [("plain", "cpu"), ("sched", "cpu"), ("host_delays", "cpu"), ("8bit", "cpu"),
                                         ("l2", "cpu"), ("no_bias_correction", "cpu"),
                                         pytest.param("plain", "cuda", marks=pytest.mark.cuda),
                                         pytest.param("8bit", "cuda", marks=pytest.mark.cuda)])
def test_delay_correction_trains_on_the_predicted_weights_bit_for_bit(dtype, mode, device):
    """On a GPU the prediction is corrected by the CUDA kernel on the upload stream (csrc/cuda/elementwise.cu)."""
    data = [(x.to(device), y.to(device)) for x, y in batches(12)]
    ref = tiny_gpt(dtype).to(device)
    model = copy.deepcopy(ref)
    bits = 8 if mode == "8bit" else 32
    kw = dict(state_bits=bits, decoupled_weight_decay=mode != "l2", bias_correction=mode != "no_bias_correction")
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **kw, **HP)
    off = corrected(model, _host_delay_us=200.0 if mode == "host_delays" else 0.0, **kw)
    sched = (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(12))) if mode == "sched" else (lambda o: None)
    la = train_predicted_reference(ref, fused, data, sched=sched(fused))
    lb = train(model, off, data, sched=sched(off))
    assert la[-1] < la[0]
    assert la == lb
    off.flush()   # the exact weights of the last update, not its prediction
    assert_same_training(ref, model, fused, off)
    c = off.counters()
    n = sum(p.numel() for p in model.parameters())
    size = torch.finfo(dtype).bits // 8
    # The first step installs its weights at once, every later backward a prediction (weights and r: twice
    # the bytes), and the flush the last update's own weights.
    assert c["bytes_down"] == 12 * n * size
    assert c["bytes_up"] == (1 + 2 * 11 + 1) * n * size
    off.close()


def test_delay_correction_needs_delay():
    model = tiny_gpt(torch.float32)
    with pytest.raises(ValueError, match="delay_correction: corrects delay=True"):
        OffloadAdam(model.parameters(), delay_correction=True)
    with pytest.raises(ValueError, match="delay_correction: expected True or False"):
        OffloadAdam(model.parameters(), delay=True, delay_correction=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delay_correction_with_device_accumulation_predicts_from_the_summed_gradient(dtype):
    data = batches(12)
    ref = tiny_gpt(dtype)
    model = copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
    off = corrected(model, device_accumulation=1 << 30)
    la = train_predicted_reference(ref, fused, data, accum=3)
    lb = train(model, off, data, accum=3)
    assert la == lb
    off.flush()
    assert_same_training(ref, model, fused, off)
    c = off.counters()
    n = sum(p.numel() for p in model.parameters())
    size = torch.finfo(dtype).bits // 8
    assert c["bytes_down"] == 4 * n * size   # once per step
    assert c["bytes_up"] == (1 + 2 * 3 + 1) * n * size
    off.close()


def test_delay_correction_with_host_accumulation_installs_as_plain_delay():
    """The last micro-batch's gradient alone is not the step's: those installs are plain delay's (after the
    first step, taken exactly)."""
    data = batches(12)
    models = [tiny_gpt(torch.bfloat16) for _ in range(2)]
    opts = [corrected(m, delay_correction=c, delay_warmup=1) for m, c in zip(models, (False, True))]
    la, lb = (train(m, o, data, accum=3) for m, o in zip(models, opts))
    assert la == lb
    assert opts[0].counters()["bytes_up"] == opts[1].counters()["bytes_up"]
    for o in opts:
        o.flush()
    assert_same_training(*models, *opts)
    for o in opts:
        o.close()


def test_delay_correction_uses_the_previous_steps_clip_factor():
    data = batches(12)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
    off = corrected(model)
    la = train_predicted_reference(ref, fused, data, clip=0.05)
    lb = train(model, off, data, clip=0.05)
    # The two norms may differ in their last bit (summed in other orders), so the steps may too.
    assert la == pytest.approx(lb, rel=1e-4)
    other = tiny_gpt(torch.bfloat16)
    wrong = train_predicted_reference(other, FusedAdam(demo_model.decay_groups(other, 0.1), **HP), data, clip=0.05,
                                      predict_clipped=False)
    assert lb != pytest.approx(wrong, rel=1e-3)   # predicting from the unclipped gradient would show
    off.close()


def test_delay_correction_goes_on_predicting_after_a_flush_and_a_resumed_run_takes_its_first_step_exactly():
    """A flush (evaluation, a checkpoint) puts the update's own weights up; the next backward still predicts
    from it. A run resumed from a checkpoint has no update to predict from: its first step is exact."""
    data = batches(14)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
    off = corrected(model)
    la = train_predicted_reference(ref, fused, data[:8], flush_after=(3, 6))
    lb = []
    for k, (x, y) in enumerate(data[:8], start=1):
        lb += train(model, off, [(x, y)])
        if k in (3, 6):
            off.flush()
    assert la == lb
    saved = copy.deepcopy((model.state_dict(), off.state_dict()))   # flushes: the weights of 8 steps
    # Resumed in a new optimizer (FusedAdam's checkpoints are interchangeable with it), against the reference
    # resumed from the same checkpoint, whose first step is exact.
    resumed = tiny_gpt(torch.bfloat16)
    resumed.load_state_dict(saved[0])
    off2 = corrected(resumed)
    off2.load_state_dict(saved[1])
    ref2 = tiny_gpt(torch.bfloat16)
    ref2.load_state_dict(saved[0])
    fused2 = FusedAdam(demo_model.decay_groups(ref2, 0.1), **HP)
    fused2.load_state_dict(saved[1])
    assert train_predicted_reference(ref2, fused2, data[8:]) == train(resumed, off2, data[8:])
    off2.flush()
    assert_same_training(ref2, resumed, fused2, off2)
    for o in (off, off2):
        o.close()


def test_delay_correction_after_a_warm_up_predicts_only_for_the_steps_after_it():
    """delay_warmup=W: steps 1..W install their weights at once (as a flush would); only step W's update
    writes a prediction for the backward after it: those of steps 1..W-1 would go up only to be replaced by
    the next step's own weights."""
    data, warmup = batches(8), 3
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
    off = corrected(model, delay_warmup=warmup)
    la = train_predicted_reference(ref, fused, data, flush_after=range(1, warmup + 1))
    lb = train(model, off, data)
    assert la == lb
    off.flush()
    assert_same_training(ref, model, fused, off)
    n = sum(p.numel() for p in model.parameters())
    # the warm-up's own weights, then the predictions of steps W..7 (weights and r), then the flush's
    assert off.counters()["bytes_up"] == (warmup + 2 * (len(data) - warmup) + 1) * n * 2
    off.close()


def test_the_default_warm_up_is_correction_warmup_exact_steps_and_none_without_the_correction():
    """delay_warmup's default: CORRECTION_WARMUP exact steps with delay_correction, whose predictions miss most
    in a run's first steps (docs/offload_adam.md), and none for plain delay, whose second forward reads the
    weights before the first update."""
    data = batches(CORRECTION_WARMUP + 3)
    ref = tiny_gpt(torch.bfloat16)
    model, exact, stale = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
    off = OffloadAdam(demo_model.decay_groups(model, 0.1), delay=True, delay_correction=True, **HP)
    la = train_predicted_reference(ref, fused, data, flush_after=range(1, CORRECTION_WARMUP + 1))
    assert la == train(model, off, data)
    off.close()
    # exact up to the warm-up's end and the step after it (installed at once), predicted after that
    le = train(exact, FusedAdam(demo_model.decay_groups(exact, 0.1), **HP), data)
    assert la[:CORRECTION_WARMUP + 1] == le[:CORRECTION_WARMUP + 1] and la[-2:] != le[-2:]
    with OffloadAdam(demo_model.decay_groups(stale, 0.1), delay=True, **HP) as plain:
        lp = train(stale, plain, data[:2])
    assert lp[0] == le[0] and lp[1] != le[1]


@pytest.mark.parametrize("decoupled", [True, False])
def test_delay_correction_predicts_the_next_weights_within_a_fraction_of_a_step(decoupled):
    """Each prediction against the weights exact Adam reaches with the same gradient. It lacks v's share of the
    new gradient in the momentum's part (most while v holds few gradients), and in L2 mode (the weight decay in
    the gradient) the cross term of v; r takes the decay's own share there, without which that term of the
    prediction was unbounded (|w| of 8 where the weights were below 1)."""
    model = tiny_gpt(torch.float32)
    fused = FusedAdam(demo_model.decay_groups(model, 0.1), decoupled_weight_decay=decoupled, **HP)
    errors = []
    train_predicted_reference(model, fused, batches(30), errors=errors)
    assert max(errors) < 0.6, errors        # 0.43-0.48 at the first prediction, from v of one gradient
    assert max(errors[-10:]) < 0.1, errors   # 0.05-0.07 by the 30th step


def test_zero_grad_without_a_step_puts_the_exact_weights_back_and_the_next_backward_predicts_again():
    data = batches(4)
    model = tiny_gpt(torch.bfloat16)
    off = corrected(model)
    train(model, off, data[:2])
    before = [p.detach().clone() for p in model.parameters()]   # predicted in the second backward
    model(*data[2])[1].backward()    # installs the prediction made from this gradient
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    off.zero_grad()                  # drops the gradient, and the prediction made from it
    params = [p for g in off.param_groups for p in g["params"]]   # the state's order
    master = [off.state[p]["master"].clone() for p in params]   # the second update's weights (state_dict()
    # would also drop the prediction, as a resumed run has none)
    assert all(torch.equal(p, w.to(p.dtype)) for p, w in zip(params, master))
    up = off.counters()["bytes_up"]
    model(*data[3])[1].backward()    # predicts again, from this gradient
    assert off.counters()["bytes_up"] == up + 2 * sum(p.numel() * 2 for p in model.parameters())
    assert any(not torch.equal(p, w.to(p.dtype)) for p, w in zip(params, master))
    off.close()


def test_the_prediction_buffer_is_counted_and_freed_at_close():
    """delay_correction's pinned buffer (each bucket's prediction, then r: 2 values per element in the
    parameters' dtype) was left out of counters() and kept after close() for as long as the engine lived."""
    probe = OffloadAdam([torch.nn.Parameter(torch.zeros(4))])   # reads the process's counters after a close

    def process():
        c = probe.counters()
        return c["process_pinned_bytes"] + c["process_pageable_bytes"]

    def held(**kw):
        model = tiny_gpt(torch.bfloat16)
        opt = OffloadAdam(model.parameters(), delay=True, bucket_size=5000, **kw, **HP)
        c, before = opt.counters(), process()
        opt.close()
        return c["engine_pinned_bytes"] + c["engine_pageable_bytes"], before - process()
    n = sum(p.numel() for p in tiny_gpt(torch.bfloat16).parameters())
    (plain, plain_freed), (ours, ours_freed) = held(), held(delay_correction=True)
    assert ours - plain == 2 * n * 2
    assert ours_freed - plain_freed == 2 * n * 2
    probe.close()
