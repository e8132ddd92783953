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
