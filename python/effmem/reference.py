"""Pure-PyTorch references for effmem's kernels, used by the tests.

They follow the formulas in csrc/common/adam_math.h step by step, in any
dtype (the tests run them in float64), and are deliberately simple and slow.
"""
from typing import List, Sequence

import torch
from torch import Tensor


def adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, *, lr: float,
              beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
              bias_correction: bool = True, grad_scale: float = 1.0) -> None:
    """One Adam/AdamW step in place, in the dtype of the given tensors."""
    g = grad.to(param.dtype) * grad_scale
    if weight_decay != 0.0 and not decoupled:
        g = g + weight_decay * param
    if decoupled:
        param.mul_(1.0 - lr * weight_decay)
    exp_avg.mul_(beta1).add_((1.0 - beta1) * g)
    exp_avg_sq.mul_(beta2).add_((1.0 - beta2) * g * g)
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    denom = exp_avg_sq.sqrt() / (bc2 ** 0.5) + eps
    param.sub_((lr / bc1) * exp_avg / denom)


def l2norm(tensors: Sequence[Tensor]) -> Tensor:
    """Global L2 norm in float64."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.cat([t.detach().double().flatten() for t in tensors]).norm()


def clone_params(params: List[Tensor], dtype=None) -> List[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]


# ---------------------------------------------------------------------------
# Group-wise quantisation (effmem::quantize / effmem::dequantize); the formula
# is in csrc/common/quant_math.h.

def hash_word(seed: int, word: Tensor) -> Tensor:
    """quant_math.h's hash_word(): the 32-bit hash (int64 holding uint32) of word index `word` (int64)."""
    mask = 0xFFFFFFFF
    lo = word & mask
    hi = (word >> 32) & mask
    high = _fmix32((hi + 0x7F4A7C15 + ((seed >> 32) & mask)) & mask)
    return _fmix32((lo * 0x9E3779B1 + ((seed & mask) ^ high)) & mask)


def hash_byte(seed: int, index: Tensor) -> Tensor:
    """The stochastic rounding byte of element `index` (int64): byte index % 4 of hash_word(index // 4)."""
    return (hash_word(seed, index >> 2) >> (8 * (index & 3))) & 0xFF


def _fmix32(h: Tensor) -> Tensor:
    mask = 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & mask
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


_HUGE, _TINY, _OUTLIER_GAIN = 2.0 ** 100, 2.0 ** -100, 16.0
_FLT_MAX = torch.finfo(torch.float32).max
_MAGIC = 2.0 ** 23


def _recip(d: int) -> Tensor:
    """quant_recip(): 1/d rounded to float32 (the kernels' constant)."""
    return torch.tensor(1.0, dtype=torch.float32) / d


def _prescale(step: Tensor) -> Tensor:
    one = torch.ones_like(step)
    return torch.where(step > _HUGE, 0.5 * one, torch.where((step > 0) & (step < _TINY), _HUGE * one, one))


def _step(span: Tensor, recip: Tensor) -> Tensor:
    """quant_math.h's quant_step(): span * recip, a subnormal result rounded up by one ulp."""
    s = span * recip
    up = (s.view(torch.int32) + 1).view(torch.float32)
    return torch.where((s < 2.0 ** -126) & (span > 0), up, s)


def _quant_group(part: Tensor, qmax: int):
    """quant_math.h's quant_group() for each row of `part` (float32 [rows, n]): the stats and the
    per-row constants of quantize_value(), each [rows, 1]."""
    nan_at = part.isnan()
    # + 0.0: quant_group()'s one zero (-0 and +0 give the stats the same bits)
    lo = torch.where(nan_at, float("inf"), part).amin(dim=1, keepdim=True) + 0.0
    hi = torch.where(nan_at, float("-inf"), part).amax(dim=1, keepdim=True) + 0.0
    has_nan = nan_at.any(dim=1, keepdim=True)
    mag = torch.where(nan_at, 0.0, part.abs())
    a_lo = torch.where(part != lo, mag, 0.0).amax(dim=1, keepdim=True)
    a_hi = torch.where(part != hi, mag, 0.0).amax(dim=1, keepdim=True)
    lo_inf, hi_inf = lo == float("-inf"), hi == float("inf")
    nan_group = has_nan | (lo_inf & hi_inf)
    h = (qmax - 1) // 2
    rq, rh = _recip(qmax), _recip(h)
    diff = hi - lo
    scale = torch.where(diff == float("inf"), ((hi * 0.5 - lo * 0.5) * rq) * 2.0, _step(diff, rq))
    any_inf = lo_inf | hi_inf
    # quant_side(): which extreme might be kept apart, from lo and hi alone
    side_lo = torch.where(any_inf, lo_inf, _step(hi.abs(), rh) * _OUTLIER_GAIN < scale)
    side_hi = torch.where(any_inf, hi_inf & ~lo_inf, ~side_lo & (_step(lo.abs(), rh) * _OUTLIER_GAIN < scale))
    use_hi = side_hi
    s = _step(torch.where(use_hi, a_hi, a_lo), rh)
    outlier = (side_lo | side_hi) & (any_inf | (s * _OUTLIER_GAIN < scale))
    v = torch.where(use_hi, hi, lo)
    p_out, p_aff = _prescale(s), _prescale(scale)
    nan = torch.full_like(lo, float("nan"))
    zero, one = torch.zeros_like(lo), torch.ones_like(lo)
    g = {
        "stat0": torch.where(outlier, v, lo),
        "stat1": torch.where(outlier, -s, scale),
        "p": torch.where(outlier, p_out, p_aff),
        "shift": torch.where(outlier, zero, lo * p_aff),
        "inv256": torch.where(outlier, torch.where(s > 0, (1.0 / (s * p_out)) * 256.0, zero),
                              torch.where(scale > 0, (1.0 / (scale * p_aff)) * 256.0, zero)),
        "off256": torch.where(outlier, float((h + 1) * 256) * one, zero),
        "tlow": torch.where(outlier, 256.0 * one, zero),
        "outlier": torch.where(outlier, v, nan),
    }
    for key, value in (("stat0", nan), ("stat1", nan), ("p", one), ("shift", zero), ("inv256", zero),
                       ("off256", zero), ("tlow", zero), ("outlier", nan)):
        g[key] = torch.where(nan_group, value, g[key])
    return g


def quantize(x: Tensor, bits: int = 8, group_size: int = 128, seed: int = 0, stochastic: bool = True):
    """Reference: returns (codes as int64 [rows, D], stats float32 [rows, groups, 2]), following
    csrc/common/quant_math.h operation by operation in float32."""
    d = x.shape[-1] if x.dim() > 0 else 1
    if d == 0:  # as the kernels' layout: no rows when the last dimension is empty
        return torch.empty(0, 0, dtype=torch.int64), torch.empty(0, 0, 2, dtype=torch.float32)
    rows = x.reshape(-1, d).float()
    groups = (d + group_size - 1) // group_size
    qmax = (1 << bits) - 1
    codes = torch.empty(rows.shape, dtype=torch.int64)
    stats = torch.empty(rows.shape[0], groups, 2, dtype=torch.float32)
    index = torch.arange(rows.numel(), dtype=torch.int64).reshape(rows.shape)
    for gi in range(groups):
        cols = slice(gi * group_size, (gi + 1) * group_size)
        part = rows[:, cols]
        g = _quant_group(part, qmax)
        b = hash_byte(seed, index[:, cols]) if stochastic else torch.full_like(index[:, cols], 128)
        t = (part * g["p"] - g["shift"]) * g["inv256"] + g["off256"]
        t = torch.where(t >= g["tlow"], t, g["tlow"])  # NaN takes tlow, as the kernels' comparison
        t = torch.where(t <= 256.0 * qmax, t, torch.full_like(t, 256.0 * qmax))
        # code_of(): RN(t + b) >> 8, the rounding done by a float32 add at 2^23, where the unit is 1
        z = t + (_MAGIC + b.float())
        q = (z.view(torch.int32).long() >> 8) & 0xFF
        codes[:, cols] = torch.where(part == g["outlier"], 0, q)
        stats[:, gi, 0] = g["stat0"][:, 0]
        stats[:, gi, 1] = g["stat1"][:, 0]
    return codes, stats


def dequantize(codes: Tensor, stats: Tensor, group_size: int, shape, dtype, bits: int) -> Tensor:
    """Reference of quant_math.h's dequant_group() / dequantize_value()."""
    d = codes.shape[-1]
    qmax = (1 << bits) - 1
    stat0 = stats[..., 0].repeat_interleave(group_size, dim=1)[:, :d]
    stat1 = stats[..., 1].repeat_interleave(group_size, dim=1)[:, :d]
    is_outlier = torch.signbit(stat1) & ~stat1.isnan()
    huge = stat1 > _HUGE
    half = torch.where(huge, 0.5, 1.0)
    base = torch.where(is_outlier, 0.0, stat0 * half)
    step = torch.where(is_outlier, -stat1, stat1 * half)
    off = torch.where(is_outlier, float((qmax - 1) // 2 + 1), 0.0)
    unscale = torch.where(is_outlier, 1.0, torch.where(huge, 2.0, 1.0))
    q = codes.float()
    x = (base + (q - off) * step) * unscale
    x = torch.where(x > _FLT_MAX, _FLT_MAX, x)
    x = torch.where(x < -_FLT_MAX, -_FLT_MAX, x)
    x = torch.where(is_outlier & (codes == 0), stat0, x)
    return x.to(dtype).reshape(shape)


# ---------------------------------------------------------------------------
# Adam with 8-bit moments (effmem::adam8_step_), following
# csrc/common/adam8_math.h and adam_math.h operation by operation in float32
# (the 8-bit format's own formulas: effmem.optim._adam8), so the CPU kernel
# must agree bit for bit.


def _pow_step(base: float, step: float) -> float:
    """adam_math.h's pow_step: beta^t by repeated squaring in double."""
    n, result = int(step + 0.5), 1.0
    while n > 0:
        if n & 1:
            result *= base
        base *= base
        n >>= 1
    return result


def _bias_corrections(beta1: float, beta2: float, enabled: bool, step: float):
    """1 - beta^t of both moments at step count t, in double (adam_math.h's), or 1 without bias correction."""
    return (1.0 - _pow_step(beta1, step), 1.0 - _pow_step(beta2, step)) if enabled else (1.0, 1.0)


def adam_coeffs(lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction, step, grad_scale=1.0):
    """adam_math.h's adam_coeffs: the per-tensor constants, each rounded to float32 where the kernel does."""
    import math
    import numpy as np
    f = np.float32
    lr = float(f(lr))
    bc1, bc2 = _bias_corrections(beta1, beta2, bias_correction, step)
    return dict(beta1=f(beta1), beta2=f(beta2), omb1=f(1.0 - beta1), omb2=f(1.0 - beta2), eps=f(eps),
                l2=not decoupled and weight_decay != 0.0, weight_decay=f(weight_decay),
                decay=f(1.0 - lr * weight_decay if decoupled else 1.0), step_size=f(lr / bc1),
                inv_bc2_sqrt=f(1.0 / math.sqrt(bc2)), grad_scale=f(grad_scale))


def adam_update_f32(p: Tensor, m: Tensor, v: Tensor, g: Tensor, c: dict):
    """adam_math.h's adam_update on float32 tensors, one IEEE operation at a time; returns (p, m, v)."""
    def s(x):
        return torch.tensor(float(x), dtype=torch.float32)
    g = g * s(c["grad_scale"])
    if c["l2"]:
        g = g + p * s(c["weight_decay"])
    else:
        p = p * s(c["decay"])
    m = s(c["beta1"]) * m + s(c["omb1"]) * g
    v = s(c["beta2"]) * v + s(c["omb2"]) * g * g
    denom = sqrt32(v) * s(c["inv_bc2_sqrt"]) + s(c["eps"])
    return p - s(c["step_size"]) * (m / denom), m, v


def sqrt32(x: Tensor) -> Tensor:
    """The correctly rounded float32 square root (as the kernels' sqrtps and CUDA's sqrtf): through
    float64, whose rounding to float32 again is exact for a square root. torch's own float32 sqrt on the
    CPU is not correctly rounded for every input (seen: 0x1.01a242p-27 gives one ulp too much)."""
    return x.double().sqrt().float()


def adam8_step(master: Tensor, grad: Tensor, m_codes: Tensor, v_codes: Tensor, m_scales: Tensor,
               v_scales: Tensor, step: float, salt: int, **hyper):
    """One step with 8-bit moments on flat float32 `master` and float `grad`; returns the new
    (master, m_codes, v_codes, m_scales, v_scales)."""
    from effmem.optim import _adam8
    c = adam_coeffs(step=step, **hyper)
    m = _adam8.decode(m_codes, m_scales, False)
    v = _adam8.decode(v_codes, v_scales, True)
    p, m, v = adam_update_f32(master.float(), m, v, grad.float(), c)
    r = sqrt32(v)
    mc, ms = _adam8.encode(_adam8.kept_m(m, r), _adam8.seed(step, salt, False), False)
    vc, vs = _adam8.encode(r, _adam8.seed(step, salt, True), True)
    return p, mc, vc, ms, vs


def delay_correction_weights(master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, dtype,
                             group: dict, lr: float, step: float, grad_scale: float = 1.0) -> Tensor:
    """OffloadAdam(delay=True, delay_correction=True): the weights the next forward reads, from the float32
    state after `step` updates (run with `lr` and group's other hyper-parameters) and the next gradient
    (csrc/common/delay_correction_math.h: delay_predict on the host, rounded to `dtype`, then delay_correct),
    operation by operation in float32."""
    import math
    f = lambda x: torch.tensor(x, dtype=torch.float32, device=master.device)   # noqa: E731  (a double rounded once)
    lr = float(f(lr))
    (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
    decoupled = group.get("decoupled_weight_decay", True)
    bc1, bc2 = _bias_corrections(b1, b2, group.get("bias_correction", True), step + 1.0)
    r_dtype = torch.bfloat16 if dtype == torch.float16 else dtype   # float16's range would flush small r to 0
    wd2 = f(0.0 if decoupled else (1.0 - b2) / bc2 * wd * wd)
    if float(wd2) == 0.0:
        r = sqrt32(exp_avg_sq) * f(math.sqrt(b2 / bc2))
    else:   # the weight decay's share of the new v too
        r = sqrt32(exp_avg_sq * f(b2 / bc2) + wd2 * (master * master))
    r = r.to(r_dtype).float()
    decay, l2 = (f(1.0 - lr * wd), f(0.0)) if decoupled else (f(1.0), f(lr * (1.0 - b1) * wd / bc1))
    pred = master * decay - (f(lr * b1 / bc1) * exp_avg + l2 * master) / (r + f(eps))
    pred = pred.to(dtype).float()
    gs = grad.float() * f(grad_scale)
    gs = torch.where(gs.abs() <= torch.finfo(torch.float32).max, gs, torch.zeros_like(gs))   # GradScaler's skip
    d = sqrt32(r * r + f((1.0 - b2) / bc2) * (gs * gs)) + f(eps)
    return (pred - f(lr * (1.0 - b1) / bc1) * gs / d).to(dtype)
