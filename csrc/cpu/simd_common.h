// Scalar load/store shared by all CPU ISA units (the vector tails use them).
#pragma once

#include <cstdint>

#include "common/float_bits.h"

namespace effmem::cpu {

static inline float load1(const float* p) { return *p; }
static inline float load1(const bf16_t* p) { return float_from_bf16(p->bits); }
static inline float load1(const f16_t* p) { return float_from_f16(p->bits); }
static inline void store1(float* p, float x) { *p = x; }
static inline void store1(bf16_t* p, float x) { p->bits = bf16_from_float(x); }
static inline void store1(f16_t* p, float x) { p->bits = f16_from_float(x); }

}  // namespace effmem::cpu
