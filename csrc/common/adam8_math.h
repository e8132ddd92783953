// 8-bit Adam moments (state_bits=8), written once for host and device code.
//
// A tensor's moments are kept in blocks of kAdam8Block consecutive elements,
// each block with two float32 scales,
//   sm = max |m| over the block,   sv = max sqrt(v) over the block
// (over its finite values: an infinite or NaN moment saturates its own code, adam8_finite),
// and one byte per element for each moment:
//   m: bit 7 the sign, bits 0..6 k in [0, 127]:   m = +-sm * (k/127)^2
//   v: k in [0, 255]:                              v = (sv * (k/255)^2)^2
// so the codes are uniform in sqrt(|m|/sm) and in sqrt(sqrt(v)/sv): the
// square law spends the codes on small values, where a linear code would
// flush most of a block to zero (v spans many orders of magnitude, and the
// update divides by its root).
//
// Each step decodes a block, runs the fp32 Adam update (adam_math.h) on it,
// takes the new scales, and encodes it again, rounding stochastically:
//   k = floor(min(t + u, kmax)),  t = sqrt(|m| / sm) * 127  (v: sqrt(sqrt(v) / sv) * 255)
// with u = (2b + 1) / 512 for the rounding byte b of the element
// (quant_math.h's hash_byte, seeded per tensor and step: adam8_seed).
// Rounding to nearest would freeze the moments: at beta2 = 0.999 a step moves
// v by 0.1%, less than half a code, and v would never decay; stochastic
// rounding keeps each code unbiased (to 1/512 of a code in t). Not the value:
// m decodes as k^2 and v as k^4, so a decoded v is high on average by up to
// 6/(4 t^2) of itself (m: 1/(4 t^2)), and v's running average compounds it:
// elements whose gradients are 1/100 and 1/300 of their block's largest end
// 7% and 13% high, their steps 3-6% short (tests/test_adam8.py). Rounding
// unbiased in the value (lo + 1 with p = (t^P - lo^P) / ((lo+1)^P - lo^P))
// removes it, but took 1.4x (v only) to 1.8x this CPU kernel's time (about
// 25 more operations per moment) and 34 more SASS instructions per element
// on sm_90, in a kernel near its instruction budget, while 8-bit moments,
// bias and all, train no worse than float32 ones (docs/fused_adam.md: -0.87% on the mean
// of 16 seeds, each seed's gap spread twice as wide as two exact runs'):
// kept as it is. A positive v
// never takes code 0: the update would then divide m by eps alone. Blocks
// whose scale is below FLT_MIN (moments below 1e-38) are stored as zero.
//
// Memory: 2 bytes per parameter and 8 bytes per block (0.03 B/param) for
// both moments, against 8 bytes per parameter in float32.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/adam_math.h"
#include "common/float_bits.h"
#include "common/hd.h"
#include "common/quant_math.h"

namespace effmem {

constexpr int kAdam8Block = 256;

// The blocks (and block scales) of a tensor of n elements.
EFFMEM_HD constexpr int64_t adam8_blocks(int64_t n) { return (n + kAdam8Block - 1) / kAdam8Block; }
constexpr float kAdam8InvM = 0x1.020408p-7f;  // 1/127, rounded to float (as quant_recip)
constexpr float kAdam8InvV = 0x1.010102p-8f;  // 1/255

// The seeds of a tensor's two rounding streams at a step count (after the step) and a salt (the
// tensor's place in its optimizer): different for every tensor, step and moment.
EFFMEM_HD uint64_t adam8_seed(float step, int64_t salt, bool second) {
  const uint64_t s = (static_cast<uint64_t>(step) << 32) ^ static_cast<uint64_t>(salt) * 0x9e3779b97f4a7c15ull;
  return second ? s ^ 0xd1b54a32d192ed03ull : s;
}

EFFMEM_HD float adam8_decode_m(uint32_t code, float sm) {
  const float f = static_cast<float>(code & 0x7fu) * kAdam8InvM;
  const float m = sm * (f * f);
  return (code & 0x80u) != 0u ? -m : m;
}

EFFMEM_HD float adam8_decode_v(uint32_t code, float sv) {
  const float f = static_cast<float>(code) * kAdam8InvV;
  const float r = sv * (f * f);
  return r * r;
}

// A block's scales are the maxima of its finite |m| and sqrt(v) (NaN never taken). An infinite one (a
// gradient of 1e21, whose square overflows v, or an infinite gradient) is left out: a scale of inf gave every
// other element of the block code 0 and decoded it as inf * 0 = NaN (256 parameters lost for one bad
// gradient, where float32 moments lose that one at most). It takes the largest code: its own value only is
// clipped to the block's largest finite one. The kernels take the plain maximum first and this only where
// that came out infinite.
constexpr float kAdam8FiniteMax = 0x1.fffffep127f;   // FLT_MAX
EFFMEM_HD float adam8_finite(float x) { return x <= kAdam8FiniteMax ? x : 0.0f; }

// The first moment an encoder keeps: 0 where v overflowed (r = sqrt(v) infinite; a NaN r keeps m). Such a v
// decodes as the block's largest finite one, and the next step divided a first moment of 1e20 (a gradient of
// 1e21) by its root: a weight of -1.7e18, finite, where float32 moments divide by inf and leave the weight
// alone. Dropped, that element's momentum starts afresh from its next gradient, and its block's m scale is the
// other elements' (a scale of 1e20 sent all of them to code 0).
EFFMEM_HD float adam8_kept_m(float m, float r) { return r > kAdam8FiniteMax ? 0.0f : m; }

// 1 / scale for the encoders, 0 for a block stored as zero.
EFFMEM_HD float adam8_inverse(float scale) { return scale >= 0x1p-126f ? 1.0f / scale : 0.0f; }

// t = sqrt(x * inv) * kmax, the code before rounding: x = |m| (kmax 127) or x = sqrt(v) (kmax 255). F is
// float, or a CPU kernel's SIMD vector: the same IEEE operations either way.
template <class F>
EFFMEM_HD F adam8_t(F x, F inv, F kmax) {
  return sqrt_(x * inv) * kmax;
}

// The code before truncation: min(t + u, kmax) for u = (2b + 1) / 512 of rounding byte b. t + u > 0, so
// truncating it gives floor(t + u) clamped (a NaN compares false and takes kmax).
EFFMEM_HD float adam8_k(float t, uint32_t b, float kmax) {
  const float k = t + static_cast<float>(2u * b + 1u) * (1.0f / 512.0f);
  return k < kmax ? k : kmax;
}

// m's byte from k = adam8_k(adam8_t(|m|, inv, 127), b, 127): the sign in bit 7.
EFFMEM_HD uint32_t adam8_code_m(float m, float k) {
  return static_cast<uint32_t>(static_cast<int32_t>(k)) | (m < 0.0f ? 0x80u : 0u);
}

// v's byte from r = sqrt(v) and k = adam8_k(adam8_t(r, inv, 255), b, 255): never 0 for a positive v in
// a nonzero block. (Bitwise, not short-circuit: no branch in a loop the compiler should vectorise.)
EFFMEM_HD uint32_t adam8_code_v(float r, float inv, float k) {
  const uint32_t code = static_cast<uint32_t>(static_cast<int32_t>(k));
  return ((code == 0u) & (r > 0.0f) & (inv > 0.0f)) ? 1u : code;
}

}  // namespace effmem
