"""CUDA-only behaviour: same bits as the CPU kernels, graph capture, no host syncs."""
import pytest
import torch

import effmem

pytestmark = pytest.mark.cuda


def make(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    # (1 << 16) + 3 spans several chunks and ends in a tail that is not a whole vector
    shapes = [(1,), (7,), (4097,), (64, 33), (3, 5, 7), ((1 << 16) + 3,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in shapes]
    grads = [[torch.randn(p.shape, generator=g).to(device=device, dtype=dtype) for p in params] for _ in range(5)]
    return params, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_and_cpu_kernels_give_identical_bits(dtype):
    results = []
    for device in ("cpu", "cuda"):
        params, grads = make(dtype, device)
        opt = effmem.FusedAdam(params, lr=1e-2, weight_decay=0.1)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g
            opt.step()
        results.append([p.detach().cpu() for p in params] +
                       [t.cpu() for p in params for t in opt.state[p].values()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_step_runs_without_host_sync():
    params, grads = make(torch.bfloat16, "cuda")
    opt = effmem.FusedAdam(params, lr=torch.tensor(1e-3, device="cuda"))
    found_inf = torch.zeros(1, device="cuda")
    inv_scale = torch.ones(1, device="cuda")
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()  # first step allocates state
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step(inv_scale=inv_scale, found_inf=found_inf)
        opt.clip_grad_norm_(1.0)
        effmem.clip_grad_norm_(params, 1.0)
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_step_captures_in_a_cuda_graph():
    params, grads = make(torch.bfloat16, "cuda")
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    lr = torch.tensor(1e-3, device="cuda")
    opt = effmem.FusedAdam(params, lr=lr)
    ref = effmem.FusedAdam(twins, lr=1e-3)
    for p, q, g in zip(params, twins, grads[0]):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()  # warm-up allocates state outside the graph
    ref.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for step_grads in grads[1:]:
        for p, q, g in zip(params, twins, step_grads):
            p.grad.copy_(g)
            q.grad = g.clone()
        graph.replay()
        ref.step()
    torch.cuda.synchronize()
    for p, q in zip(params, twins):
        assert torch.equal(p.detach(), q.detach())
    assert opt.state[params[0]]["step"].item() == len(grads)


@pytest.mark.parametrize("bad", ["lr_nan", "lr_negative", "step_fraction"])
def test_the_kernel_refuses_bad_device_values_and_the_next_step_reports_it(bad):
    """Values that change on the device cannot be checked on the host without a sync: the kernel
    leaves the parameters alone, ORs a flag into the status, and the next step() raises."""
    params, grads = make(torch.bfloat16, "cuda")
    lr = torch.tensor(1e-3, device="cuda")
    opt = effmem.FusedAdam(params, lr=lr)
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()
    if bad == "lr_nan":
        lr.fill_(float("nan"))
    elif bad == "lr_negative":
        lr.fill_(-1.0)
    else:
        opt.state[params[0]]["step"].fill_(0.5)
    before = [p.detach().clone() for p in params]
    steps_before = [opt.state[p]["step"].clone() for p in params]
    opt.step()                                   # refused on the device: no error yet, no sync
    torch.cuda.synchronize()
    refused = len(params) if bad.startswith("lr") else 1   # the lr: every tensor; a step count: its own
    for k, (p, b) in enumerate(zip(params, before)):
        assert torch.equal(p.detach(), b) == (k < refused)
    if bad.startswith("lr"):                     # a refused lr does not count as a step
        assert all(torch.equal(opt.state[p]["step"], s) for p, s in zip(params, steps_before))
    with pytest.raises(RuntimeError, match="was refused" + (" \\(an lr tensor" if bad.startswith("lr") else
                                                             " \\(a step count")):
        opt.step()


def test_op_refuses_aliases_and_bad_steps_on_cuda():
    p = torch.randn(8, device="cuda")
    args = ([p], [torch.randn(8, device="cuda")], [p], [torch.zeros(8, device="cuda")], [],
            [torch.ones((), device="cuda")])
    with pytest.raises(ValueError, match="share memory"):
        torch.ops.effmem.adam_step_(*args, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    before = p.clone()
    torch.ops.effmem.adam_step_([p], [torch.randn(8, device="cuda")], [torch.zeros(8, device="cuda")],
                                [torch.zeros(8, device="cuda")], [], [torch.zeros((), device="cuda")],
                                1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, status=status)
    assert status.item() == 2 and torch.equal(p, before)
