"""torch.amp.GradScaler with effmem's optimizers: each against its own unscaled run bit for bit, and against
torch's AdamW under the same scaler (test_the_scaled_runs_match_torch_adamw_under_the_same_scaler).

FusedAdam takes the scale into its kernel (GradScaler's fused protocol). OffloadAdam with stream_grads=False
keeps the gradients in p.grad until step(), so GradScaler's own path (unscale in place, skip step() on an
inf) applies to it as to torch's AdamW; where its gradients leave during backward it is refused before
anything changes. The scale is a power of two (GradScaler's always are), so scaling and unscaling are exact
and a scaled run equals an unscaled one bit for bit."""
import pytest
import torch

import effmem

STEPS, INF_AT = 5, 2


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def train(m, opt, scaler=None, clip=None, unscale=True):
    """STEPS steps; at step INF_AT the loss is inf (the scaler skips that step). clip: opt.clip_grad_norm_'s
    max_norm, after scaler.unscale_ when unscale."""
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(m(x.to(next(m.parameters()).dtype)).float(), y)
        if step == INF_AT and scaler is not None:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            if clip is not None:
                opt.clip_grad_norm_(clip)
            opt.step()
        else:
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(opt)
            if clip is not None:
                opt.clip_grad_norm_(clip)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


def unscaled_reference(make, dtype=torch.float32, clip=None):
    """The same run without a scaler, the inf step left out as the scaler skips it."""
    m = model(dtype)
    opt = make(m)
    opt.m = m
    for step in range(STEPS):
        if step == INF_AT:
            continue
        x, y = batch(step)
        torch.nn.functional.mse_loss(m(x.to(dtype)).float(), y).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()], opt


# device_state: the first layer's state on the device
MODES = {"default": {}, "async_step": dict(async_step=True), "device_state": dict(device_state=1200)}


def offload(mode, **kw):
    """An OffloadAdam for a module (async_step: attached to it)."""
    def make(m):
        opt = effmem.OffloadAdam(m.parameters(), lr=1e-2, **MODES[mode], **kw)
        if mode == "async_step":
            opt.attach(m)
        return opt
    return make


def weights(m, opt):
    opt.flush()   # async_step: the last step's weights, installed by the next forward otherwise
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("clip", [None, 0.05], ids=["noclip", "clip"])
def test_offload_adam_without_streaming_takes_grad_scaler_as_torch_adamw_does(mode, clip):
    """stream_grads=False: GradScaler unscales p.grad, skips the inf step (no step counted), and the run equals
    the unscaled one without that step bit for bit. Refused in every mode before."""
    m = model()
    opt = offload(mode, stream_grads=False)(m)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    train(m, opt, scaler, clip=clip)
    assert scaler.get_scale() == 2.0 ** 9   # backed off once, at the inf step
    want, ref = unscaled_reference(offload(mode, stream_grads=False), clip=clip)
    for a, b in zip(weights(m, opt), weights(ref.m, ref)):
        assert torch.equal(a, b)
    assert {float(s["step"]) for s in opt.state_dict()["state"].values()} == {STEPS - 1.0}
    opt.close()
    ref.close()


@pytest.mark.parametrize("mode", ["stream", "overlap", "delay", "async_step"])
@pytest.mark.parametrize("unscale", [False, True], ids=["scaled", "unscaled_first"])
def test_streaming_offload_adam_refuses_grad_scaler_before_anything_changes(mode, unscale):
    """Gradients taken during backward: GradScaler can neither unscale nor check them. Refused at step() with
    what to do, whether GradScaler sets grad_scale (not unscaled) or only found_inf (after unscale_: the path
    accelerate's wrapped step() took, which let the inf step through before: NaN weights, or torch's "No inf
    checks were recorded" after the update was taken). The scaled gradients are dropped, not applied by a
    later step, and the next plain step is not refused."""
    kw = {"stream": {}, "overlap": dict(overlap=True), "delay": dict(delay=True),
          "async_step": dict(async_step=True)}[mode]
    m = model()
    opt = effmem.OffloadAdam(m.parameters(), lr=1e-2, **kw)
    if mode == "async_step":
        opt.attach(m)
    before = [p.detach().clone() for p in m.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = batch(0)
    scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
    if unscale:
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="GradScaler needs the gradients in p.grad at step"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    if mode == "overlap":   # its backward had updated the parameters: refused until the caller chooses
        with pytest.raises(RuntimeError, match="already updated the parameters during backward"):
            opt.step()
        opt.accept_partial_step()
    else:
        opt.flush()
        assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    # a plain step afterwards: this backward's gradients only, as a fresh optimizer steps from here
    start = [p.detach().clone() for p in m.parameters()]
    fresh = model()
    with torch.no_grad():
        for q, s in zip(fresh.parameters(), start):
            q.copy_(s)
    ref = effmem.OffloadAdam(fresh.parameters(), lr=1e-2, **kw)
    if mode == "async_step":
        ref.attach(fresh)
    for mm, o in ((m, opt), (fresh, ref)):
        x, y = batch(1)
        torch.nn.functional.mse_loss(mm(x), y).backward()
        if mode != "overlap":
            o.step()
        o.zero_grad()
    if mode == "overlap":   # overlap's backward updated: the refused step's update stays (accepted above)
        assert all(torch.isfinite(p).all() for p in m.parameters()) and not torch.equal(m[0].weight, start[0])
    else:
        for a, b in zip(weights(m, opt), weights(fresh, ref)):
            assert torch.equal(a, b)
    opt.close()
    ref.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("unscale", [True, False], ids=["unscaled_first", "clipped_while_scaled"])
def test_fused_adam_with_grad_scaler_equals_the_unscaled_run(dtype, unscale):
    """FusedAdam takes grad_scale and found_inf into its kernel. Clipped before unscale_ (fp16 gradients,
    which GradScaler cannot unscale in place, leave no other way), the clip factor came from the scaled norm:
    1024x too small a clip here, the weights 6.5e-3 off in the reviewer's run. It now comes from the norm of
    the gradients the step applies."""
    m = model(dtype)
    opt = effmem.FusedAdam(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    got = train(m, opt, scaler, clip=0.05, unscale=unscale)
    want, ref = unscaled_reference(lambda m: effmem.FusedAdam(m.parameters(), lr=1e-2), dtype, clip=0.05)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for p, q in zip(opt.state, ref.state):
        assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
        assert float(opt.state[p]["step"]) == STEPS - 1.0


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("unscale_after", [False, True], ids=["no_unscale", "unscale_after_clip"])
def test_offload_adam_clipped_before_unscale_is_refused_with_the_order_to_use(mode, unscale_after):
    """stream_grads=False, opt.clip_grad_norm_ before the scaler unscales: the clip sent the scaled gradients to
    the host. With scaler.step alone GradScaler found no gradients and failed with its own "No inf checks were
    recorded"; with scaler.unscale_(opt) after the clip the step applied the scaled gradients (an inf among them
    made the weights NaN). The clip now leaves them in p.grad, where the scaler unscales and checks them, and
    step() refuses the changed gradients with the order to use; nothing changed, and the next step is a fresh
    optimizer's."""
    m = model()
    opt = offload(mode, stream_grads=False)(m)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = batch(0)
    scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
    opt.clip_grad_norm_(0.05)
    if unscale_after:
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="changed in p.grad after opt.clip_grad_norm_"):
        scaler.step(opt)
    start = weights(m, opt)
    assert all(torch.equal(a, b) for a, b in zip(start, model().parameters()))
    fresh = model()
    ref = offload(mode, stream_grads=False)(fresh)
    for mm, o in ((m, opt), (fresh, ref)):
        x, y = batch(1)
        torch.nn.functional.mse_loss(mm(x), y).backward()
        o.clip_grad_norm_(0.05)
        o.step()
        o.zero_grad()
    for a, b in zip(weights(m, opt), weights(fresh, ref)):
        assert torch.equal(a, b)
    opt.close()
    ref.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_adam_clipped_before_an_explicit_unscale_equals_the_unscaled_run(dtype):
    """clip_grad_norm_, then scaler.unscale_(opt), then scaler.step: the clip's norm was the scaled gradients'
    and its factor was applied to the unscaled ones (the update 0.22x the right one in a reviewer's run). The
    factor now comes from the gradients the step applies."""
    m = model(dtype)
    opt = effmem.FusedAdam(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(m(x.to(dtype)).float(), y)
        scaler.scale(loss * float("inf") if step == INF_AT else loss).backward()
        opt.clip_grad_norm_(0.05)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    want, _ = unscaled_reference(lambda m: effmem.FusedAdam(m.parameters(), lr=1e-2), dtype, clip=0.05)
    for a, b in zip(m.parameters(), want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", list(MODES))
def test_offload_adam_after_a_skipped_step_and_model_zero_grad_trains_as_torch_adamw_does(mode):
    """torch's recipe with model.zero_grad() at the top of the loop (as transformers' Trainer does): the inf
    step skipped by the scaler left its gradients in the engine, model.zero_grad() cleared p.grad only, and the
    next step refused its new gradients as "changed since the clip". The abandoned gradients are dropped now,
    and the run equals the one without that step bit for bit."""
    m = model()
    opt = offload(mode, stream_grads=False)(m)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(STEPS):
        m.zero_grad()
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(m(x), y)
        scaler.scale(loss * float("inf") if step == INF_AT else loss).backward()
        scaler.unscale_(opt)
        opt.clip_grad_norm_(0.05)
        scaler.step(opt)
        scaler.update()
    want, ref = unscaled_reference(offload(mode, stream_grads=False), clip=0.05)
    for a, b in zip(weights(m, opt), weights(ref.m, ref)):
        assert torch.equal(a, b)
    opt.close()
    ref.close()


@pytest.mark.parametrize("clip", [None, 0.05], ids=["noclip", "clip"])
def test_the_scaled_runs_match_torch_adamw_under_the_same_scaler(clip):
    """The references above are effmem's own unscaled runs, so a fault both paths share would pass them:
    torch.optim.AdamW under the same GradScaler (the inf step skipped, the clip after unscale_ by
    torch.nn.utils.clip_grad_norm_) is the outside reference, to float32 rounding (other operation orders)."""
    def torch_adamw(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)   # effmem's default
        opt.clip_grad_norm_ = lambda max_norm: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
        return opt

    runs = {}
    for name, make in (("torch", torch_adamw), ("fused", lambda m: effmem.FusedAdam(m.parameters(), lr=1e-2)),
                       ("offload", offload("default", stream_grads=False))):
        m = model()
        opt = make(m)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        train(m, opt, scaler, clip=clip)
        assert scaler.get_scale() == 2.0 ** 9, name   # the inf step skipped
        runs[name] = weights(m, opt) if name == "offload" else [p.detach().clone() for p in m.parameters()]
        if name == "offload":
            opt.close()
    start = [p.detach().clone() for p in model().parameters()]
    for name in ("fused", "offload"):
        for a, b, s in zip(runs[name], runs["torch"], start):
            assert not torch.equal(b, s) and torch.allclose(a, b, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("clip", [None, 0.05], ids=["noclip", "clip"])
def test_offload_adam_with_fp16_parameters_takes_the_scale_into_its_update_as_fused_adam(mode, clip):
    """fp16 parameters: GradScaler refuses to unscale their gradients in place ("Attempting to unscale FP16
    gradients", for torch's AdamW too), so OffloadAdam had no loss-scaling path at all. Without streaming it now
    takes grad_scale and found_inf into its update as FusedAdam does (the clip's factor from the unscaled norm,
    the inf step skipped and not counted): the same weights as FusedAdam under the same scaler, bit for bit."""
    runs = []
    for make in (offload(mode, stream_grads=False), lambda m: effmem.FusedAdam(m.parameters(), lr=1e-2)):
        m = model(torch.float16)
        opt = make(m)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        train(m, opt, scaler, clip=clip, unscale=False)
        assert scaler.get_scale() == 2.0 ** 9   # backed off once, at the inf step
        offloaded = isinstance(opt, effmem.OffloadAdam)
        runs.append(weights(m, opt) if offloaded else [p.detach().clone() for p in m.parameters()])
        assert {float(s["step"]) for s in opt.state_dict()["state"].values()} == {STEPS - 1.0}
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], model(torch.float16).parameters()))
