"""FusedAdam numerics: against float64 references, across dtypes, ISAs and threads.

Tolerances (why each value):
- master weights vs. a float64 reference after 20 steps: the fp32 kernel
  rounds each of ~10 ops per step (~6e-8 relative each); over 20 steps the
  error stays below 1e-6 of the tensor's scale. Elementwise relative error is
  meaningless for elements that pass near zero (any fp32 Adam, torch's fused
  one included, shows it), so the bound is |err| <= 1e-6 * max|ref| + 1e-12.
- exp_avg is a sum of terms that can cancel, so its error is bounded
  relative to the largest gradient seen rather than to its own size.
- bf16/fp16 params vs. master.to(dtype): exact (the kernel rounds to nearest
  even, like torch's cast).
- different ISAs, thread counts, and lr given as float or tensor: exact (the
  same IEEE operations in the same order; no FMA contraction).
"""
import functools

import pytest
import torch

import effmem
from effmem import ops, reference
from conftest import DEVICES, cpu_isa, cpu_isas

SHAPES = [(1,), (7,), (4097,), (64, 33), (3, 5, 7)]
LOW = [torch.bfloat16, torch.float16]


def assert_close_to_reference(actual, expected, rel=1e-6, scale=None):
    """|actual - expected| <= rel * scale, scale defaulting to max|expected|."""
    err = (actual.double() - expected.double()).abs().max().item()
    if scale is None:
        scale = expected.double().abs().max().item()
    bound = rel * scale + 1e-12
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"


def make_params(dtype, device, shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in shapes]


def random_grads(params, noncontiguous=False):
    grads = []
    for p in params:
        if noncontiguous and p.dim() >= 2:
            # same values, transposed storage: the optimizer must not care
            g = torch.randn(tuple(reversed(p.shape)), device=p.device).to(p.dtype)
            g = g.permute(*reversed(range(p.dim())))
        else:
            g = torch.randn(p.shape, device=p.device).to(p.dtype)
        grads.append(g)
    return grads


def run_fused(params, grads_per_step, **kw):
    opt = effmem.FusedAdam(params, **kw)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return opt


def run_reference(init, grads_per_step, lr, betas, eps, weight_decay, decoupled):
    """float64 reference, one param at a time, from the same initial values."""
    ws = [p.detach().double().clone() for p in init]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t, grads in enumerate(grads_per_step, start=1):
        for w, m, v, g in zip(ws, ms, vs, grads):
            reference.adam_step(w, g.double(), m, v, t, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                                weight_decay=weight_decay, decoupled=decoupled)
    return ws, ms, vs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_matches_float64_reference(device, dtype, decoupled, noncontiguous):
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    params = make_params(dtype, device)
    init = [p.detach().clone() for p in params]
    grads = [random_grads(params, noncontiguous) for _ in range(20)]
    opt = run_fused(params, grads, decoupled_weight_decay=decoupled, **hyper)
    ws, ms, vs = run_reference(init, grads, decoupled=decoupled, **hyper)
    for i, (p, w, m, v) in enumerate(zip(params, ws, ms, vs)):
        state = opt.state[p]
        master = state.get("master", p)
        assert master.dtype == torch.float32
        assert_close_to_reference(master, w)
        g_max = max(g[i].double().abs().max().item() for g in grads)
        assert_close_to_reference(state["exp_avg"], m, scale=g_max)
        assert_close_to_reference(state["exp_avg_sq"], v)
        assert state["step"].item() == 20
        if dtype != torch.float32:
            assert torch.equal(p.detach(), master.to(dtype)), "low-precision param must equal master.to(dtype)"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_matches_torch_fused_adamw(device, weight_decay):
    params = make_params(torch.float32, device)
    twins = reference.clone_params(params)
    grads = [random_grads(params) for _ in range(20)]
    run_fused(params, grads, lr=1e-3, weight_decay=weight_decay)
    opt = torch.optim.AdamW(twins, lr=1e-3, weight_decay=weight_decay, fused=True)
    for step_grads in grads:
        for p, g in zip(twins, step_grads):
            p.grad = g.clone()
        opt.step()
    for p, q in zip(params, twins):
        assert_close_to_reference(p.detach(), q.detach())


def test_one_optimizer_mixes_dtypes_and_groups():
    fp32, bf16, fp16 = (make_params(d, "cpu", [(300,), (5, 9)]) for d in (torch.float32, torch.bfloat16,
                                                                           torch.float16))
    groups = [{"params": fp32 + bf16}, {"params": fp16, "lr": 1e-2, "weight_decay": 0.0}]
    opt = effmem.FusedAdam(groups, lr=1e-3, weight_decay=0.01)
    for p in fp32 + bf16 + fp16:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in fp32 + bf16 + fp16]
    opt.step()
    for p, b in zip(fp32 + bf16 + fp16, before):
        assert not torch.equal(p.detach(), b)
        assert opt.state[p]["step"].item() == 1
    # the second group's lr drives its update: |delta| ~ lr on the first step
    delta = (fp16[0].detach().float() - before[4].float()).abs().mean().item()
    assert 5e-3 < delta < 2e-2


def snapshot(opt, params):
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [t.clone() for t in opt.state[p].values()]
    return out


@pytest.mark.parametrize("state_bits", [32, 8])
@pytest.mark.parametrize("isa", [i for i in cpu_isas() if i != "scalar"])   # each against the scalar kernels
def test_every_cpu_isa_gives_identical_bits(isa, state_bits):
    results = {}
    for name in ("scalar", isa):
        with cpu_isa(name):
            torch.manual_seed(1)
            params = make_params(torch.bfloat16, "cpu", [(4097,), (70000,), (3, 5, 7)])
            params += make_params(torch.float16, "cpu", [(1000,)]) + make_params(torch.float32, "cpu", [(999,)])
            grads = [random_grads(params) for _ in range(3)]
            opt = run_fused(params, grads, lr=1e-2, weight_decay=0.1, state_bits=state_bits)
            results[name] = snapshot(opt, params)
    for a, b in zip(results["scalar"], results[isa]):
        assert torch.equal(a, b)


def test_thread_count_does_not_change_bits():
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.manual_seed(2)
            params = make_params(torch.bfloat16, "cpu", [(300_000,), (17,)])
            opt = run_fused(params, [random_grads(params) for _ in range(2)], lr=1e-3)
            results.append(snapshot(opt, params))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_set_cpu_isa_rejects_unknown_names():
    with pytest.raises(ValueError, match="isa must be one of"):
        effmem._C.set_cpu_isa("sse9")


def test_lr_as_tensor_matches_float_and_schedulers_work():
    torch.manual_seed(3)
    a = make_params(torch.bfloat16, "cpu", [(513,)])
    b = reference.clone_params(a)
    opt_a = effmem.FusedAdam(a, lr=1e-2)
    opt_b = effmem.FusedAdam(b, lr=torch.tensor(1e-2))
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5)
    for _ in range(5):
        g = torch.randn(513).bfloat16()
        a[0].grad, b[0].grad = g, g.clone()
        opt_a.step()
        opt_b.step()
        sched_a.step()
        sched_b.step()
    assert opt_a.param_groups[0]["lr"] == pytest.approx(2.5e-3)
    assert torch.equal(a[0].detach(), b[0].detach())
    assert torch.equal(opt_a.state[a[0]]["master"], opt_b.state[b[0]]["master"])


def test_scheduler_changes_the_update():
    """With lr scheduled to 0 after the first step, later steps leave params unchanged."""
    params = make_params(torch.float32, "cpu", [(64,)])
    opt = effmem.FusedAdam(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step == 0 else 0.0)
    params[0].grad = torch.randn(64)
    opt.step()
    sched.step()
    after_first = params[0].detach().clone()
    params[0].grad = torch.randn(64)
    opt.step()
    assert torch.equal(params[0].detach(), after_first)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_step_with_a_cpu_lr_tensor_is_one_graph_and_matches_eager(device):
    """torch's recipe for a compiled optimizer step under a schedule: the lr in a CPU tensor, changed in
    place. Reading its value in Python would break the graph at every step; the kernel checks it instead,
    so a bad value is still refused (on the CPU; on a GPU the kernel's refusal is tested elsewhere) and
    the compiled steps match eager ones bit for bit."""
    import torch._dynamo
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        params = make_params(torch.bfloat16, device)
        lr = torch.tensor(1e-2)
        opt = effmem.FusedAdam(params, lr=lr, weight_decay=0.1)
        step = torch.compile(opt.step, backend="aot_eager", fullgraph=True) if compiled else opt.step
        for i in range(3):
            for p, g in zip(params, random_grads(params)):
                p.grad = g
            step()
            lr.fill_(1e-2 / (2 + i))   # a schedule's in-place change
        runs.append([p.detach().clone() for p in params])
        assert opt.state[params[0]]["step"].item() == 3.0
        if compiled and device == "cpu":
            lr.fill_(float("nan"))
            before = [p.detach().clone() for p in params]
            with pytest.raises(Exception, match="lr_tensor must hold a finite number >= 0"):
                step()
            assert all(torch.equal(a, p) for a, p in zip(before, params))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_compiled_step_over_view_gradients_matches_eager():
    """Gradients that are pieces of one flat buffer (DDP's gradient_as_bucket_view, torch.autograd.grad's
    outputs put into p.grad): compiled, their strides are symbolic, and the layout check failed inside dynamo
    ("Cannot construct ConstantVariable ... SymInt", a reviewer's DDP run) on every backend, fullgraph or not."""
    import torch._dynamo
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        params = list(torch.nn.Linear(16, 8).parameters()) + [torch.nn.Parameter(torch.randn(6, 4).t())]
        opt = effmem.FusedAdam(params, lr=1e-2)
        step = torch.compile(opt.step, backend="aot_eager", fullgraph=True) if compiled else opt.step
        for i in range(3):
            flat = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(i))
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad = g.view(p.shape[::-1]).t() if p.stride()[0] == 1 else g.view_as(p)   # p's layout
                assert p.grad._base is flat
            step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("make", [torch.optim.AdamW, effmem.FusedAdam, effmem.OffloadAdam,
                                  functools.partial(effmem.FusedAdam, state_bits=8)],
                         ids=["torch", "fused", "offload", "fused8"])
def test_a_step_invalidates_a_graph_that_saved_the_parameters_as_torchs_does(make):
    """The kernels and the offload engine write the parameters' memory: their version counters did not move,
    and a backward through a graph saved before the step gave the gradient at the new weights (1.0 where
    2.0 was right) with no error."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = make([w], lr=0.5)
    y = (w * w).sum()
    w.grad = torch.ones(3)
    opt.step()
    w.grad = None
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    if hasattr(opt, "close"):
        opt.close()


def test_the_raw_adam_ops_move_the_version_of_every_tensor_they_write():
    w, g, m, v, step = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4), torch.tensor(1.0)
    ops.adam_step_([w], [g], [m], [v], [], [step], lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                   decoupled=True)
    assert (w._version, m._version, v._version, g._version, step._version) == (1, 1, 1, 0, 0)
