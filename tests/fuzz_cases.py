"""Property-based fuzzing of effmem's public entry points (hypothesis).

Each target draws random shapes, dtypes, strides, value ranges (subnormals,
+-finfo.max, NaN, inf), hyper-parameters and corrupted checkpoints, and
checks the result against a float64 / torch reference, or that the call
raised ValueError / TypeError naming what was wrong (and changed nothing).

    python tests/fuzz_cases.py TARGET [--examples N] [--seed S] [--device cpu|cuda] [--log PATH]

tests/test_fuzz.py runs each target in its own process, so that a crash or a
hang fails that target (naming the example it was on, from --log) rather
than the whole test run. EFFMEM_FUZZ_EXAMPLES sets the number of examples
per target (CI: the default below; a nightly-style run: thousands).
"""
import argparse
import math
import os
import sys

import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import effmem
from effmem import FusedAdam, OffloadAdam, ops, reference
from effmem.optim._validate import is_dense
from conftest import same  # this file runs as a script from tests/, so conftest imports as a module

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FMAX = float(torch.finfo(torch.float32).max)
SPECIALS = [0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.2e-38, 1e-30, 65504.0, -65504.0, 3e38, -3e38,
            3.3895e38, -3.3895e38, FMAX, -FMAX, math.inf, -math.inf, math.nan]
MODES = ["normal", "wide", "tiny", "constant", "specials", "masked"]
DEVICE = "cpu"
LOG = None


def log(case) -> None:
    """The example about to run, so that a crash or hang can be traced to it."""
    if LOG is not None:
        LOG.write(repr(case) + "\n")
        LOG.flush()


def fill(shape, dtype, mode: str, rng_seed: int, n_specials: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng_seed)
    n = math.prod(shape)
    if mode == "normal":
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (1,), generator=g).item()
    elif mode == "wide":
        x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    elif mode == "tiny":
        x = torch.randn(n, generator=g) * 1e-41
    elif mode == "constant":
        x = torch.full((n,), torch.randn(1, generator=g).item())
    else:  # specials sprinkled over ordinary values; masked: one extreme value, many times
        x = torch.randn(n, generator=g)
        if n:
            if mode == "masked":
                extreme = [-FMAX, -math.inf, 3.3895e38][rng_seed % 3]
                x[torch.rand(n, generator=g) < 0.3] = extreme
            else:
                idx = torch.randint(0, n, (n_specials,), generator=g)
                vals = torch.tensor(SPECIALS)[torch.randint(0, len(SPECIALS), (n_specials,), generator=g)]
                x[idx] = vals
    return x.to(dtype).reshape(shape)


@st.composite
def tensors(draw, max_dims=3, max_size=300, dtypes=DTYPES):
    dims = draw(st.integers(1, max_dims))
    shape = tuple(draw(st.lists(st.integers(0 if dims > 1 else 1, max_size), min_size=dims, max_size=dims)))
    if math.prod(shape) > 40000:
        shape = (shape[0] % 50 + 1,) + shape[1:2]
    return dict(shape=shape, dtype=draw(st.sampled_from(dtypes)), mode=draw(st.sampled_from(MODES)),
                rng_seed=draw(st.integers(0, 2 ** 31)), n_specials=draw(st.integers(1, 8)))


# ---------------------------------------------------------------------------------------------
# quantize / dequantize: bit for bit against the reference, whatever the values


@st.composite
def quant_cases(draw):
    return dict(t=draw(tensors()), bits=draw(st.sampled_from([4, 8])), group_size=draw(st.sampled_from([32, 64, 128, 256])),
                stochastic=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 64 - 1)),
                transpose=draw(st.booleans()))


def check_quantize(case):
    t = case["t"]
    x = fill(t["shape"], t["dtype"], t["mode"], t["rng_seed"], t["n_specials"]).to(DEVICE)
    if case["transpose"] and x.dim() >= 2:
        x = x.transpose(0, -1)  # ops.quantize takes any layout (it quantises x.contiguous())
    codes, stats = ops.quantize(x, bits=case["bits"], group_size=case["group_size"], seed=case["seed"],
                                stochastic=case["stochastic"])
    ref_codes, ref_stats = reference.quantize(x.contiguous().cpu(), case["bits"], case["group_size"], case["seed"],
                                              case["stochastic"])
    assert same(stats.cpu(), ref_stats), "stats differ from the reference"
    d = x.shape[-1] if x.dim() else 1
    got_codes = codes.cpu().long() if case["bits"] == 8 else torch.stack(
        [(codes.cpu() & 15).long(), (codes.cpu() >> 4).long()], -1).reshape(codes.shape[0], 2 * codes.shape[1])[:, :d]
    assert torch.equal(got_codes, ref_codes), "codes differ from the reference"
    y = ops.dequantize(codes, stats, bits=case["bits"], group_size=case["group_size"], shape=x.shape, dtype=x.dtype)
    expected = reference.dequantize(ref_codes, ref_stats, case["group_size"], x.shape, x.dtype, case["bits"])
    assert y.shape == x.shape and y.dtype == x.dtype and same(y.cpu(), expected)
    assert torch.equal(y.isnan().cpu(), expected.isnan())


# ---------------------------------------------------------------------------------------------
# adam_step_: against reference.adam_step in float64, or a clear error for invalid arguments

HYPER_OK = dict(lr=st.floats(0, 1), beta1=st.floats(0, 0.999), beta2=st.floats(0, 0.9999),
                eps=st.floats(1e-12, 1), weight_decay=st.floats(0, 1))
HYPER_BAD = dict(lr=[-1e-3, math.nan, math.inf], beta1=[1.0, -0.1, math.nan], beta2=[1.5, math.nan],
                 eps=[0.0, -1.0, math.nan], weight_decay=[-0.1, math.nan])


@st.composite
def adam_cases(draw):
    hyper = {k: draw(s) for k, s in HYPER_OK.items()}
    bad = draw(st.sampled_from([None, None, None, "hyper", "step", "lr_tensor"]))
    if bad == "hyper":
        key = draw(st.sampled_from(sorted(HYPER_BAD)))
        hyper[key] = draw(st.sampled_from(HYPER_BAD[key]))
    step = draw(st.integers(1, 10 ** 6)) if bad != "step" else draw(st.sampled_from([0.0, -3.0, 2.5, math.nan, math.inf, 2.0 ** 63]))
    lr_tensor = draw(st.sampled_from([None, "ok"])) if bad != "lr_tensor" else draw(st.sampled_from([-1.0, math.nan]))
    return dict(ts=draw(st.lists(tensors(max_dims=2, max_size=200), min_size=1, max_size=3)),
                pdtype=draw(st.sampled_from(DTYPES)), gdtype=draw(st.sampled_from(DTYPES)), hyper=hyper, bad=bad,
                step=step, lr_tensor=lr_tensor, decoupled=draw(st.booleans()), bias_correction=draw(st.booleans()))


def check_adam(case):
    h, pdt = case["hyper"], case["pdtype"]
    params, grads = [], []
    for k, t in enumerate(case["ts"]):
        params.append(fill(t["shape"], torch.float32, "normal", t["rng_seed"], 0))
        grads.append(fill(t["shape"], torch.float32, t["mode"], t["rng_seed"] + 1, t["n_specials"]))
    masters = [p.clone() for p in params] if pdt != torch.float32 else []
    low = [p.to(pdt) for p in params] if pdt != torch.float32 else [p.clone() for p in params]
    m = [torch.randn(p.shape).abs() * 0.1 for p in params]
    v = [torch.rand(p.shape) * 0.1 for p in params]
    args = [[x.to(DEVICE, copy=True) for x in lst] for lst in (low, [g.to(case["gdtype"]) for g in grads], m, v, masters)]
    steps = [torch.full((), float(case["step"]), device=DEVICE) for _ in params]
    lr_tensor = None
    if case["lr_tensor"] is not None:
        lr_tensor = torch.tensor([h["lr"] if case["lr_tensor"] == "ok" else case["lr_tensor"]], device=DEVICE)
    before = [[x.clone() for x in lst] for lst in args]
    call = dict(lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"], weight_decay=h["weight_decay"],
                decoupled=case["decoupled"], bias_correction=case["bias_correction"], lr_tensor=lr_tensor)
    expect_error = case["bad"] is not None and not (DEVICE == "cuda" and case["bad"] in ("step", "lr_tensor"))
    if DEVICE == "cuda" and case["bad"] in ("step", "lr_tensor"):
        status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        ops.adam_step_(*args, steps, **call, status=status)
        assert status.item() == (2 if case["bad"] == "step" else 1)
        return
    if expect_error:
        names = {"hyper": [k for k in HYPER_BAD if not _ok(k, h[k])], "step": ["steps[0]"], "lr_tensor": ["lr_tensor"]}
        try:
            ops.adam_step_(*args, steps, **call)
        except (ValueError, TypeError) as err:
            assert any(n in str(err) for n in names[case["bad"]]), f"{err} does not name {names[case['bad']]}"
            assert all(same(a, b) for x, y in zip(args, before) for a, b in zip(x, y)), "changed on error"
            return
        raise AssertionError(f"accepted invalid {case['bad']}: {h}, step {case['step']}, lr_tensor {lr_tensor}")
    ops.adam_step_(*args, steps, **call)
    lr32 = float(torch.tensor(h["lr"], dtype=torch.float32))  # the kernel rounds lr to float first
    for i, p in enumerate(params):
        p64, g64 = p.double(), grads[i].to(case["gdtype"]).double()
        m64, v64 = m[i].double(), v[i].double()
        m0 = m64.clone()
        reference.adam_step(p64, g64, m64, v64, case["step"], lr=lr32, beta1=h["beta1"], beta2=h["beta2"],
                            eps=h["eps"], weight_decay=h["weight_decay"], decoupled=case["decoupled"],
                            bias_correction=case["bias_correction"])
        got = (args[4][i] if masters else args[0][i]).cpu().double()
        bad_grad = ~torch.isfinite(g64)
        if bad_grad.any():
            # a non-finite gradient poisons its element, as in torch
            assert not torch.isfinite(got[bad_grad]).any(), "a non-finite gradient gave a finite parameter"
        ordinary = ~bad_grad & (g64.abs() < 1e18)  # beyond, g * g overflows float32 but not float64
        # a few float32 roundings of the parameter and of each term of its update (the moments'
        # terms may cancel, so their sizes, not their sum, bound the error)
        g_eff = g64 + (0 if case["decoupled"] else h["weight_decay"] * p.double())
        bc1 = 1 - h["beta1"] ** case["step"] if case["bias_correction"] else 1.0
        bc2 = 1 - h["beta2"] ** case["step"] if case["bias_correction"] else 1.0
        terms = lr32 / bc1 * (h["beta1"] * m0.abs() + (1 - h["beta1"]) * g_eff.abs()) / (
            v64.sqrt() / bc2 ** 0.5 + h["eps"])
        tol = 16 * 2.0 ** -24 * (p.double().abs() * (1 + lr32 * h["weight_decay"]) + terms) + 1e-37
        err = ((got - p64).abs() - tol)[ordinary]
        assert (err <= 0).all(), f"tensor {i}: error beyond tolerance by {err.max().item()}"


def _ok(key: str, value: float) -> bool:
    if key == "lr":
        return math.isfinite(value) and value >= 0
    if key in ("beta1", "beta2"):
        return 0 <= value < 1
    if key == "eps":
        return value > 0
    return value >= 0


# ---------------------------------------------------------------------------------------------
# l2norm and clip_grad_norm_: against float64, and torch's clip


@st.composite
def norm_cases(draw):
    return dict(ts=draw(st.lists(tensors(max_dims=2, max_size=200), min_size=0, max_size=4)),
                strided=draw(st.booleans()), max_norm=draw(st.floats(0, 10)))


def check_norm(case):
    xs = [fill(t["shape"], t["dtype"], t["mode"], t["rng_seed"], t["n_specials"]).to(DEVICE) for t in case["ts"]]
    if case["strided"] and xs and xs[0].dim() == 2 and xs[0].shape[1] > 1:
        xs[0] = xs[0][:, ::2]  # not dense (unless one row): refused by the raw op, made contiguous by the clip
        try:
            ops.l2norm(xs)
        except ValueError as err:
            assert "must be dense" in str(err) and not is_dense(xs[0])
        else:
            assert is_dense(xs[0]), "l2norm accepted a non-dense tensor"
        xs[0] = xs[0].contiguous()
    got = ops.l2norm(xs).cpu().double()
    exact = reference.l2norm(xs)
    if exact.isnan():
        assert got.isnan()
    elif exact > 3.4028234e38:
        assert got.isinf() or got > 3e38
    else:
        # squares below the float range (|x| < ~1e-19) count as 0, as in torch's float32 norm
        floor = 1.1e-19 * sum(x.numel() for x in xs) ** 0.5
        assert abs(got - exact) <= 2e-6 * exact + floor, f"norm {got.item()} vs {exact.item()}"
    if all(torch.isfinite(x).all() for x in xs) and exact < 1e18:
        # the drop-in clip against the same clip in float64 (torch's own, in fp16, can give NaN here)
        ps = [torch.nn.Parameter(torch.zeros_like(x)) for x in xs]
        for p, x in zip(ps, xs):
            p.grad = x.clone()
        total = effmem.clip_grad_norm_(ps, case["max_norm"])
        floor = 1.1e-19 * sum(x.numel() for x in xs) ** 0.5
        assert abs(total.double().item() - exact.item()) <= 2e-6 * exact.item() + floor
        coef = min(1.0, case["max_norm"] / (exact.item() + 1e-6))
        for p, x in zip(ps, xs):
            fi = torch.finfo(x.dtype)
            expected = x.double() * coef
            err = (p.grad.cpu().double() - expected.cpu()).abs()
            # relative rounding, plus the absolute rounding of a subnormal clip factor (a tiny max_norm),
            # which CUDA may flush to zero
            tiny = expected.abs() < torch.finfo(torch.float32).smallest_normal
            slack = (2 * fi.eps * expected.abs() + x.double().abs() * 2.0 ** -149 + fi.smallest_normal * fi.eps
                     + torch.where(tiny, expected.abs(), 0))
            assert (err <= slack.cpu()).all(), "clipped grads"


# ---------------------------------------------------------------------------------------------
# Optimizer checkpoints, corrupted: refused with a clear error and no change, or loaded exactly

CORRUPTIONS = ["none", "nan_moment", "drop_exp_avg", "shape_exp_avg", "shape_master", "int_exp_avg", "step_neg",
               "step_frac", "step_nan", "lr_neg", "lr_nan", "eps_zero", "extra_group", "short_group", "state_list"]
BENIGN = {"none", "nan_moment"}


@st.composite
def checkpoint_cases(draw):
    return dict(kind=draw(st.sampled_from(["fused", "offload"])), dtype=draw(st.sampled_from(DTYPES)),
                shapes=draw(st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=2), min_size=1, max_size=3)),
                corruptions=draw(st.lists(st.sampled_from(CORRUPTIONS), min_size=1, max_size=2)),
                target=draw(st.integers(0, 10)))


def _corrupt(sd, what, target):
    ids = sorted(sd["state"])
    sid = ids[target % len(ids)]
    s = sd["state"][sid]
    if not isinstance(s, dict) or "exp_avg" not in s or not s["exp_avg"].is_floating_point():
        return False  # already corrupted beyond what the others change
    if what == "nan_moment":
        s["exp_avg"] = s["exp_avg"].clone().fill_(math.nan)
    elif what == "drop_exp_avg":
        s.pop("exp_avg")
    elif what == "shape_exp_avg":
        s["exp_avg"] = torch.zeros(s["exp_avg"].numel() + 1)
    elif what == "shape_master" and "master" in s:
        s["master"] = torch.zeros(1, 1, 1)
    elif what == "int_exp_avg":
        s["exp_avg"] = s["exp_avg"].long()
    elif what.startswith("step_"):
        s["step"] = torch.tensor({"step_neg": -2.0, "step_frac": 1.5, "step_nan": math.nan}[what])
    elif what.startswith("lr_") or what == "eps_zero":
        key, val = ("eps", 0.0) if what == "eps_zero" else ("lr", -1.0 if what == "lr_neg" else math.nan)
        sd["param_groups"][target % len(sd["param_groups"])][key] = val
    elif what == "extra_group":
        sd["param_groups"].append(dict(sd["param_groups"][0]))
    elif what == "short_group":
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1] or [99]
        if len(sd["param_groups"][0]["params"]) == 1 and sd["param_groups"][0]["params"] == [99]:
            sd["param_groups"][0]["params"] = []
    elif what == "state_list":
        sd["state"][sid] = list(s.values())
    else:
        return False
    return True


def check_checkpoint(case):
    torch.manual_seed(case["target"])
    params = [torch.nn.Parameter(torch.randn(*s).to(case["dtype"])) for s in case["shapes"]]
    cls = FusedAdam if case["kind"] == "fused" else OffloadAdam
    kwargs = {} if case["kind"] == "fused" else dict(bucket_size=16)
    opt = cls(params, lr=1e-2, **kwargs)
    try:
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
            opt.zero_grad()
        sd = opt.state_dict()
        sd = {"state": {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                        for k, s in sd["state"].items()},
              "param_groups": [dict(g, params=list(g["params"])) for g in sd["param_groups"]]}
        for p in params:   # the checkpoint a step old: a refused load that wrote its good entries would show
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad()
        before = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
        applied = [c for c in case["corruptions"] if _corrupt(sd, c, case["target"])]
        harmful = [c for c in applied if c not in BENIGN]
        try:
            opt.load_state_dict(sd)
        except (ValueError, TypeError) as err:
            assert harmful, f"refused a valid checkpoint: {err}"
            assert "state_dict" in str(err), f"message does not say where: {err}"
            now = opt.state_dict()["state"]
            for k, s in before.items():
                for n, v in s.items():
                    assert same(torch.as_tensor(now[k][n]), v), f"changed by a refused load: {k} {n}"
            return
        assert not harmful, f"accepted a corrupted checkpoint ({harmful})"
        now = opt.state_dict()["state"]
        for k, s in sd["state"].items():
            for n, v in s.items():
                assert same(torch.as_tensor(now[k][n]).float(), torch.as_tensor(v).float()), f"{k} {n} not restored"
    finally:
        if case["kind"] == "offload":
            opt.close()


# ---------------------------------------------------------------------------------------------
# compress_activations: what backward gets back is the quantised-then-restored saved tensor


class _SaveAndReturn(torch.autograd.Function):
    """Saves x; its backward returns the saved tensor as the gradient, so the test sees it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return x.clone()


@st.composite
def compress_cases(draw):
    return dict(t=draw(tensors(max_dims=3, max_size=260)), bits=draw(st.sampled_from([4, 8])),
                group_size=draw(st.sampled_from([32, 64, 128, 256])))


def check_compress(case):
    t = case["t"]
    x = fill(t["shape"], t["dtype"], t["mode"], t["rng_seed"], t["n_specials"]).to(DEVICE)
    leaf = x.detach().clone().requires_grad_(True)
    with effmem.compress_activations(bits=case["bits"], group_size=case["group_size"], min_numel=0,
                                     stochastic=False, track_exact=False) as ctx:
        y = _SaveAndReturn.apply(leaf * 1)
    y.backward()
    back = leaf.grad
    assert back.shape == x.shape and back.dtype == x.dtype
    n, g = x.numel(), case["group_size"]
    if ctx.stats.num_compressed == 0:
        assert same(back, x.detach())
        return
    from effmem.compress._codec import saved_groups   # the store's layout: groups within rows
    rows, cols, g = saved_groups(n, x.shape[-1] if x.dim() else 1, g)
    codes, stats = reference.quantize(x.detach().reshape(rows, cols).cpu(), case["bits"], g, 0, False)
    expected = reference.dequantize(codes, stats, g, x.shape, x.dtype, case["bits"])
    assert same(back.cpu(), expected), "restored tensor differs from the reference round trip"


TARGETS = {"quantize": (quant_cases, check_quantize), "adam": (adam_cases, check_adam),
           "norm": (norm_cases, check_norm), "checkpoint": (checkpoint_cases, check_checkpoint),
           "compress": (compress_cases, check_compress)}


def run(target: str, examples: int, seed_value: int) -> None:
    strategy, check = TARGETS[target]

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(strategy())
    def test(case):
        log(case)
        check(case)

    test()


def main(argv=None):
    global DEVICE, LOG
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("--examples", type=int, default=int(os.environ.get("EFFMEM_FUZZ_EXAMPLES", "60")))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--log", default=None)
    args = parser.parse_args(argv)
    DEVICE = args.device
    LOG = open(args.log, "w") if args.log else None
    torch.set_num_threads(1)
    run(args.target, args.examples, args.seed)
    print(f"{args.target}: {args.examples} examples on {args.device} passed")


if __name__ == "__main__":
    sys.exit(main())
