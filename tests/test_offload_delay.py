"""OffloadAdam(delay=True), the delayed parameter update, on the host transfer backend.

Its math is Adam with one-step-stale gradients: the update of step k applies
the gradient taken at the weights of step k-1. The reference below is
FusedAdam fed exactly those gradients (computed on a shadow copy of the model
that holds the previous step's weights), so the two must agree bit for bit.
"""
import contextlib
import functools
import copy
import time

import pytest
import torch

from effmem import FusedAdam, OffloadAdam, demo_model
from effmem.optim import _offload_guards
from effmem.cli import lr_lambda
from offload_helpers import HP, assert_same_training, batches, finish_step, tiny_gpt, train


def train_stale_reference(model, opt, data, *, clip=None, sched=None, warmup=0):
    """FusedAdam where step k's gradient comes from the weights before step k-1 (from the
    weights before step k itself for the first warmup + 1 steps: delay_warmup's exact steps,
    and the step after them, whose forward still sees the last exact step's weights)."""
    shadow = copy.deepcopy(model)
    stale = [p.detach().clone() for p in model.parameters()]
    losses = []
    for k, (x, y) in enumerate(data, start=1):
        source = list(model.parameters()) if k <= warmup + 1 else stale
        with torch.no_grad():
            for s, w in zip(shadow.parameters(), source):
                s.copy_(w)
        _, loss = shadow(x, y)
        loss.backward()
        losses.append(loss.item())
        for p, s in zip(model.parameters(), shadow.parameters()):
            p.grad, s.grad = s.grad, None
        stale = [p.detach().clone() for p in model.parameters()]
        finish_step(opt, clip, sched)
    return losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["plain", "clip", "sched", "host_delays"])
def test_delay_is_adam_on_one_step_stale_gradients(dtype, mode):
    clip = 0.5 if mode == "clip" else None
    data = batches(20)
    ref = tiny_gpt(dtype)
    model = copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
    off = OffloadAdam(demo_model.decay_groups(model, 0.1), delay=True, bucket_size=5000,
                      _host_delay_us=200.0 if mode == "host_delays" else 0.0, **HP)
    sched = (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(20))) if mode == "sched" else (lambda o: None)
    la = train_stale_reference(ref, fused, data, clip=clip, sched=sched(fused))
    lb = train(model, off, data, clip=clip, sched=sched(off))
    assert la[-1] < la[0]  # it trained, stale gradients and all
    if clip is None:
        assert la == lb
    off.flush()  # the last step's weights are still pending until now
    assert_same_training(ref, model, fused, off, exact=clip is None)
    c = off.counters()
    n = sum(p.numel() for p in model.parameters())
    size = torch.finfo(dtype).bits // 8
    # Still one gradient down and one weight up per parameter and step.
    assert c["bytes_down"] == c["bytes_up"] == 20 * n * size
    off.close()


@pytest.mark.parametrize("warmup", [1, 5])
def test_delay_warmup_takes_exact_steps_first(warmup):
    data = batches(12)
    ref = tiny_gpt(torch.float32)
    model = copy.deepcopy(ref)
    fused = FusedAdam(ref.parameters(), **HP)
    with OffloadAdam(model.parameters(), delay=True, delay_warmup=warmup, bucket_size=5000,
                     _host_delay_us=100.0, **HP) as off:
        la = train_stale_reference(ref, fused, data, warmup=warmup)
        lb = train(model, off, data)
        assert la == lb
        off.flush()
        assert_same_training(ref, model, fused, off)
        # the same run without the warm-up differs from the second step on
        other = copy.deepcopy(tiny_gpt(torch.float32))
        with OffloadAdam(other.parameters(), delay=True, delay_warmup=0, bucket_size=5000, **HP) as plain_delay:
            lc = train(other, plain_delay, data)
        assert lc[:1] == lb[:1] and lc[1] != lb[1]  # without it, step 2 already runs on stale weights


@pytest.mark.parametrize("mode", [dict(delay=True, delay_warmup=0),
                                  dict(delay=True, delay_correction=True, delay_warmup=1)])
def test_a_step_without_a_backward_does_nothing(mode):
    """A step() with no gradient since the last one (before training, or twice in a row) changes nothing: it
    neither installed delay's pending weights (a flush) nor counted towards the warm-up, so the run is the
    same, bit for bit, as the one without it."""
    data = batches(6)

    def run(empty_at):
        model = tiny_gpt(torch.float32)
        with OffloadAdam(model.parameters(), bucket_size=5000, **mode, **HP) as off:
            for k, (x, y) in enumerate(data):
                if k in empty_at:
                    off.step()
                model(x, y)[1].backward()
                finish_step(off)
            off.flush()
        return [p.detach().clone() for p in model.parameters()]
    base = run(())
    for empty_at in ((0,), (3,)):
        assert all(torch.equal(a, b) for a, b in zip(base, run(empty_at)))


def test_delay_warmup_counts_steps_from_a_checkpoint():
    model = tiny_gpt(torch.float32)
    with OffloadAdam(model.parameters(), delay=True, delay_warmup=3, **HP) as off:
        train(model, off, batches(2))
        sd = off.state_dict()
    again = tiny_gpt(torch.float32)
    with OffloadAdam(again.parameters(), delay=True, delay_warmup=3, **HP) as off:
        off.load_state_dict(sd)
        assert off._step_count == 2
    with pytest.raises(ValueError, match="delay_warmup: expected an int >= 0"):
        OffloadAdam(model.parameters(), delay=True, delay_warmup=-1)


def test_delay_leaves_the_weights_pending_until_the_next_backward_or_flush():
    data = batches(2)
    model = tiny_gpt(torch.bfloat16)
    w = model.lm_head.weight if hasattr(model, "lm_head") else next(model.parameters())
    before = w.detach().clone()
    off = OffloadAdam(model.parameters(), lr=1e-2, delay=True)
    x, y = data[0]
    model(x, y)[1].backward()
    off.step()
    off.zero_grad()
    assert torch.equal(w, before)  # step() returned without installing anything
    x, y = data[1]
    model(x, y)[1].backward()  # copies step 1's weights up as backward finishes with each
    off.step()  # orders what follows after those copies (and queues step 2)
    installed = w.detach().clone()
    assert not torch.equal(installed, before)
    off.flush()
    assert not torch.equal(w, installed)  # step 2's weights
    assert torch.equal(w, off.state[w]["master"].bfloat16())
    off.close()


def test_delay_checkpoint_is_flushed_and_resumes_exactly():
    data = batches(12)
    a = tiny_gpt(torch.bfloat16)
    opt_a = OffloadAdam(a.parameters(), delay=True, **HP)
    train(a, opt_a, data[:6])
    sd = copy.deepcopy(opt_a.state_dict())  # flushes: the model now holds step 6's weights
    weights = copy.deepcopy(a.state_dict())
    for p in a.parameters():
        assert torch.equal(p, opt_a.state[p]["master"].bfloat16())
    train(a, opt_a, data[6:])
    b = tiny_gpt(torch.bfloat16)
    b.load_state_dict(weights)
    opt_b = OffloadAdam(b.parameters(), delay=True, **HP)
    opt_b.load_state_dict(sd)
    train(b, opt_b, data[6:])
    opt_a.close()
    opt_b.close()  # close() flushes too
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("marked", [True, False], ids=["accumulating", "unmarked"])
def test_delay_with_accumulation(marked):
    """With all but the last micro-batch inside accumulating(), every micro-batch of a step
    runs on the weights of two steps back (one step stale); unmarked, the weights go up
    during the first micro-batch's backward and the later ones see them. The host backend's
    copies come late (random delays): the next forward must still see every one of them
    (the fence queued at the end of each backward)."""
    accum, steps = 3, 6
    data = batches(accum * steps)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    fused = FusedAdam(ref.parameters(), **HP)
    shadow = copy.deepcopy(ref)
    previous = [p.detach().clone() for p in ref.parameters()]
    expected = []
    for k in range(steps):
        current = [p.detach().clone() for p in ref.parameters()]
        for j, (x, y) in enumerate(data[k * accum:(k + 1) * accum]):
            with torch.no_grad():
                for s, w in zip(shadow.parameters(), previous if marked or j == 0 else current):
                    s.copy_(w)
            _, loss = shadow(x, y)
            (loss / accum).backward()
            expected.append(loss.item())
            for p, s in zip(ref.parameters(), shadow.parameters()):
                p.grad = s.grad if p.grad is None else p.grad + s.grad
                s.grad = None
        previous = current
        finish_step(fused)
    with OffloadAdam(model.parameters(), delay=True, _host_delay_us=300.0, **HP) as off:
        losses = []
        for k in range(steps):
            for j, (x, y) in enumerate(data[k * accum:(k + 1) * accum]):
                with off.accumulating() if marked and j < accum - 1 else contextlib.nullcontext():
                    _, loss = model(x, y)
                    (loss / accum).backward()
                losses.append(loss.item())
            finish_step(off)
        assert losses == expected
        off.flush()
        assert_same_training(ref, model, fused, off)
        n = sum(p.numel() for p in model.parameters())
        c = off.counters()
        assert c["bytes_down"] == accum * steps * n * 2 and c["bytes_up"] == steps * n * 2


def test_delay_parameters_without_gradients_in_some_steps():
    """A parameter left out of a step keeps its pending weights until it is installed
    (at step() once its update is done, at its next gradient, or by flush())."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(300).bfloat16()), torch.nn.Parameter(torch.randn(50).bfloat16())
    with OffloadAdam([a, b], lr=1e-2, delay=True, bucket_size=100, _host_delay_us=100.0) as off:
        for step in range(8):
            used = [a, b] if step % 3 else [a]
            sum((p.float() ** 2).sum() for p in used).backward()
            off.step()
            off.zero_grad()
        off.flush()
        for p in (a, b):
            assert torch.equal(p, off.state[p]["master"].bfloat16())
        assert float(off.state[a]["step"]) == 8 and float(off.state[b]["step"]) == 5


def test_delay_failing_update_raises_at_the_next_backward_and_installs_nothing():
    model = tiny_gpt(torch.bfloat16)
    off = OffloadAdam(model.parameters(), lr=1e-3, delay=True)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    off._engine.fail_next_update("simulated failure in the update worker")
    off.step()  # returns at once; the update fails on the worker
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="update worker failed: simulated failure"):
        model(x, y)[1].backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(RuntimeError, match="simulated failure"):
        off.close()  # its flush reports the failure; the engine is closed anyway
    assert off._engine.closed


def test_delay_update_failing_after_earlier_buckets_went_up_says_the_model_holds_part_of_a_step():
    """Each install waits for its own bucket's update only, so a later bucket's failure can land after the
    next backward installed the earlier buckets' weights: the error says so (and how many), not that
    nothing was installed. The second bucket's update fails 1.5 s in, long after the first bucket's
    weights went up at the start of the backward."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 8, bias=False),
                            torch.nn.Tanh(), torch.nn.Linear(8, 1, bias=False))
    off = OffloadAdam(m.parameters(), lr=0.1, delay=True, bucket_size=1)   # a bucket per layer, last first
    x = torch.randn(4, 8)
    m(x).sum().backward()
    off._engine.fail_next_update("simulated failure in the update worker", after=1, delay_ms=1500)
    off.step()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match=r"simulated failure .*after 1 parameters had received that step's new "
                                           "weights.*holds part of a step"):
        m(x).sum().backward()
    changed = [not torch.equal(a, b) for a, b in zip(before, m.parameters())]
    assert changed == [False, False, True]   # the last layer (bucket 0) went up, nothing else
    with pytest.raises(RuntimeError, match="simulated failure"):
        off.close()


def test_delay_and_overlap_are_exclusive():
    with pytest.raises(ValueError, match="overlap, delay"):
        OffloadAdam([torch.nn.Parameter(torch.randn(4))], overlap=True, delay=True)


def test_delay_parameter_with_gradients_only_inside_accumulating_is_installed():
    """Its gradients never reach a backward outside accumulating(), so step() installs its
    pending weights before queueing the next update (which would otherwise supersede them)."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(64).bfloat16()), torch.nn.Parameter(torch.randn(64).bfloat16())
    initial = b.detach().clone()
    with OffloadAdam([a, b], lr=1e-2, delay=True, _host_delay_us=100.0) as off:
        seen = []
        for step in range(4):
            with off.accumulating():
                ((a.float() ** 2).sum() + (b.float() ** 2).sum()).backward()
            (a.float() ** 2).sum().backward()  # the last micro-batch does not use b
            off.step()
            off.zero_grad()
            seen.append(b.detach().clone())
        # step() k installs the update of step k-1: b moves from the second step on.
        assert torch.equal(seen[0], initial)
        assert all(not torch.equal(s, initial) for s in seen[1:])
        off.flush()
        assert torch.equal(b, off.state[b]["master"].bfloat16())


def _reentrant_checkpointing(model):
    """Each block under torch.utils.checkpoint(use_reentrant=True): its recompute's backward runs as an
    autograd graph task of its own, nested in the outer backward's."""
    from torch.utils.checkpoint import checkpoint
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=True)
    return model


@pytest.mark.parametrize("mode", ["delay", "overlap"])
def test_reentrant_checkpointing_nests_a_backward_that_is_not_a_failure(mode):
    """A nested graph task was taken for a new backward after one that raised: delay installed pending
    weights that the running backward still read (layer 0's gradient off by 0.0085 of 0.0128 after two
    steps), overlap refused the step ("a backward raised after 3 parameter updates"). Both now train as
    FusedAdam does on the same (stale, for delay) gradients, bit for bit."""
    data = batches(8)
    ref = tiny_gpt(torch.float32, n_layer=3)
    model = _reentrant_checkpointing(copy.deepcopy(ref))
    fused = FusedAdam(ref.parameters(), **HP)
    off = OffloadAdam(model.parameters(), bucket_size=500, **{mode: True}, **HP)
    la = (train_stale_reference if mode == "delay" else train)(ref, fused, data)
    lb = train(model, off, data)
    assert la == lb and la[-1] < la[0]
    off.flush()
    assert_same_training(ref, model, fused, off)
    off.close()


def test_backward_depth_counts_the_outer_call_on_a_device_thread():
    """On a GPU the hooks run on autograd's device thread (made in C++), whose stack lacks the outer
    backward's frame: depth 0 there made a reentrant checkpoint's inner backward (1) count as a new one,
    and delay warned of mixed micro-batches at every layer. Such a thread counts the outer call."""
    import _thread
    import threading
    from effmem.optim._offload_guards import _backward_depth
    seen, done = [], threading.Event()

    def run():
        seen.append(_backward_depth())
        done.set()
    _thread.start_new_thread(run, ())   # a thread threading did not start: Python sees a _DummyThread
    assert done.wait(10)
    plain = []
    t = threading.Thread(target=lambda: plain.append(_backward_depth()))
    t.start()
    t.join()
    assert seen == [1] and plain == [0]


@pytest.mark.parametrize("device,copy_delay_us,attached", [
    ("cpu", 0, False), ("cpu", 5000, False), ("cpu", 5000, True),
    pytest.param("cuda", 0, False, marks=pytest.mark.cuda), pytest.param("cuda", 0, True, marks=pytest.mark.cuda)])
def test_delay_retry_after_a_failed_backward_takes_the_gradients_of_the_forward_that_ran(device, copy_delay_us,
                                                                                          attached, monkeypatch):
    """A backward that raised, then the next one without zero_grad() (a skipped micro-batch): the failed
    task stays open, and the retry's first hook used to install every pending weight mid-backward. Now the
    retry's gradients are those of the weights its forward read (its sum with what the failed one handed
    over, as torch's .grad would hold). The weights the failed backward installed (the last layer's) were
    never fenced (its end-of-backward callback never runs), so a slow copy landed between the user's reads
    (1 run in hundreds under load; every run with the copy delayed and a pause before the forward). Now the
    failed task's end fences; attached, the model's forward pre-hook does too (on a GPU autograd's device
    thread may free the task after backward() has raised): tested here with the first taken away. On a GPU
    (the copy delay is the host backend's) the uploads' stream order is what the fences give."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                            torch.nn.Linear(8, 1)).to(device)
    opt = OffloadAdam(m.parameters(), lr=0.1, delay=True, bucket_size=1, _host_delay_us=copy_delay_us)
    if attached:
        opt.attach(m)
        monkeypatch.setattr(_offload_guards, "_fence_unless_reached", lambda *args: None)
    x = [torch.randn(4, 8, generator=torch.Generator().manual_seed(k)).to(device) for k in range(3)]
    for k in range(2):   # an update is pending after these
        m(x[k]).sum().backward()
        opt.step()
        opt.zero_grad()

    def fail(g):
        raise ValueError("a user hook failed")
    h = m[2](m[1](m[0](x[2])))
    h.register_hook(fail)   # after the last layer's gradients were handed over
    with pytest.raises(ValueError, match="a user hook failed"):
        m[4](m[3](h)).sum().backward()
    got = {}
    m[0].weight.register_hook(lambda g: got.setdefault("g", g.clone()))

    def take_weights(*_):
        got["used"] = copy.deepcopy(m)   # the weights the retry's forward reads
        time.sleep(0.02)                 # a copy still in flight would land here
    if attached:   # the fence is the forward's: read where the forward reads, after attach's pre-hook
        m.register_forward_pre_hook(take_weights)
    else:
        if device == "cuda":   # the fence comes when autograd's device thread frees the failed task, which may be
            torch.cuda.synchronize()   # after backward() raised: waited for, the gradients are what is tested
        take_weights()
    m(x[1]).sum().backward()
    used = got["used"]
    want = torch.autograd.grad(used(x[1]).sum(), used[0].weight)[0]
    assert torch.equal(got["g"], want)
    opt.close()


def test_overlap_backward_after_one_that_raised_before_any_update_steps_as_torch_would():
    """overlap: a backward that raised midway, after the last block's gradients were handed over but before any
    bucket was updated (one bucket), then a whole one without zero_grad(): the step is FusedAdam's on what
    torch's .grad would hold (the failed backward's partial gradients plus the whole one's), not refused
    for the updates the second backward made (charged to the failed one while it stayed open)."""
    data = batches(3)
    ref = tiny_gpt(torch.float32)
    model = copy.deepcopy(ref)
    fused = FusedAdam(ref.parameters(), **HP)
    off = OffloadAdam(model.parameters(), bucket_size=1 << 20, overlap=True, **HP)
    train(ref, fused, data[:2])
    train(model, off, data[:2])

    def fail(g):
        raise ValueError("a user hook failed")
    for m, opt in ((ref, fused), (model, off)):
        handle = m.blocks[0].register_forward_hook(lambda mod, args, out: out.register_hook(fail) and None)
        _, loss = m(*data[2])
        handle.remove()
        with pytest.raises(ValueError, match="a user hook failed"):
            loss.backward()
        m(*data[2])[1].backward()
        opt.step()
        opt.zero_grad()
    assert_same_training(ref, model, fused, off)
    off.close()
