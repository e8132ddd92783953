// Group-wise quantisation of one element, written once for host and device.
//
// A group is up to group_size consecutive elements of one row (the last
// dimension). The kernels reduce each group to lo = min and hi = max and
// whether it holds a NaN; quant_side() then says whether the group might
// need the outlier encoding below and for which extreme v, and only then do
// the kernels reduce it once more, to a = max |x| over x != v. quant_group()
// picks the encoding, held in the group's two stats floats; qmax = 2^bits - 1.
// Divisions by the constants qmax and h are multiplications by their float
// reciprocals (quant_step), so the per-group work stays small next to the
// per-element work on a GPU.
//
// Codes are rounded on a grid 256 times finer than the code's step: with
// t = 256 * (the value in units of the step from the code 0), clamped to
// [256*qlow, 256*qmax], and a rounding byte b (below),
//   q = RN(t + b) >> 8      (RN: round to nearest even)
// so b = 128 rounds to nearest and a uniformly random b rounds
// stochastically: E[q] = RN(t) / 256, within 1/512 of t / 256 (a bias of at
// most 1/512 of a step). The FPU does RN and the shift at once: t + (2^23 + b)
// is a float whose unit is 1, and its bits hold RN(t + b) below bit 16
// (code_of), so a code costs an add and a byte select.
//
// Affine, stats = (lo, scale) with scale >= +0 (the usual case):
//   scale = (hi - lo) * (1/qmax)      (halves first if hi - lo overflows; a
//                                      subnormal result is rounded up, see quant_step)
//   t     = clamp((x*p - lo*p) * inv256, 0, 256*qmax)     inv256 = (1 / (scale*p)) * 256, 0 if scale = 0
//   x'    = (lo*d + q * (scale*d)) / d,  clamped to +-FLT_MAX
// p = 1/2 when scale > 2^100 (x - lo could overflow), 2^100 when
// 0 < scale < 2^-100 (1 / scale would overflow), else 1; d = 1/2 when
// scale > 2^100, else 1. Powers of two scale exactly: p and d change the
// result only where the plain formula would leave the float range. A group
// with p = d = 1 (nearly all) is "plain": there the formulas reduce to
//   t = min((x - lo) * inv256, 256*qmax),   x' = lo + q * scale
// which quantize_plain()/dequantize_plain() compute with fewer instructions
// and the same bits (quant_is_plain / dequant_is_plain say when).
//
// Outlier, stats = (v, -s), the second float's sign bit set: one extreme value
// v (lo or hi, however often it occurs) is kept exactly as code 0, and the
// other values are stored symmetrically with step s = a * (1/h) (h = (qmax - 1) / 2,
// mid = h + 1):
//   t  = clamp(x*p * inv256 + 256*mid, 256, 256*qmax)   inv256 = (1 / (s*p)) * 256, 0 if s = 0
//   q  = x == v ? 0 : RN(t + b) >> 8
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
// The rounding byte: 128 to round to nearest; for stochastic rounding, from a
// counter-based hash, one 32-bit hash_word() per four consecutive elements
// (by flat index i): element i takes byte i % 4 of hash_word(seed, i / 4).
// The CPU and CUDA kernels produce the same codes for the same seed.
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

// The hash of word `word` (= element index / 4), from its low and high
// 32-bit halves. Split in two so a loop over one group mixes the (constant)
// high half once.
EFFMEM_HD uint32_t hash_high(uint64_t seed, uint32_t word_hi) {
  return mix32(word_hi + 0x7f4a7c15u + static_cast<uint32_t>(seed >> 32));
}

EFFMEM_HD uint32_t hash_word_low(uint64_t seed, uint32_t word_lo, uint32_t high_mix) {
  return mix32(word_lo * 0x9e3779b1u + (static_cast<uint32_t>(seed) ^ high_mix));
}

EFFMEM_HD uint32_t hash_word(uint64_t seed, uint64_t word) {
  return hash_word_low(seed, static_cast<uint32_t>(word), hash_high(seed, static_cast<uint32_t>(word >> 32)));
}

// The rounding byte of element `index` under stochastic rounding.
EFFMEM_HD uint32_t hash_byte(uint64_t seed, uint64_t index) {
  return (hash_word(seed, index >> 2) >> (8u * static_cast<uint32_t>(index & 3u))) & 0xffu;
}

constexpr uint32_t kNearestByte = 128;  // the rounding byte of round-to-nearest
constexpr uint32_t kMagicBits = 0x4b000000u;  // 2^23: floats from here to 2^24 have unit 1

// RN(t + b) >> 8 for 0 <= t <= 256 * 255 (see the top): t + (2^23 + b) is rounded to an integer by the
// add itself, and t + b < 2^16 sits in the low 16 bits of the result.
EFFMEM_HD uint32_t code_of(float t, uint32_t b) { return (bits_of(t + float_of(kMagicBits | b)) >> 8) & 0xffu; }

// Scale thresholds beyond which the formulas above pre-scale by a power of two.
constexpr float kQuantHugeScale = 0x1p100f;
constexpr float kQuantTinyScale = 0x1p-100f;
// How much finer the outlier encoding's step must be before it is used.
constexpr float kOutlierGain = 16.0f;

// 1/d rounded to float, for the divisors qmax (255, 15) and h (127, 7); the
// Python reference uses the same float32 values.
EFFMEM_HD float quant_recip(int d) {
  switch (d) {
    case 255: return 0x1.010102p-8f;
    case 127: return 0x1.020408p-7f;
    case 15: return 0x1.111112p-4f;
    default: return 0x1.24924ap-3f;  // 7
  }
}

// Everything quantize_value() needs for one group, and the two stats floats.
struct QuantGroup {
  float stat0, stat1;  // stored: (lo, scale) or (v, -s)
  float p;             // pre-scale of x
  float shift;         // lo*p (affine) or 0 (outlier)
  float inv256;        // (1 / (scale*p)) * 256 or (1 / (s*p)) * 256; 0 for a zero step
  float off256;        // 0 (affine) or 256*mid (outlier)
  float tlow, thigh;   // t's range: 256 * the lowest code for an ordinary value (0 affine, 1 outlier), 256*qmax
  float outlier;       // the value coded 0 (outlier); NaN (affine: equals nothing)
};

EFFMEM_HD float quant_prescale(float step) {
  return step > kQuantHugeScale ? 0.5f : (step > 0.0f && step < kQuantTinyScale ? 0x1p100f : 1.0f);
}

// span * recip, as the step of a grid covering span. A subnormal step has few
// significant bits, and rounded down it would leave the top of the span
// beyond the last code: a subnormal step is rounded up by one unit in the
// last place (never to 0 for a span > 0).
EFFMEM_HD float quant_step(float span, float recip) {
  const float s = span * recip;
  return s < 0x1p-126f && span > 0.0f ? float_of(bits_of(s) + 1u) : s;
}

// Which extreme might be kept apart: -1 lo, +1 hi, 0 neither (the affine
// encoding, or a NaN group); and the affine scale, computed once here.
struct QuantSide {
  int side;
  float scale;
  bool nan_group;
};

// lo or hi may be NaN when the kernel's min/max propagate NaN; has_nan says
// so where they skip it. Either way the group is a NaN group.
EFFMEM_HD QuantSide quant_side(float lo, float hi, bool has_nan, int qmax) {
  QuantSide r;
  r.side = 0;
  r.scale = 0.0f;
  const bool lo_inf = lo == -INFINITY, hi_inf = hi == INFINITY;
  r.nan_group = has_nan || lo != lo || hi != hi || (lo_inf && hi_inf);
  if (r.nan_group) return r;
  if (lo_inf || hi_inf) {
    r.side = lo_inf ? -1 : 1;
    return r;
  }
  const float diff = hi - lo;
  const float rq = quant_recip(qmax);
  r.scale = diff == INFINITY ? ((hi * 0.5f - lo * 0.5f) * rq) * 2.0f : quant_step(diff, rq);
  // a (over the values other than v) is at least the other extreme's magnitude
  const float rh = quant_recip((qmax - 1) / 2);
  if (quant_step(hi < 0.0f ? -hi : hi, rh) * kOutlierGain < r.scale) {
    r.side = -1;
  } else if (quant_step(lo < 0.0f ? -lo : lo, rh) * kOutlierGain < r.scale) {
    r.side = 1;
  }
  return r;
}

// a: max |x| over the group's values other than the side's extreme (unused when side is 0).
EFFMEM_HD QuantGroup quant_group(float lo, float hi, const QuantSide& side, float a, int qmax) {
  // One zero: a group holding both +0 and -0 may get either as its min or max (the CPU keeps the first
  // it meets, CUDA's min/max instructions another), and the stats must not differ in the sign bit.
  lo += 0.0f;
  hi += 0.0f;
  QuantGroup g;
  g.off256 = 0.0f;
  g.tlow = 0.0f;
  g.thigh = 256.0f * static_cast<float>(qmax);
  g.outlier = NAN;
  if (side.nan_group) {  // every code 0: t is 0 for finite x, NaN (clamped to 0) otherwise
    g.stat0 = g.stat1 = NAN;
    g.p = 1.0f;
    g.shift = g.inv256 = 0.0f;
    return g;
  }
  const float h = static_cast<float>((qmax - 1) / 2);
  const float s = quant_step(a, quant_recip((qmax - 1) / 2));
  const bool forced = lo == -INFINITY || hi == INFINITY;
  if (side.side != 0 && (forced || s * kOutlierGain < side.scale)) {
    const float v = side.side < 0 ? lo : hi;
    g.stat0 = v;
    g.stat1 = -s;
    g.p = quant_prescale(s);
    g.shift = 0.0f;
    g.inv256 = s > 0.0f ? (1.0f / (s * g.p)) * 256.0f : 0.0f;
    g.off256 = (h + 1.0f) * 256.0f;
    g.tlow = 256.0f;
    g.outlier = v;
  } else {
    g.stat0 = lo;
    g.stat1 = side.scale;
    g.p = quant_prescale(side.scale);
    g.shift = lo * g.p;
    g.inv256 = side.scale > 0.0f ? (1.0f / (side.scale * g.p)) * 256.0f : 0.0f;
  }
  return g;
}

// b: the rounding byte (kNearestByte, or hash_byte() of the element).
EFFMEM_HD uint32_t quantize_value(float x, const QuantGroup& g, uint32_t b) {
  float t = (x * g.p - g.shift) * g.inv256 + g.off256;
  t = t >= g.tlow ? t : g.tlow;  // NaN (x = NaN or +-inf in a NaN group) fails the test: coded 0 there
  t = t <= g.thigh ? t : g.thigh;
  const uint32_t code = code_of(t, b);
  return x == g.outlier ? 0u : code;
}

// A plain affine group (see the top): p = 1, no outlier, not a NaN group.
EFFMEM_HD bool quant_is_plain(const QuantGroup& g) { return g.p == 1.0f && g.off256 == 0.0f && g.stat1 == g.stat1; }

// quantize_value() for a plain group, where x*p - shift = x - lo exactly,
// + off256 adds 0, and t >= +0 (x >= lo), so only the top clamp remains.
EFFMEM_HD uint32_t quantize_plain(float x, float lo, float inv256, float thigh, uint32_t b) {
  float t = (x - lo) * inv256;
  t = t <= thigh ? t : thigh;
  return code_of(t, b);
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

// A plain affine group's stats: 0 <= scale <= 2^100 (so d = 1) and |lo| <
// 2^127 (so lo + q * scale cannot pass FLT_MAX and the clamps are idle).
// False for NaN stats and for the outlier encoding (negative scale).
EFFMEM_HD bool dequant_is_plain(float stat0, float stat1) {
  return (bits_of(stat1) >> 31) == 0u && stat1 <= kQuantHugeScale && (stat0 < 0.0f ? -stat0 : stat0) < 0x1p127f;
}

// dequantize_value() for a plain group: (lo + (q - 0) * scale) * 1, from the code as a float (exact: q < 2^8).
EFFMEM_HD float dequantize_plain_of(float q, float lo, float scale) { return lo + q * scale; }
EFFMEM_HD float dequantize_plain(uint32_t q, float lo, float scale) {
  return dequantize_plain_of(static_cast<float>(static_cast<int32_t>(q)), lo, scale);
}

}  // namespace effmem
