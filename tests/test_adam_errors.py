"""Bad input to FusedAdam and the adam_step_ op: clear errors naming the argument."""
import pytest
import torch

import effmem
from effmem import ops


def param(*shape, dtype=torch.float32, device="cpu"):
    return torch.nn.Parameter(torch.randn(*shape, device=device).to(dtype))


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1e-3), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(eps=0.0), "eps"),
    (dict(eps=-1e-8), "eps"),
    (dict(betas=(1.0, 0.999)), r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), r"betas\[1\]"),
    (dict(betas=(0.9,)), "betas"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(lr=torch.ones(2)), "lr"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        effmem.FusedAdam([param(3)], **kwargs)


def test_bad_hyperparameters_in_a_later_group():
    opt = effmem.FusedAdam([param(3)])
    with pytest.raises(ValueError, match="eps"):
        opt.add_param_group({"params": [param(3)], "eps": 0.0})


def test_params_on_two_devices_in_one_group():
    with pytest.raises(ValueError, match="params: a param group must hold parameters of one device"):
        effmem.FusedAdam([param(3), param(3, device="meta")])


def test_overlapping_params():
    base = torch.randn(10)
    a, b = torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])
    with pytest.raises(ValueError, match="share memory"):
        effmem.FusedAdam([a, b])
    with pytest.raises(ValueError, match="share memory"):
        opt = effmem.FusedAdam([a])
        opt.add_param_group({"params": [b]})


def test_disjoint_views_are_fine():
    base = torch.randn(10)
    effmem.FusedAdam([torch.nn.Parameter(base[:5]), torch.nn.Parameter(base[5:])])


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64, torch.int32])
def test_unsupported_param_dtypes(dtype):
    p = torch.zeros(3, dtype=dtype)
    with pytest.raises(TypeError, match=r"params\[0\]"):
        effmem.FusedAdam([p])


def test_non_dense_param():
    p = torch.nn.Parameter(torch.randn(10)[::2])
    with pytest.raises(ValueError, match=r"params\[0\].*dense"):
        effmem.FusedAdam([p])


def test_sparse_grad():
    p = param(5, 3)
    opt = effmem.FusedAdam([p])
    p.grad = torch.randn(5, 3).to_sparse()
    with pytest.raises(TypeError, match="grad: sparse"):
        opt.step()


def test_complex_grad():
    p = param(4)
    opt = effmem.FusedAdam([p])
    if hasattr(p, "grad_dtype"):  # torch >= 2.14 checks grad dtypes unless told not to
        p.grad_dtype = None
    p.grad = torch.randn(4, dtype=torch.complex64)
    with pytest.raises(TypeError, match="grad: expected float32, bfloat16 or float16 gradients"):
        opt.step()


def test_loading_an_amsgrad_checkpoint_is_refused():
    p = param(4)
    torch_opt = torch.optim.AdamW([p], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        effmem.FusedAdam([p]).load_state_dict(torch_opt.state_dict())


def _op_args(n=3, dtype=torch.bfloat16):
    p = [torch.randn(n).to(dtype)]
    return dict(params=p, grads=[torch.randn(n).to(dtype)], exp_avgs=[torch.zeros(n)], exp_avg_sqs=[torch.zeros(n)],
                masters=[x.float() for x in p] if dtype != torch.float32 else [], steps=[torch.ones(())])


HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)


@pytest.mark.parametrize("change, exc, match", [
    (dict(lr=-1.0), ValueError, "lr must be"),
    (dict(eps=0.0), ValueError, "eps must be"),
    (dict(beta1=1.0), ValueError, "beta1 must be"),
    (dict(beta2=1.5), ValueError, "beta2 must be"),
    (dict(weight_decay=-1.0), ValueError, "weight_decay must be"),
])
def test_op_rejects_bad_scalars(change, exc, match):
    with pytest.raises(exc, match=match):
        ops.adam_step_(**_op_args(), **{**HYPER, **change})


def test_op_rejects_bad_lists():
    args = _op_args()
    args["grads"] = []
    with pytest.raises(ValueError, match="same length"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["masters"] = []
    with pytest.raises(ValueError, match="masters"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["exp_avgs"] = [torch.zeros(4)]
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has shape"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["exp_avg_sqs"] = [torch.zeros(3, dtype=torch.bfloat16)]
    with pytest.raises(TypeError, match=r"exp_avg_sqs\[0\] must be float32"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["params"] = [torch.zeros(3, dtype=torch.float64)]
    with pytest.raises(TypeError, match="params must be float32, bfloat16 or float16"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["steps"] = [torch.ones((), dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"steps\[0\]"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["grads"] = [torch.randn(6).bfloat16()[::2]]
    with pytest.raises(ValueError, match=r"grads\[0\] has strides"):
        ops.adam_step_(**args, **HYPER)
