// Bit-exact conversions between float and the 16-bit float formats, usable
// from host and device code. Both round to nearest even, like torch's own
// casts, so a low-precision parameter always equals master.to(dtype).
#pragma once

#include <cstdint>
#include <cstring>

#include "hd.h"

namespace effmem {

// Storage tags for 16-bit floats held as raw bits (CPU and CUDA kernels).
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

EFFMEM_HD uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

EFFMEM_HD float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// bfloat16 is the top half of a float: add 0x7fff plus the lowest kept bit,
// then truncate. NaN becomes the canonical quiet NaN (as torch's cast does).
EFFMEM_HD uint16_t bf16_from_float(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

EFFMEM_HD float float_from_bf16(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
EFFMEM_HD uint16_t f16_from_float(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5f puts the 2^-24 unit in
    // the float's last mantissa bit, so the FPU's own round-to-nearest-even
    // does the rounding.
    const float shifted = float_of(ax) + 0.5f;
    return static_cast<uint16_t>(sign | (bits_of(shifted) - 0x3f000000u));
  }
  // Re-bias the exponent (127 -> 15) and round 23 -> 10 mantissa bits; a
  // carry out of the mantissa correctly bumps the exponent.
  ax += 0xc8000fffu + ((ax >> 13) & 1u);
  return static_cast<uint16_t>(sign | (ax >> 13));
}

EFFMEM_HD float float_from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in float
    return float_of(sign | bits_of(static_cast<float>(mant) * 5.9604644775390625e-8f));
  }
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace effmem
