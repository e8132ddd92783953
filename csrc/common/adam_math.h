// The Adam/AdamW update for one element (or one SIMD vector of elements),
// written once for host and device code.
//
// F is `float` on the GPU and in scalar CPU loops, or a SIMD float vector type
// (csrc/cpu/simd_*.h) that defines + - * / and sqrt_() lane-wise. Every
// operation here is a single IEEE-754 op (correctly rounded on both CPU and
// CUDA), and the sources are built without floating-point contraction
// (-ffp-contract=off, nvcc --fmad=false), so the CPU and CUDA kernels produce
// the same bits for the same inputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "hd.h"


namespace effmem {

// Per-tensor coefficients, computed once per tensor per step from the
// hyper-parameters and the step count (see adam_coeffs below).
struct AdamCoeffs {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;   // L2 mode: added to the gradient as wd * param
  float decay_factor;   // AdamW mode: param *= 1 - lr * wd
  float step_size;      // lr / (1 - beta1^t)
  float inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^t)
  float grad_scale;     // multiplies the gradient (grad scaler's inverse scale)
  bool l2;              // weight decay added to the gradient (Adam) rather than decoupled
};

// beta^t for an integer step count t, by repeated squaring: only IEEE double
// multiplies, so host and device get the same bits (libm's and CUDA's pow()
// differ in the last double ulp for some inputs). Relative error ~log2(t) ulps.
EFFMEM_HD double pow_step(double base, double step) {
  int64_t n = static_cast<int64_t>(step + 0.5);
  double result = 1.0;
  while (n > 0) {
    if (n & 1) result *= base;
    base *= base;
    n >>= 1;
  }
  return result;
}

// Why a step would be refused: 1 for an lr that is negative or not finite,
// 2 for a step count (after this step) that is not a whole number in
// [1, 2^63) (0 divides by zero in the bias corrections; pow_step's int64
// conversion is undefined beyond). 0: fine.
EFFMEM_HD int adam_refusal(double lr, double step) {
  const bool lr_ok = lr >= 0.0 && lr <= 1.7976931348623157e308;  // false for NaN
  const bool step_ok = step >= 1.0 && step < 9223372036854775808.0 && floor(step) == step;
  return (lr_ok ? 0 : 1) | (step_ok ? 0 : 2);
}

// Bias corrections are computed in double and rounded to float once.
EFFMEM_HD AdamCoeffs adam_coeffs(double lr, double beta1, double beta2, double eps,
                                 double weight_decay, bool decoupled, bool bias_correction,
                                 double step, double grad_scale) {
  // lr may arrive as a double (Python float) or read from a float32 tensor
  // (CUDA-graph-friendly); rounding it to float first makes both give the
  // same bits.
  lr = static_cast<double>(static_cast<float>(lr));
  AdamCoeffs c;
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.l2 = !decoupled && weight_decay != 0.0;
  c.weight_decay = static_cast<float>(weight_decay);
  c.decay_factor = static_cast<float>(decoupled ? 1.0 - lr * weight_decay : 1.0);
  const double bc1 = bias_correction ? 1.0 - pow_step(beta1, step) : 1.0;
  const double bc2 = bias_correction ? 1.0 - pow_step(beta2, step) : 1.0;
  c.step_size = static_cast<float>(lr / bc1);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / sqrt(bc2));
  c.grad_scale = static_cast<float>(grad_scale);
  return c;
}

EFFMEM_HD float sqrt_(float x) { return sqrtf(x); }

// One Adam step on master weight p with moments m, v and gradient g (already
// in float). Formula, with t the step count:
//   g  = g * grad_scale                         (+ wd * p in L2 mode)
//   p  = p * (1 - lr * wd)                      (AdamW mode)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps)
// The bias correction of v multiplies by a per-tensor reciprocal rather than
// dividing (torch's fused AdamW divides): one division per element instead of
// two, which matters once a CPU's memory is fast enough to make this compute
// bound. The results differ from torch's in the last bit at most per step.
template <class F>
EFFMEM_HD void adam_update(F& p, F& m, F& v, F g, const AdamCoeffs& c) {
  g = g * F(c.grad_scale);
  if (c.l2) {
    g = g + p * F(c.weight_decay);
  } else {
    p = p * F(c.decay_factor);
  }
  m = F(c.beta1) * m + F(c.one_minus_beta1) * g;
  v = F(c.beta2) * v + F(c.one_minus_beta2) * g * g;
  const F denom = sqrt_(v) * F(c.inv_bc2_sqrt) + F(c.eps);
  p = p - F(c.step_size) * (m / denom);
}

}  // namespace effmem
