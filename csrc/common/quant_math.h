// Group-wise quantisation of one element, written once for host and device.
//
// A group is up to group_size consecutive elements of one row (the last
// dimension). The kernels reduce each group to lo = min and hi = max (NaN
// ignored) and whether it holds a NaN; quant_side() then says whether the
// group might need the outlier encoding below and for which extreme v, and
// only then do the kernels reduce it once more, to a = max |x| over x != v.
// quant_group() picks the encoding, held in the group's two stats floats;
// qmax = 2^bits - 1.
//
// Affine, stats = (lo, scale) with scale >= +0 (the usual case):
//   scale = (hi - lo) / qmax          (halves first if hi - lo overflows; a
//                                      subnormal result is rounded up, see quant_step)
//   q     = clamp(floor((x*p - lo*p) * inv + u), 0, qmax)     inv = 1 / (scale*p), 0 if scale = 0
//   x'    = (lo*d + q * (scale*d)) / d,  clamped to +-FLT_MAX
// p = 1/2 when scale > 2^100 (x - lo could overflow), 2^100 when
// 0 < scale < 2^-100 (1 / scale would overflow), else 1; d = 1/2 when
// scale > 2^100, else 1. Powers of two scale exactly: p and d change the
// result only where the plain formula would leave the float range.
//
// Outlier, stats = (v, -s), the second float's sign bit set: one extreme value
// v (lo or hi, however often it occurs) is kept exactly as code 0, and the
// other values are stored symmetrically with step s = a / h (h = (qmax - 1) / 2,
// mid = h + 1):
//   q  = x == v ? 0 : clamp(floor(x*p * inv + mid + u), 1, qmax)   inv = 1 / (s*p), 0 if s = 0
//   x' = q == 0 ? v : (q - mid) * s
// (p as above for s). Used when the group holds -inf (v = lo) or +inf
// (v = hi) but not both, or when it is finite and s is 16x finer than the
// affine step: a masked position (torch.finfo(dtype).min, or -inf) among
// ordinary values no longer costs the whole group its precision. Since a
// is at least the other extreme's magnitude, at most one side can qualify,
// and an ordinary group (extremes of similar size) none: quant_side() tells
// from lo and hi alone, so most groups skip the second reduction.
//
// A group holding NaN, or both -inf and +inf, stores (NaN, NaN) and
// dequantises to NaN: such activations stay non-finite.
//
// u = 0.5 rounds to nearest; u uniform in [0, 1) (stochastic rounding) makes
// E[x'] = x. u comes from a counter-based hash of (seed, element index), so
// the CPU and CUDA kernels produce the same codes for the same seed.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/float_bits.h"
#include "common/hd.h"

namespace effmem {

// A 32-bit avalanche finaliser (xor-shift / multiply rounds).
EFFMEM_HD uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// Uniform in [0, 1) with 24 random bits (exact in float), from the element
// index's low and high 32-bit halves. Split in two so a CPU loop over one
// group can mix the (constant) high half once and vectorise the rest.
EFFMEM_HD uint32_t hash_high(uint64_t seed, uint32_t index_hi) {
  return mix32(index_hi + 0x7f4a7c15u + static_cast<uint32_t>(seed >> 32));
}

EFFMEM_HD float hash_uniform_low(uint64_t seed, uint32_t index_lo, uint32_t high_mix) {
  const uint32_t h = mix32((index_lo * 0x9e3779b1u + static_cast<uint32_t>(seed)) ^ high_mix);
  return static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
}

EFFMEM_HD float hash_uniform(uint64_t seed, uint64_t index) {
  return hash_uniform_low(seed, static_cast<uint32_t>(index), hash_high(seed, static_cast<uint32_t>(index >> 32)));
}

// Scale thresholds beyond which the formulas above pre-scale by a power of two.
constexpr float kQuantHugeScale = 0x1p100f;
constexpr float kQuantTinyScale = 0x1p-100f;
// How much finer the outlier encoding's step must be before it is used.
constexpr float kOutlierGain = 16.0f;

// Everything quantize_value() needs for one group, and the two stats floats.
struct QuantGroup {
  float stat0, stat1;  // stored: (lo, scale) or (v, -s)
  float p;             // pre-scale of x
  float shift;         // lo*p (affine) or 0 (outlier)
  float inv;           // 1 / (scale*p) or 1 / (s*p); 0 for a zero step
  float off;           // 0 (affine) or mid (outlier)
  float qlow;          // lowest code for an ordinary value: 0 (affine) or 1 (outlier)
  float outlier;       // the value coded 0 (outlier); NaN (affine: equals nothing)
};

EFFMEM_HD float quant_prescale(float step) {
  return step > kQuantHugeScale ? 0.5f : (step > 0.0f && step < kQuantTinyScale ? 0x1p100f : 1.0f);
}

// span / divisor, as the step of a grid of divisor steps covering span. A
// subnormal step has few significant bits, and rounded down it would leave
// the top of the span beyond the last code: a subnormal step is rounded up
// by one unit in the last place (never to 0 for a span > 0).
EFFMEM_HD float quant_step(float span, float divisor) {
  const float s = span / divisor;
  return s < 0x1p-126f && span > 0.0f ? float_of(bits_of(s) + 1u) : s;
}

// Which extreme might be kept apart: -1 lo, +1 hi, 0 neither (the affine
// encoding, or a NaN group); and the affine scale, computed once here.
struct QuantSide {
  int side;
  float scale;
  bool nan_group;
};

EFFMEM_HD QuantSide quant_side(float lo, float hi, bool has_nan, int qmax) {
  QuantSide r;
  r.side = 0;
  r.scale = 0.0f;
  const bool lo_inf = lo == -INFINITY, hi_inf = hi == INFINITY;
  r.nan_group = has_nan || (lo_inf && hi_inf);
  if (r.nan_group) return r;
  if (lo_inf || hi_inf) {
    r.side = lo_inf ? -1 : 1;
    return r;
  }
  const float diff = hi - lo;
  r.scale = diff == INFINITY ? ((hi * 0.5f - lo * 0.5f) / static_cast<float>(qmax)) * 2.0f
                             : quant_step(diff, static_cast<float>(qmax));
  // a (over the values other than v) is at least the other extreme's magnitude
  const float h = static_cast<float>((qmax - 1) / 2);
  if (quant_step(hi < 0.0f ? -hi : hi, h) * kOutlierGain < r.scale) {
    r.side = -1;
  } else if (quant_step(lo < 0.0f ? -lo : lo, h) * kOutlierGain < r.scale) {
    r.side = 1;
  }
  return r;
}

// a: max |x| over the group's values other than the side's extreme (unused when side is 0).
EFFMEM_HD QuantGroup quant_group(float lo, float hi, const QuantSide& side, float a, int qmax) {
  QuantGroup g;
  g.off = 0.0f;
  g.qlow = 0.0f;
  g.outlier = NAN;
  if (side.nan_group) {
    g.stat0 = g.stat1 = NAN;
    g.p = 1.0f;
    g.shift = g.inv = 0.0f;
    return g;
  }
  const float h = static_cast<float>((qmax - 1) / 2);
  const float s = quant_step(a, h);
  const bool forced = lo == -INFINITY || hi == INFINITY;
  if (side.side != 0 && (forced || s * kOutlierGain < side.scale)) {
    const float v = side.side < 0 ? lo : hi;
    g.stat0 = v;
    g.stat1 = -s;
    g.p = quant_prescale(s);
    g.shift = 0.0f;
    g.inv = s > 0.0f ? 1.0f / (s * g.p) : 0.0f;
    g.off = h + 1.0f;
    g.qlow = 1.0f;
    g.outlier = v;
  } else {
    g.stat0 = lo;
    g.stat1 = side.scale;
    g.p = quant_prescale(side.scale);
    g.shift = lo * g.p;
    g.inv = side.scale > 0.0f ? 1.0f / (side.scale * g.p) : 0.0f;
  }
  return g;
}

EFFMEM_HD uint32_t quantize_value(float x, const QuantGroup& g, float u, int qmax) {
  float q = floorf((x * g.p - g.shift) * g.inv + g.off + u);
  // clamp to [qlow, qmax]; NaN (only in a NaN group, coded 0) fails the first test
  q = q >= g.qlow ? q : g.qlow;
  q = q < static_cast<float>(qmax) ? q : static_cast<float>(qmax);
  // via int32: one vector instruction, where float -> uint32 has none
  const uint32_t code = static_cast<uint32_t>(static_cast<int32_t>(q));
  return x == g.outlier ? 0u : code;
}

// Per-group constants of dequantize_value(), from the two stats floats.
struct DequantGroup {
  float base;     // lo*d (affine) or 0 (outlier)
  float step;     // scale*d or s
  float off;      // 0 or mid
  float unscale;  // 1/d (affine) or 1
  float outlier;  // code 0's value (outlier) ; used only when is_outlier
  bool is_outlier;
};

EFFMEM_HD DequantGroup dequant_group(float stat0, float stat1, int qmax) {
  DequantGroup d;
  d.is_outlier = (bits_of(stat1) >> 31) != 0u && stat1 == stat1;  // sign bit set, not NaN
  d.outlier = stat0;
  if (d.is_outlier) {
    d.base = 0.0f;
    d.step = -stat1;
    d.off = static_cast<float>((qmax - 1) / 2 + 1);
    d.unscale = 1.0f;
  } else {
    const float half = stat1 > kQuantHugeScale ? 0.5f : 1.0f;
    d.base = stat0 * half;
    d.step = stat1 * half;
    d.off = 0.0f;
    d.unscale = stat1 > kQuantHugeScale ? 2.0f : 1.0f;
  }
  return d;
}

EFFMEM_HD float dequantize_value(uint32_t q, const DequantGroup& d) {
  float x = (d.base + (static_cast<float>(static_cast<int32_t>(q)) - d.off) * d.step) * d.unscale;
  // a rounded-up top code of a group spanning most of the float range must not become inf
  x = x > 3.402823466e38f ? 3.402823466e38f : x;
  x = x < -3.402823466e38f ? -3.402823466e38f : x;
  return d.is_outlier && q == 0u ? d.outlier : x;
}

}  // namespace effmem
