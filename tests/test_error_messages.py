"""The numbers in the C++ error messages reach the user.

An extension that carries its own copy of libstdc++ (a compiler that links it
statically) drops every number from a TORCH_CHECK message, or crashes while
formatting it (seen on an H100 machine). Each op family and the offload
engine is called here with a bad value straight through torch.ops / _C (the
Python wrappers would catch some of these first), and the message must hold
the value given and the range expected. tools/check_wheel.sh also runs this
file against an extension built with LDFLAGS=-static-libstdc++.
"""
import re
import warnings

import pytest
import torch

import effmem
from conftest import DEVICES

OPS = torch.ops.effmem


def adam_args(device, **overrides):
    p = torch.zeros(4, device=device)
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
                  bias_correction=True)
    kwargs.update(overrides)
    tensors = ([p], [torch.zeros_like(p)], [torch.zeros_like(p)], [torch.zeros_like(p)], [],
               [torch.ones((), device=device)])
    return tensors, kwargs


def call_adam(device, **overrides):
    (params, grads, m, v, masters, steps), k = adam_args(device, **overrides)
    OPS.adam_step_(params, grads, m, v, masters, steps, k["lr"], k["beta1"], k["beta2"], k["eps"],
                   k["weight_decay"], k["decoupled"], k["bias_correction"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arg, value, expected", [
    ("lr", -1.0, r"lr must be a finite number >= 0 within float32's range, got -1$"),
    ("lr", 1e39, r"lr must be a finite number >= 0 within float32's range, got 1e\+39$"),
    ("beta1", 1.5, r"beta1 must be in \[0, 1\), got 1\.5$"),
    ("beta2", -0.25, r"beta2 must be in \[0, 1\), got -0\.25$"),
    ("eps", 0.0, r"eps must be > 0 in float32's normal range, got 0$"),
    ("eps", 1e-50, r"eps must be > 0 in float32's normal range, got 1e-50$"),
    ("weight_decay", -3e-05, r"weight_decay must be a finite number >= 0 within float32's range, got -3e-05$"),
    ("weight_decay", float("inf"), r"weight_decay must be a finite number >= 0 within float32's range, got inf$"),
    ("weight_decay", 1e39, r"weight_decay must be a finite number >= 0 within float32's range, got 1e\+39$"),
])
def test_adam_messages_hold_the_value(device, arg, value, expected):
    with pytest.raises(ValueError) as err:
        call_adam(device, **{arg: value})
    assert re.search(expected, str(err.value).splitlines()[0]), str(err.value)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_length_message_holds_every_count(device):
    p = torch.zeros(3, device=device)
    with pytest.raises(ValueError, match=r"same length, got 2, 1, 1, 1, 1"):
        OPS.adam_step_([p, p.clone()], [p], [p], [p], [], [torch.ones((), device=device)],
                       1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)


@pytest.mark.parametrize("device", DEVICES)
def test_l2norm_message_holds_the_index(device):
    dense = torch.ones(3, device=device)
    broadcast = torch.ones(3, device=device).expand(5, 3)
    with pytest.raises(ValueError, match=r"tensors\[2\] must be dense and non-overlapping"):
        OPS.l2norm([dense, dense, broadcast])


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_messages_hold_the_value(device):
    x = torch.randn(4, 256, device=device)
    with pytest.raises(ValueError, match=r"bits must be 4 or 8, got 3$"):
        OPS.quantize(x, 3, 128, 0, True)
    with pytest.raises(ValueError, match=r"group_size must be 32, 64, 128 or 256, got 100$"):
        OPS.quantize(x, 8, 100, 0, True)


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_messages_hold_the_sizes(device):
    codes, stats = OPS.quantize(torch.randn(6, 256, device=device), 8, 128, 0, True)
    with pytest.raises(ValueError, match=r"last_dim must be >= 0, got -7$"):
        OPS.dequantize(codes, stats, 8, 128, -7, torch.float32)
    with pytest.raises(ValueError, match=r"codes has 256 bytes per row but last_dim=300 at 8 bits needs 300$"):
        OPS.dequantize(codes, stats, 8, 128, 300, torch.float32)
    with pytest.raises(ValueError, match=r"stats has 1 groups per row but last_dim=256 in groups of 128 needs 2$"):
        OPS.dequantize(codes, stats[:, :1].contiguous(), 8, 128, 256, torch.float32)
    with pytest.raises(ValueError, match=r"codes has 4 rows but stats has 6; the rows of codes and stats must match$"):
        OPS.dequantize(codes[:4], stats, 8, 128, 256, torch.float32)
    with pytest.raises(ValueError, match=r"stats must be contiguous, got strides \[2, 12, 1\] for shape \[6, 2, 2\]$"):
        OPS.dequantize(codes, stats.transpose(0, 1).contiguous().transpose(0, 1), 8, 128, 256, torch.float32)


def test_adam8_conversion_messages_hold_the_sizes():
    m = torch.zeros(300)
    with pytest.raises(ValueError, match=r"v must be a contiguous 1-D Float CPU tensor of 300 elements, got "):
        OPS.adam8_encode(m, torch.zeros(299), 2.0, 0)
    with pytest.raises(ValueError, match=r"step must be a whole number in \[0, 2\^63\) .*, got 2.5$"):
        OPS.adam8_encode(m, m, 2.5, 0)


def test_offload_engine_messages_hold_the_value():
    p = torch.zeros(8)
    with pytest.raises(ValueError, match=r"num_threads must be >= 1, got -2$"):
        effmem._C.OffloadEngine([p], [0], [0], [True], 1, backend="host", num_threads=-2)
    engine = effmem._C.OffloadEngine([p], [0], [0], [True], 1, backend="host")
    try:
        with pytest.raises(IndexError, match=r"index 5 out of range for 1 parameters"):
            engine.grad_ready(5, torch.zeros(8))
        with pytest.raises(ValueError, match=r"expected the parameter's device, shape and strides "
                                             r"\(cpu, \[8\], \[1\]\), got cpu, \[2, 4\], \[4, 1\]"):
            engine.grad_ready(0, torch.zeros(2, 4))
    finally:
        engine.close()


def test_flags_and_empty_rows_of_the_python_entry_points():
    """A string for a flag (bool("False") is True: stochastic rounding, grad_in_forward) and a 0 for a bool
    were taken; a last dim of 0 failed inside reshape; unfuse(None) was an AttributeError."""
    import effmem
    from effmem import compress, ops
    with pytest.raises(TypeError, match="stochastic: expected True or False, got 'False'"):
        ops.quantize(torch.randn(4, 32), stochastic="False")
    with pytest.raises(TypeError, match="stochastic: expected True or False"):
        compress.compressed_linear(torch.randn(2, 32), torch.randn(3, 32), stochastic="no")
    with pytest.raises(ValueError, match="grad_in_forward: expected None, True or False, got 1"):
        effmem.linear_cross_entropy(torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1]), grad_in_forward=1)
    with pytest.raises(TypeError, match="model: expected an nn.Module, got NoneType"):
        effmem.unfuse_linear_cross_entropy(None)
    x, w = torch.randn(3, 0, requires_grad=True), torch.randn(5, 0, requires_grad=True)
    out = compress.compressed_linear(x, w)
    out.sum().backward()
    assert out.shape == (3, 5) and torch.equal(out, torch.zeros(3, 5)) and w.grad.shape == (5, 0)


def test_odd_arguments_are_named_not_misreported():
    """A fuzzing reviewer's finds: a last_dim too large overflowed into a wrong size ("needs 0" bytes per row);
    adam_check took block scales for one moment alone and checked float32 moments; the ops wrapper's lr=None or
    a two-element tensor got float()'s message, which names no argument."""
    with pytest.raises(ValueError, match=r"last_dim=9223372036854775807 is more elements than 1 rows"):
        OPS.dequantize(torch.zeros(1, 1, dtype=torch.uint8), torch.zeros(1, 1, 2), 8, 256, 2 ** 63 - 1,
                       torch.float32)
    p, g, m, v, s = torch.randn(300), torch.randn(300), torch.zeros(300), torch.zeros(300), torch.tensor(1.0)
    with pytest.raises(ValueError, match="exp_avg_scales, exp_avg_sq_scales .* got 0, 3"):
        OPS.adam_check([p], [g], [m], [v], [], [s], [], [torch.zeros(2)] * 3)
    for lr, got in ((None, "None"), (torch.ones(2), r"a tensor of shape \(2,\)"), ("1e-3x", "'1e-3x'")):
        with pytest.raises(TypeError, match=f"lr: expected a real number .*, got {got}"):
            effmem.ops.adam_step_([p], [g], [m], [v], [], [s], lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                                  weight_decay=0.0, decoupled=True)


def test_public_entry_points_name_a_wrong_model_pattern_or_scale():
    """A reviewer's fuzz of the public API: None for the model was an AttributeError from inside (activation_stats,
    budget_choice, restore_training_cache, remove_compression), a number for compressed_checkpoint's run failed
    calling it, exclude_modules=None was "'NoneType' object is not iterable" and a pattern matching no module
    (a typo) excluded nothing, silently; an inv_scale of -1 was gradient ascent and NaN every weight NaN."""
    from effmem import activations, compress
    from effmem.activations.cache import restore_training_cache
    for fn in (activations.activation_stats, activations.budget_choice, restore_training_cache):
        with pytest.raises(TypeError, match="model: expected an nn.Module, got NoneType"):
            fn(None)
    with pytest.raises(TypeError, match="module: expected an nn.Module, got str"):
        compress.remove_compression("model")
    with pytest.raises(TypeError, match="run: expected a callable taking x, got int"):
        activations.compressed_checkpoint(5, torch.randn(4, 32))
    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    compress.remove_compression(effmem.compress_activations(net, exclude_modules=None))
    with pytest.raises(ValueError, match="exclude_modules: '1' matches no module of Sequential .*named as .*: 0"):
        effmem.compress_activations(net, exclude_modules="1")
    with pytest.raises(ValueError, match="exclude_modules: 'nett' matches no module"):
        with effmem.compress_activations(exclude_modules=["nett"], names_from=net):   # named at the entry
            pass
    later = effmem.compress_activations(exclude_modules=["adapter"], names_from=net)   # a module added before entry
    net.adapter = torch.nn.Linear(8, 8)
    with later:
        pass
    del net.adapter
    with pytest.warns(UserWarning, match="exclude_modules: 'lm_head' matches no module .* the other patterns"):
        compress.remove_compression(effmem.compress_activations(net, exclude_modules=["0", "lm_head"]))
    with pytest.raises(ValueError, match="exclude_modules must be module names"):
        effmem.compress_activations(net, exclude_modules=5)
    assert not hasattr(net, "compress_stats")   # refused before any change
    import numpy as np
    p, ref = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    p.grad, ref.grad = torch.ones(3), torch.full((3,), 0.5)
    # eps=1: the step depends on the gradient's scale (with a small eps Adam's first step does not)
    opt, opt_ref = effmem.FusedAdam([p], lr=0.1, eps=1.0), effmem.FusedAdam([ref], lr=0.1, eps=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # np.float32 against 2**1000 warned of an overflow
        for bad in (-1.0, float("nan"), float("inf"), 1e39, 10 ** 400, np.float32("nan")):   # 1e39: inf in float32
            with pytest.raises(ValueError, match="inv_scale: expected a finite number >= 0"):
                opt.step(inv_scale=bad)
        opt.step(inv_scale=np.float32(0.5))   # numpy's float32, no Python float, was "expected ... a number"
    opt_ref.step()
    assert torch.equal(p.detach(), ref.detach()) and not torch.equal(p.detach(), torch.full((3,), -0.1))
