// OffloadAdam(delay=True, delay_correction=True): the next step's weights, predicted on the device from the
// gradient it has just made, so that the next forward runs on (nearly) the weights exact Adam would give it
// instead of one step old ones. Written once for the host backend and the CUDA kernel (the same bits).
//
// Step t+1 of Adam (adam_math.h; c the clip/unscale factor, D = sqrt(v_{t+1} / bc2) + eps) splits into a
// part the host knows when its update of step t ends, and a part only the device has:
//   w_{t+1} = w_t * (1 - lr wd) - lr / bc1 * (beta1 m_t + (1 - beta1) (c g)) / D,
//   v_{t+1} = beta2 v_t + (1 - beta2) (c g)^2.
// The host writes, beside the new weights (predict):
//   r    = sqrt(beta2 v_t / bc2)                                      (the new v without the new gradient)
//   pred = w_t * (1 - lr wd) - lr / bc1 * (beta1 m_t + L2 term) / (r + eps)
// and the device, once backward has made g (correct):
//   w    = pred - lr (1 - beta1) / bc1 * (c g) / (sqrt(r^2 + (1 - beta2) / bc2 (c g)^2) + eps).
// The gradient's part has Adam's exact denominator (a first gradient, v_t = 0, moves a weight by at most
// about lr (1 - beta1) / sqrt(1 - beta2) / bc1 * sqrt(bc2), as Adam's own step); the momentum's part lacks
// only the new gradient's share of v. In L2 mode (Adam: the weight decay wd w added to the gradient) r also
// takes that known part's share, r = sqrt((beta2 v_t + (1 - beta2) (wd w)^2) / bc2), so that its term in
// pred is bounded as Adam's step is (only the cross term 2 (c g) (wd w) of v is left out). r is kept in the
// weights' dtype, except bf16 for float16 weights (whose range would flush a small r to 0). `c` is the
// previous step's factor (the clip norm is not known yet), a non-finite gradient (a step GradScaler will skip)
// adds nothing, and the learning rate is the previous update's (a scheduler's change reaches the prediction a
// step late). Only the weights the next forward reads are predicted: the host's master, moments and weights
// stay exact Adam, fed the gradients taken at the predicted weights.
#pragma once

#include <cmath>
#include <type_traits>

#include "adam_math.h"
#include "float_bits.h"
#include "hd.h"

namespace effmem {

// How r is stored for weights stored as T.
template <class T>
using DelayR = std::conditional_t<std::is_same_v<T, f16_t>, bf16_t, T>;

struct DelayPrediction {
  float decay_factor;  // 1 - lr wd (AdamW), 1 (Adam)
  float momentum;      // lr beta1 / bc1
  float l2;            // lr (1 - beta1) wd / bc1 in L2 mode, else 0: the weight decay's share of the gradient
  float v_scale;       // sqrt(beta2 / bc2)
  float v_coef;        // L2 mode: beta2 / bc2
  float wd2;           // L2 mode: (1 - beta2) / bc2 * wd^2, else 0
  float eps;
};

struct DelayCorrection {
  float grad_scale;  // the clip/unscale factor of the update that made the prediction
  float step;        // lr (1 - beta1) / bc1
  float g2_scale;    // (1 - beta2) / bc2
  float eps;
};

struct DelayCoeffs {
  DelayPrediction predict;
  DelayCorrection correct;
};

// Both halves' constants for the step after `step` (the count after the host's update), from the update's
// hyper-parameters and clip/unscale factor, as adam_coeffs takes them (lr rounded to float first; the bias
// corrections in double, rounded once).
EFFMEM_HD DelayCoeffs delay_coeffs(double lr, double beta1, double beta2, double eps, double weight_decay,
                                   bool decoupled, bool bias_correction, double step, double grad_scale) {
  lr = static_cast<double>(static_cast<float>(lr));
  const double bc1 = bias_correction ? 1.0 - pow_step(beta1, step + 1.0) : 1.0;
  const double bc2 = bias_correction ? 1.0 - pow_step(beta2, step + 1.0) : 1.0;
  DelayCoeffs c;
  c.predict.decay_factor = static_cast<float>(decoupled ? 1.0 - lr * weight_decay : 1.0);
  c.predict.momentum = static_cast<float>(lr * beta1 / bc1);
  c.predict.l2 = static_cast<float>(decoupled ? 0.0 : lr * (1.0 - beta1) * weight_decay / bc1);
  c.predict.v_scale = static_cast<float>(sqrt(beta2 / bc2));
  c.predict.v_coef = static_cast<float>(beta2 / bc2);
  c.predict.wd2 = static_cast<float>(decoupled ? 0.0 : (1.0 - beta2) / bc2 * weight_decay * weight_decay);
  c.predict.eps = static_cast<float>(eps);
  c.correct = {static_cast<float>(grad_scale), static_cast<float>(lr * (1.0 - beta1) / bc1),
               static_cast<float>((1.0 - beta2) / bc2), static_cast<float>(eps)};
  return c;
}

// The host's half, from the master weight and moments after its update. pred takes r as stored (`round`:
// the rounding of r's storage type), which the device reads back. F is float, or a CPU kernel's SIMD vector
// (as adam_update's): the same IEEE operations either way.
template <class F, class Round>
EFFMEM_HD void delay_predict(F w, F m, F v, const DelayPrediction& c, Round round, F* pred, F* r) {
  *r = round(c.wd2 == 0.0f ? sqrt_(v) * F(c.v_scale) : sqrt_(v * F(c.v_coef) + F(c.wd2) * (w * w)));
  *pred = w * F(c.decay_factor) - (F(c.momentum) * m + F(c.l2) * w) / (*r + F(c.eps));
}

// The device's half.
EFFMEM_HD float delay_correct(float pred, float r, float g, const DelayCorrection& c) {
  float gs = g * c.grad_scale;
  if (!(fabsf(gs) <= 3.40282347e38f)) gs = 0.0f;  // inf or NaN: GradScaler skips this step
  const float d = sqrtf(r * r + c.g2_scale * (gs * gs)) + c.eps;
  return pred - c.step * gs / d;
}

}  // namespace effmem
