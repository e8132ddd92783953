// Just enough of CUDA's device API for a kernel without inter-thread communication to compile and run as
// ordinary host C++: the kernel body is called once per (block, thread), in sequence. What the GPU does in
// hardware (__byte_perm, __umulhi, bit casts) is written out here from the PTX ISA's definitions; inline PTX
// compiles away (kernels here use it for the quantize kernels' min/max and the hardware bf16/fp16 rounding,
// whose portable fallbacks, taken without __CUDA_ARCH__, give the same bits for finite values).
// Warp shuffles abort: a kernel that needs them cannot be emulated one thread at a time.
#pragma once

#include <cuda_fp16.h>  // host-compilable: the half conversions, uint2/uint4/float4 and make_*

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

using std::max;
using std::min;

struct EmuDim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline EmuDim3 blockIdx, threadIdx;

// Byte s[i] (0-7) of the 8 bytes {y, x} (x the low word) goes to byte i of the result.
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline uint32_t __umulhi(uint32_t a, uint32_t b) { return static_cast<uint32_t>((uint64_t{a} * b) >> 32); }
template <class T>
T __shfl_xor_sync(unsigned, T, int) {
  std::abort();
}
inline void __syncthreads() {}
inline int atomicOr(int* p, int v) {
  const int old = *p;
  *p |= v;
  return old;
}
#define __launch_bounds__(...)
#define asm(...) (void)0
