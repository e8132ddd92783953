"""FusedAdam checkpoints and gradient scaling."""
import io

import pytest
import torch

import effmem
from conftest import DEVICES



def tiny_model(dtype, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 5))
    return model.to(device=device, dtype=dtype)


def train(model, opt, steps, first_step=0):
    for i in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, 33, generator=g).to(next(model.parameters()))
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def state_tensors(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        for key in sorted(opt.state[p]):
            out.append(opt.state[p][key].clone())
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_resume_from_checkpoint_is_bit_identical(device, dtype):
    model = tiny_model(dtype, device)
    opt = effmem.FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, opt, 5)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, 5, first_step=5)
    expected = state_tensors(model, opt)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = tiny_model(dtype, device)
    resumed.load_state_dict(ckpt["model"])
    opt2 = effmem.FusedAdam(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(ckpt["opt"])
    for p in resumed.parameters():
        for key, t in opt2.state[p].items():
            assert t.dtype == torch.float32, f"{key} must stay float32 after loading"
    train(resumed, opt2, 5, first_step=5)
    got = state_tensors(resumed, opt2)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_state_dict_layout_is_torch_optim_plus_master():
    model = tiny_model(torch.bfloat16, "cpu")
    opt = effmem.FusedAdam(model.parameters())
    train(model, opt, 1)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3]


def test_loads_a_torch_adamw_checkpoint():
    """Moments from torch.optim.AdamW carry over; masters come from the params at the next step (weights
    loaded after the optimizer's checkpoint are the ones trained on)."""
    model = tiny_model(torch.bfloat16, "cpu")
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, torch_opt, 2)
    opt = effmem.FusedAdam(model.parameters(), lr=1e-3)
    opt.load_state_dict(torch_opt.state_dict())
    for p in model.parameters():
        st = opt.state[p]
        assert torch.equal(st["exp_avg"], torch_opt.state[p]["exp_avg"].float())
        assert "master" not in st and "master" not in opt.state_dict()["state"][0]
        assert st["step"].item() == 2
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 1, first_step=2)
    for p, old in zip(model.parameters(), before):
        st = opt.state[p]
        assert st["step"].item() == 3 and torch.equal(st["master"].to(p.dtype), p.detach())
        assert (p.float() - old.float()).abs().max() <= 2e-3   # one step of lr 1e-3 from the loaded weights


def test_loading_does_not_alias_the_checkpoint():
    model = tiny_model(torch.float32, "cpu")
    opt = effmem.FusedAdam(model.parameters())
    train(model, opt, 1)
    sd = opt.state_dict()
    saved = {k: v.clone() for k, v in sd["state"][0].items()}
    opt2 = effmem.FusedAdam(model.parameters())
    opt2.load_state_dict(sd)
    train(model, opt2, 2, first_step=1)
    for k, v in saved.items():
        assert torch.equal(sd["state"][0][k], v), f"loading then stepping changed the checkpoint's {k}"


@pytest.mark.parametrize("device", DEVICES)
def test_inv_scale_and_found_inf(device):
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.randn(1000, device=device).half())
    q = torch.nn.Parameter(p.detach().clone())
    a, b = effmem.FusedAdam([p], lr=1e-2), effmem.FusedAdam([q], lr=1e-2)
    g = torch.randn(1000, device=device).half()
    p.grad = g * 1024
    q.grad = g.clone()
    one = torch.ones(1, device=device)
    a.step(inv_scale=one / 1024, found_inf=one * 0)
    b.step()
    assert torch.equal(p.detach(), q.detach())  # a power-of-two scale is exact
    # Adam's first step is the gradient's sign whatever its scale: the moments are what see inv_scale.
    assert torch.equal(a.state[p]["exp_avg"], b.state[q]["exp_avg"])

    before = [p.detach().clone(), a.state[p]["master"].clone(), a.state[p]["exp_avg"].clone()]
    p.grad = torch.full_like(p, float("inf"))
    a.step(inv_scale=one / 1024, found_inf=one)
    assert torch.equal(p.detach(), before[0])
    assert torch.equal(a.state[p]["master"], before[1])
    assert torch.equal(a.state[p]["exp_avg"], before[2])
    assert a.state[p]["step"].item() == 1, "a skipped step must not advance the step count"
    # GradScaler sums found_inf over devices: 2 must skip too, not step backwards
    a.step(inv_scale=one / 1024, found_inf=one * 2)
    assert a.state[p]["step"].item() == 1
    assert torch.equal(p.detach(), before[0])


def test_grad_scaler_drives_the_fused_step():
    """torch.amp.GradScaler passes its scale and found_inf; results match unscaled training."""
    model = tiny_model(torch.float32, "cpu")
    twin = tiny_model(torch.float32, "cpu")
    opt = effmem.FusedAdam(model.parameters(), lr=1e-2)
    opt_twin = effmem.FusedAdam(twin.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(8, 33)
    for _ in range(3):
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        twin(x).square().mean().backward()
        opt_twin.step()
        opt_twin.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    # an overflow: the step is skipped and the scale drops
    params_before = [p.detach().clone() for p in model.parameters()]
    (model(x).square().mean() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    for p, b in zip(model.parameters(), params_before):
        assert torch.equal(p.detach(), b)


def test_moments_put_in_by_hand_in_another_layout_are_taken():
    """A channels_last (or transposed) parameter whose moments were reset with torch.zeros(p.shape): torch's
    AdamW takes any layout, FusedAdam's kernel refused the strides; they are copied to the parameter's."""
    for make in (lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), lambda: torch.randn(7, 5).t()):
        torch.manual_seed(0)
        p = torch.nn.Parameter(make())
        q = torch.nn.Parameter(p.detach().clone())
        mine, ref = effmem.FusedAdam([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2, weight_decay=0.0)
        for step in range(4):
            g = torch.randn(p.shape)
            p.grad, q.grad = g.clone(), g.clone()
            if step == 2:
                for opt, t in ((mine, p), (ref, q)):
                    opt.state[t]["exp_avg"] = torch.zeros(t.shape)
            mine.step()
            ref.step()
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
        assert mine.state[p]["exp_avg"].stride() == p.stride()
