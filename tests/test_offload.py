"""OffloadAdam against FusedAdam, on the host transfer backend (the whole pipeline without a GPU).

Both optimizers run the same CPU kernel on the same gradients, so wherever
the math is the same the results must be bit-identical: the tests compare
with torch.equal. Clipping computes the global norm from differently split
partial sums (host staging spans vs l2norm's), which may differ in the last
bit, so there the bound is 1e-6 relative.
"""
import copy
import gc
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import effmem
from effmem import FusedAdam, OffloadAdam, demo_model
from effmem.cli import lr_lambda
from offload_helpers import HP, _null, assert_same_training, batches, tiny_gpt, train


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["plain", "accumulate", "clip", "overlap", "overlap_accumulate"])
def test_matches_fused_adam_over_20_steps(dtype, mode):
    accum = 2 if "accumulate" in mode else 1
    clip = 0.5 if mode == "clip" else None
    data = batches(20 * accum)
    ref = tiny_gpt(dtype)
    model = copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
    with OffloadAdam(demo_model.decay_groups(model, 0.1), overlap=mode.startswith("overlap"), bucket_size=5000,
                     **HP) as off:
        la = train(ref, fused, data, accum=accum, clip=clip)
        lb = train(model, off, data, accum=accum, clip=clip)
        assert la[-1] < la[0]  # it trained
        assert_same_training(ref, model, fused, off, exact=clip is None)
        if clip is None:
            assert la == lb
        c = off.counters()
        n = sum(p.numel() for p in model.parameters())
        size = torch.finfo(dtype).bits // 8
        # Every gradient down once per backward, every weight up once per step.
        assert c["bytes_down"] == 20 * accum * n * size
        assert c["bytes_up"] == 20 * n * size
        assert c["accumulations"] == (0 if accum == 1 else len(list(model.parameters())) * 20)


def test_lr_scheduler_and_param_groups():
    data = batches(12)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    groups = lambda m: [  # noqa: E731
        {"params": [p for n, p in m.named_parameters() if "blocks.0" in n], "lr": 1e-2},
        {"params": [p for n, p in m.named_parameters() if "blocks.0" not in n], "weight_decay": 0.0,
         "decoupled_weight_decay": False, "betas": (0.8, 0.99)},
    ]
    fused = FusedAdam(groups(ref), lr=3e-3, weight_decay=0.05)
    off = OffloadAdam(groups(model), lr=3e-3, weight_decay=0.05)
    train(ref, fused, data, sched=torch.optim.lr_scheduler.LambdaLR(fused, lr_lambda(12)))
    train(model, off, data, sched=torch.optim.lr_scheduler.LambdaLR(off, lr_lambda(12)))
    assert_same_training(ref, model, fused, off)
    assert off.param_groups[0]["lr"] == fused.param_groups[0]["lr"] != 1e-2
    off.close()


def test_add_param_group_after_training_carries_the_state_over():
    data = batches(8)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)

    def blocks(m):
        return [p for n, p in m.named_parameters() if n.startswith("blocks")]

    def rest(m):
        return [p for n, p in m.named_parameters() if not n.startswith("blocks")]

    fused, off = FusedAdam(blocks(ref), **HP), OffloadAdam(blocks(model), **HP)
    train(ref, fused, data[:4])
    train(model, off, data[:4])
    for p in rest(ref) + rest(model):  # not optimised so far: drop what they accumulated
        p.grad = None
    x, y = data[4]
    model(x, y)[1].backward()
    with pytest.raises(RuntimeError, match="after step"):   # gradients pending in the engine
        off.add_param_group({"params": rest(model), "lr": 1e-2})
    off.zero_grad()
    for p in rest(model):
        p.grad = None
    with pytest.raises(ValueError, match="lr"):              # a refused group changes nothing
        off.add_param_group({"params": rest(model), "lr": -1.0})
    assert len(off.param_groups) == 1
    fused.add_param_group({"params": rest(ref), "lr": 1e-2})
    off.add_param_group({"params": rest(model), "lr": 1e-2})
    train(ref, fused, data[4:])
    train(model, off, data[4:])
    assert_same_training(ref, model, fused, off)
    off.close()


def test_gradients_leave_p_grad_during_backward():
    model = tiny_gpt(torch.bfloat16)
    seen = []
    off = OffloadAdam(model.parameters(), lr=1e-3)
    # A hook registered after OffloadAdam's runs after it: the gradient is already gone.
    model.blocks[0].mlp[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    assert seen == [None]
    assert all(p.grad is None for p in model.parameters())
    assert off.counters()["bytes_down"] == 2 * sum(p.numel() for p in model.parameters())
    off.step()
    off.close()


def test_checkpoints_interchange_with_fused_adam(tmp_path):
    data = batches(16)
    for first, second in [(FusedAdam, OffloadAdam), (OffloadAdam, FusedAdam), (OffloadAdam, OffloadAdam)]:
        ref = tiny_gpt(torch.bfloat16)
        ref_opt = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
        train(ref, ref_opt, data)

        model = tiny_gpt(torch.bfloat16)
        opt = first(demo_model.decay_groups(model, 0.1), **HP)
        train(model, opt, data[:8])
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
        if isinstance(opt, OffloadAdam):
            opt.close()
        resumed = tiny_gpt(torch.bfloat16)
        ckpt = torch.load(tmp_path / "ckpt.pt")
        resumed.load_state_dict(ckpt["model"])
        opt2 = second(demo_model.decay_groups(resumed, 0.1), **HP)
        opt2.load_state_dict(ckpt["opt"])
        train(resumed, opt2, data[8:])
        assert_same_training(ref, resumed, ref_opt, opt2)
        if isinstance(opt2, OffloadAdam):
            opt2.close()


def test_loads_torch_adamw_checkpoint():
    ref = tiny_gpt(torch.float32)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    train(ref, torch_opt, batches(3))
    model = copy.deepcopy(ref)
    off = OffloadAdam(model.parameters(), lr=1e-3)
    off.load_state_dict(torch_opt.state_dict())
    for p, q in zip(model.parameters(), ref.parameters()):
        st = off.state[p]
        assert torch.equal(st["exp_avg"], torch_opt.state[q]["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"])
        assert float(st["step"]) == 3.0
    off.close()


def test_stress_hundreds_of_small_params_with_random_delays():
    torch.manual_seed(0)
    shapes = [tuple(int(s) for s in torch.randint(1, 40, (int(torch.randint(1, 3, ())),))) for _ in range(300)]
    shapes += [(4097,), (1,), (70000,)]
    ref = [nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    ps = [nn.Parameter(p.detach().clone()) for p in ref]
    fused = FusedAdam(ref, lr=1e-2)
    with OffloadAdam(ps, lr=1e-2, bucket_size=600, overlap=True, _host_delay_us=100.0) as off:
        for step in range(6):
            for micro in range(2):
                grads = [torch.randn(s).bfloat16() for s in shapes]
                for p, g in zip(ref, grads):
                    p.grad = g.clone() if p.grad is None else p.grad + g
                # Gradients arrive in a random order, as from a real backward.
                order = torch.randperm(len(ps)).tolist()
                ctx = off.accumulating() if micro == 0 else _null()
                with ctx:
                    loss = sum((ps[i].float() * grads[i].float()).sum() for i in order)
                    loss.backward()
            fused.step()
            fused.zero_grad()
            off.step()
            off.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(ref, ps))


def test_failing_worker_raises_and_never_hangs():
    model = tiny_gpt(torch.bfloat16)
    off = OffloadAdam(model.parameters(), lr=1e-3)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    off._engine.fail_next_update("simulated failure in the update worker")
    with pytest.raises(RuntimeError, match="update worker failed: simulated failure"):
        off.step()
    # Every later call raises the same error instead of training on half-updated state.
    with pytest.raises(RuntimeError, match="simulated failure"):
        off.step()
    with pytest.raises(RuntimeError, match="simulated failure"):
        model(x, y)[1].backward()
    off.close()
    with pytest.raises(RuntimeError, match="closed"):
        off.step()


@pytest.mark.parametrize("mode", [{}, dict(delay=True)], ids=["plain", "delay"])
def test_a_failed_worker_names_the_way_on_and_it_works(mode):
    """Every call after a worker failure reports it, load_state_dict and a new optimizer over the same parameters
    included: the message says what does work, and it does (close, then a checkpoint into a new optimizer)."""
    model = tiny_gpt(torch.bfloat16)
    off = OffloadAdam(model.parameters(), lr=1e-3, **mode)
    data = batches(3)
    model(*data[0])[1].backward()
    off.step()
    off.zero_grad()
    saved = copy.deepcopy((model.state_dict(), off.state_dict()))
    model(*data[1])[1].backward()
    off._engine.fail_next_update("simulated failure")
    with pytest.raises(RuntimeError, match=r"cannot go on: call close\(\).*into a new OffloadAdam"):
        off.step()
        off.flush()   # delay: the failure lands after step() returns
    try:
        off.close()
    except RuntimeError as e:
        assert mode and "simulated failure" in str(e)
    model.load_state_dict(saved[0])
    again = OffloadAdam(model.parameters(), lr=1e-3, **mode)
    again.load_state_dict(saved[1])
    model(*data[1])[1].backward()
    again.step()
    again.close()


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_1000_steps_allocate_nothing_per_step():
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(s).bfloat16()) for s in [(256, 256), (256,), (4097,), (64, 3)]]
    off = OffloadAdam(ps, lr=1e-4)
    grads = [torch.randn(p.shape).bfloat16() for p in ps]

    def run(steps):
        for _ in range(steps):
            for p, g in zip(ps, grads):
                p.grad = g
            off.clip_grad_norm_(1.0)
            off.step()
            off.zero_grad()

    run(50)
    gc.collect()
    before, rss_before = off.counters(), _rss_bytes()
    run(1000)
    gc.collect()
    after, rss_after = off.counters(), _rss_bytes()
    for key in ("engine_pinned_bytes", "engine_pageable_bytes", "process_pinned_bytes", "process_pageable_bytes"):
        assert after[key] == before[key], key
    assert after["param_updates"] - before["param_updates"] == 1000 * len(ps)
    # A leak of even one small allocation per step per parameter would show as
    # megabytes; measured growth is 0-100 KB (the allocator's own noise).
    assert rss_after - rss_before < 4 * 2**20, (rss_after - rss_before)
    off.close()


def test_unused_and_frozen_parameters():
    model = tiny_gpt(torch.bfloat16)
    model.pos_emb.weight.requires_grad_(False)
    extra = nn.Parameter(torch.ones(10).bfloat16())  # never used: never gets a gradient
    ref = copy.deepcopy(model)
    ref_extra = nn.Parameter(extra.detach().clone())
    fused = FusedAdam(list(ref.parameters()) + [ref_extra], lr=1e-3)
    off = OffloadAdam(list(model.parameters()) + [extra], lr=1e-3, overlap=True)
    data = batches(4)
    train(ref, fused, data)
    train(model, off, data)
    assert_same_training(ref, model, fused, off)
    assert torch.equal(extra, torch.ones(10).bfloat16()) and extra not in off.state   # as torch's: never stepped
    off.close()


def test_overlap_second_backward_without_accumulating_raises():
    model = tiny_gpt(torch.bfloat16)
    off = OffloadAdam(model.parameters(), lr=1e-3, overlap=True)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    with pytest.raises(RuntimeError, match="accumulating"):
        model(x, y)[1].backward()
    with pytest.raises(RuntimeError, match="overlap"):
        off.clip_grad_norm_(1.0)
    off.close()


def test_stream_grads_false_takes_grads_at_step():
    data = batches(5)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    fused = FusedAdam(ref.parameters(), lr=1e-3)
    off = OffloadAdam(model.parameters(), lr=1e-3, stream_grads=False)
    x, y = data[0]
    model(x, y)[1].backward()
    assert all(p.grad is not None for p in model.parameters())   # left alone until step()
    off.zero_grad()
    train(ref, fused, data)
    train(model, off, data)
    assert_same_training(ref, model, fused, off)
    off.close()


def test_state_views_survive_close_and_are_host_tensors():
    model = tiny_gpt(torch.bfloat16)
    off = OffloadAdam(model.parameters(), lr=1e-3)
    train(model, off, batches(2))
    sd = off.state_dict()
    off.close()
    off.close()  # twice is fine
    st = sd["state"][0]
    assert st["master"].device.type == "cpu" and st["master"].dtype == torch.float32
    assert torch.equal(st["master"].bfloat16(), next(model.parameters()).detach())
    assert float(st["step"]) == 2.0


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(lr=-1.0), ValueError, "lr"),
    (dict(eps=0.0), ValueError, "eps"),
    (dict(betas=(1.0, 0.9)), ValueError, "betas"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(bucket_size=0), ValueError, "bucket_size"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(backend="tpu"), ValueError, "backend"),
])
def test_bad_arguments_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        OffloadAdam([nn.Parameter(torch.randn(4))], **kwargs)


def test_bad_params_and_grads():
    w = torch.randn(8, 8)
    with pytest.raises(ValueError, match="share memory"):
        OffloadAdam([nn.Parameter(w), nn.Parameter(w[0])])
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        OffloadAdam([nn.Parameter(torch.randn(4).double())])
    with pytest.raises(ValueError, match="empty parameter list"):
        OffloadAdam([])
    p = nn.Parameter(torch.randn(4))
    off = OffloadAdam([p])
    p.grad = torch.randn(4).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        off.step()
    p.grad_dtype = None  # torch refuses a gradient of another dtype unless asked
    p.grad = torch.randn(4, dtype=torch.complex64)
    with pytest.raises(TypeError, match="grad"):
        off.step()
    with pytest.raises(TypeError, match="pickled"):
        copy.deepcopy(off)
    with pytest.raises(TypeError, match="ddp_module"):
        off.attach_ddp(nn.Linear(2, 2))
    off.close()


def test_grads_in_another_dtype_or_layout_are_converted():
    p = nn.Parameter(torch.randn(16, 8).bfloat16().t())   # transposed parameter
    ref = nn.Parameter(p.detach().clone())
    off, fused = OffloadAdam([p], lr=1e-2), FusedAdam([ref], lr=1e-2)
    g = torch.randn(8, 16)
    p.grad = g.bfloat16()               # contiguous: copied into p's layout for the staging
    ref.grad = g.bfloat16()
    off.step()
    fused.step()
    assert torch.equal(p, ref) and p.stride() == (1, 8)
    # A float32 gradient (allowed by grad_dtype=None) would be rounded to the parameter's dtype, where FusedAdam
    # steps it as it is (a float16 one past 65504 made the weights inf, silently: a reviewer's run): refused.
    p.grad_dtype = None
    p.grad = g.clone()
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(8, 16\)\) got a gradient of dtype torch.float32"):
        off.step()
    p.grad = g.bfloat16()   # the gradient is left for the caller: cast, it steps as FusedAdam
    ref.grad = g.bfloat16()
    off.step()
    fused.step()
    assert torch.equal(p, ref)
    assert off.counters()["bytes_down"] == 2 * 2 * p.numel()
    off.close()


def test_top_level_export():
    assert effmem.OffloadAdam is OffloadAdam


@pytest.mark.cuda
def test_cuda_matches_fused_adam_and_moves_2_bytes_per_param_each_way():
    data = [(x.cuda(), y.cuda()) for x, y in batches(10)]
    ref = tiny_gpt(torch.bfloat16).cuda()
    model = copy.deepcopy(ref)
    fused = FusedAdam(ref.parameters(), lr=1e-3)
    # The math attention kernel: the fused ones may reduce in a different order on each
    # call (atomics), and Adam's first steps are +-lr whatever the gradient's size.
    with OffloadAdam(model.parameters(), lr=1e-3) as off, sdpa_kernel(SDPBackend.MATH):
        assert off._engine.backend == "cuda"
        train(ref, fused, data)
        train(model, off, data)
        n = sum(p.numel() for p in model.parameters())
        c = off.counters()
        assert c["bytes_down"] == 10 * 2 * n and c["bytes_up"] == 10 * 2 * n
        assert c["engine_pinned_bytes"] > 0
        # The GPU and CPU kernels share the same formula; only the gradients' reduction
        # order on the GPU may differ, so compare within a tight bound.
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.cuda
def test_cuda_no_gradient_memory_left_after_backward():
    # 50M parameters: their bf16 gradients (100 MB) would not hide in the slack left for
    # cuBLAS's per-handle workspaces (32 MiB each on Hopper), which count as allocated.
    model = tiny_gpt(torch.bfloat16, n_layer=4, d_model=1024).cuda()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    off = OffloadAdam(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (8, 16), device="cuda")
    for _ in range(3):
        model(x, x)[1].backward()
        assert all(p.grad is None for p in model.parameters())  # handed over, not kept
        off.step()
        off.zero_grad()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    assert torch.cuda.memory_allocated() <= 1.5 * weights
    off.close()


def test_dropping_the_optimizer_with_copies_in_flight_does_not_hang():
    # The engine's destructor joins its threads; a copy thread may need the GIL to free a
    # gradient whose Python object is gone, so the destructor must not hold the GIL.
    code = """
import gc, torch, effmem
from torch import nn
ps = [nn.Parameter(torch.randn(64, 64)) for _ in range(20)]
opt = effmem.OffloadAdam(ps, lr=1e-3, _host_delay_us=20000.0)
sum((p * p).sum() for p in ps).backward()   # 20 copies of 20 ms each queued
del opt
gc.collect()
print("dropped")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "dropped" in proc.stdout, proc.stderr
