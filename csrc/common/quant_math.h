// Group-wise quantisation of one element, written once for host and device.
//
// A group is up to group_size consecutive elements of one row (the last
// dimension). With lo = min, hi = max over the group and qmax = 2^bits - 1:
//   scale = (hi - lo) / qmax              inv = scale > 0 ? 1 / scale : 0
//   q     = clamp(floor((x - lo) * inv + u), 0, qmax)
//   x'    = lo + q * scale
// u = 0.5 rounds to nearest; u uniform in [0, 1) (stochastic rounding) makes
// E[x'] = x. u comes from a counter-based hash of (seed, element index), so
// the CPU and CUDA kernels produce the same codes for the same seed. A group
// holding NaN or +-Inf stores lo = scale = NaN and so dequantises to NaN:
// non-finite activations stay non-finite.
#pragma once

#include <cmath>
#include <cstdint>

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

struct QuantGroup {
  float lo;
  float scale;
  float inv;
};

EFFMEM_HD QuantGroup quant_group(float lo, float hi, bool finite, int qmax) {
  QuantGroup g;
  if (!finite) {
    g.lo = g.scale = NAN;
    g.inv = 0.0f;
    return g;
  }
  g.lo = lo;
  g.scale = (hi - lo) / static_cast<float>(qmax);
  g.inv = g.scale > 0.0f ? 1.0f / g.scale : 0.0f;
  return g;
}

EFFMEM_HD uint32_t quantize_value(float x, const QuantGroup& g, float u, int qmax) {
  float q = floorf((x - g.lo) * g.inv + u);
  // clamp to [0, qmax]; NaN (a non-finite group, whose stats carry the NaN)
  // fails the first test and codes 0
  q = q >= 0.0f ? q : 0.0f;
  q = q < static_cast<float>(qmax) ? q : static_cast<float>(qmax);
  // via int32: one vector instruction, where float -> uint32 has none
  return static_cast<uint32_t>(static_cast<int32_t>(q));
}

EFFMEM_HD float dequantize_value(uint32_t q, float lo, float scale) {
  return lo + static_cast<float>(static_cast<int32_t>(q)) * scale;
}

// True when the float is neither NaN nor +-Inf (exponent not all ones).
EFFMEM_HD bool finite_bits(uint32_t bits) { return (bits & 0x7f800000u) != 0x7f800000u; }

}  // namespace effmem
