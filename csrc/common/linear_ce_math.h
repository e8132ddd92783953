// Fused linear cross-entropy, per element, written once for host and device.
//
// For token i with hidden state h_i, target t_i and logits z_ij = h_i . w_j
// (+ b_j) over the vocabulary j < V, computed one vocabulary chunk at a time
// and never all at once:
//   c_ij  = cap * tanh(z_ij / cap)                (logit soft-capping; c = z without)
//   lse_i = log sum_j exp(c_ij)                   (online over chunks: a running max m_i
//                                                  and s_i = sum_j exp(c_ij - m_i))
//   loss_i = (1 - eps) * (lse_i - c_it) + eps * (lse_i - mean_j c_ij)
//                                                 (label smoothing eps; 0 for t_i = ignore_index)
//   dloss_i/dz_ij = (exp(c_ij - lse_i) - (1 - eps) [j = t_i] - eps / V) * dc_ij/dz_ij,
//   dc/dz = 1 - (c / cap)^2                        (1 without soft-capping)
// Everything here is in float; the matrix products around it accumulate in
// float too (see csrc/linear_ce.cpp).
#pragma once

#include <cmath>

#include "common/hd.h"

namespace effmem {

EFFMEM_HD float ce_softcap(float z, float cap) { return cap > 0.0f ? cap * tanhf(z / cap) : z; }

EFFMEM_HD float ce_softcap_grad(float c, float cap) {
  if (!(cap > 0.0f)) return 1.0f;
  const float r = c / cap;
  return 1.0f - r * r;
}

// Running (max, sum of exp relative to it) of one token's logits.
struct OnlineLse {
  float m;  // -inf before any logit
  float s;
};

// Merges a chunk whose max is cmax and whose sum of exp(c - cmax) is csum.
EFFMEM_HD OnlineLse lse_merge(OnlineLse a, float cmax, float csum) {
  if (cmax == -INFINITY) return a;
  if (a.m == -INFINITY) return OnlineLse{cmax, csum};
  const float m = a.m > cmax ? a.m : cmax;
  return OnlineLse{m, a.s * expf(a.m - m) + csum * expf(cmax - m)};
}

EFFMEM_HD float lse_value(OnlineLse a) { return a.m + logf(a.s); }

// The loss of one token from its log-sum-exp, its target's logit and the sum
// of all its logits (used only with label smoothing).
EFFMEM_HD float ce_token_loss(float lse, float c_target, float c_sum, float eps, float vocab) {
  const float nll = lse - c_target;
  return eps > 0.0f ? (1.0f - eps) * nll + eps * (lse - c_sum / vocab) : nll;
}

// d loss_i / d z_ij, times the token's incoming gradient g.
EFFMEM_HD float ce_logit_grad(float c, float lse, bool is_target, float g, float eps, float vocab, float cap) {
  const float p = expf(c - lse);
  const float onehot = is_target ? 1.0f - eps : 0.0f;
  return g * (p - onehot - eps / vocab) * ce_softcap_grad(c, cap);
}

}  // namespace effmem
