// Kernels of effmem::quantize / effmem::dequantize (formulas in
// common/quant_math.h, shared with the CPU kernels and the Python reference).
//
// Work split: each thread owns 32 consecutive elements of one group, so a
// group of G elements is G/32 neighbouring lanes (1 to 8) of a warp (4-bit
// quantize on the 16-byte path: 64 elements, G/64 lanes, when G >= 64; its
// codes are half the bytes of 8-bit ones for about the same instructions, so
// the work done once per thread is spread over twice the elements). A
// thread issues all its loads first (four 16-byte loads for bf16/fp16),
// reduces min/max on packed pairs, combines the group's lanes with
// log2(G/32) shuffles and writes its 32 codes with 16-byte stores. The
// per-thread work (indices, the group's constants, one reciprocal) is shared
// by 32 elements; per element the plain path is a subtract, a multiply, a
// clamp, one byte select for the rounding byte and an add (quant_math.h's
// code_of), and a hash costs a quarter of one mix per element. Prescaled,
// outlier and NaN groups take the general formula, group by group.
//
// kVec: the 16-byte path, for rows of a multiple of 32 elements with aligned
// pointers; otherwise the same math with one guarded load per element.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/quant_math.h"
#include "cuda/adam_kernel.cuh"

namespace effmem::cuda {

constexpr int kQuantThreads = 256;
constexpr int kQuantPerThread = 32;

// bench/sass_count.py compiles these kernels with EFFMEM_SASS_COMMON_PATH:
// the branches for rare groups (outlier, prescaled, NaN) compile away, so a
// kernel's static instruction count is the common path's dynamic one.
#ifdef EFFMEM_SASS_COMMON_PATH
constexpr bool kCommonPathOnly = true;
#else
constexpr bool kCommonPathOnly = false;
#endif

// n / d for n < 2^31 by a multiply and a shift (the 32-bit division it
// replaces is about 20 instructions): shift = ceil(log2 d),
// mul = floor(2^32 (2^shift - d) / d) + 1, n / d = (umulhi(n, mul) + n) >> shift.
struct FastDiv {
  uint32_t mul, shift;
};

__device__ __forceinline__ uint32_t fast_div(uint32_t n, FastDiv d) { return (__umulhi(n, d.mul) + n) >> d.shift; }

struct QuantShape {
  int64_t last_dim, row_bytes;
  uint32_t group_size, groups_per_row, total_groups, lanes_log2;
  FastDiv by_groups_per_row;
};

// NaN-propagating min / max: a NaN anywhere makes its group a NaN group, so
// the reduction need not skip NaN, and propagating it saves a test per element.
__device__ __forceinline__ float min_nan(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? NAN : fminf(a, b);
#endif
}
__device__ __forceinline__ float max_nan(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? NAN : fmaxf(a, b);
#endif
}

// 16-bit pairs: min and max as packed operations (one instruction per two elements each), then the halves.
template <class T, int kWords>
__device__ __forceinline__ void pair_min_max(const uint32_t* w, float& lo, float& hi) {
#if __CUDA_ARCH__ >= 800
  uint32_t l = w[0], h = w[0];
#pragma unroll
  for (int i = 1; i < kWords; ++i) {
    if constexpr (std::is_same_v<T, bf16_t>) {
      asm("min.NaN.bf16x2 %0, %0, %1;" : "+r"(l) : "r"(w[i]));
      asm("max.NaN.bf16x2 %0, %0, %1;" : "+r"(h) : "r"(w[i]));
    } else {
      asm("min.NaN.f16x2 %0, %0, %1;" : "+r"(l) : "r"(w[i]));
      asm("max.NaN.f16x2 %0, %0, %1;" : "+r"(h) : "r"(w[i]));
    }
  }
  lo = min_nan(lo, min_nan(to_float(T{static_cast<uint16_t>(l)}), to_float(T{static_cast<uint16_t>(l >> 16)})));
  hi = max_nan(hi, max_nan(to_float(T{static_cast<uint16_t>(h)}), to_float(T{static_cast<uint16_t>(h >> 16)})));
#else
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    const float a = to_float(T{static_cast<uint16_t>(w[i])}), b = to_float(T{static_cast<uint16_t>(w[i] >> 16)});
    lo = min_nan(lo, min_nan(a, b));
    hi = max_nan(hi, max_nan(a, b));
  }
#endif
}

// A thread's kPer elements as loaded: floats, or words of two 16-bit values (low half first).
template <class T, int kPer = kQuantPerThread>
struct Chunk {
  static constexpr int kWords = kPer / 2;
  uint32_t w[kWords];
  __device__ __forceinline__ float get(int k) const {
    const uint16_t b = static_cast<uint16_t>(k % 2 == 0 ? w[k / 2] : w[k / 2] >> 16);
    return to_float(T{b});
  }
  __device__ __forceinline__ void load(const T* p) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 a = q[i];
      w[4 * i] = a.x, w[4 * i + 1] = a.y, w[4 * i + 2] = a.z, w[4 * i + 3] = a.w;
    }
  }
  __device__ __forceinline__ void min_max(float& lo, float& hi) const { pair_min_max<T, kWords>(w, lo, hi); }
};

template <int kPer>
struct Chunk<float, kPer> {
  float f[kPer];
  __device__ __forceinline__ float get(int k) const { return f[k]; }
  __device__ __forceinline__ void load(const float* p) {
    const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < kPer / 4; ++i) {
      const float4 v = q[i];
      f[4 * i] = v.x, f[4 * i + 1] = v.y, f[4 * i + 2] = v.z, f[4 * i + 3] = v.w;
    }
  }
  __device__ __forceinline__ void min_max(float& lo, float& hi) const {
#pragma unroll
    for (int k = 0; k < kPer; ++k) lo = min_nan(lo, f[k]), hi = max_nan(hi, f[k]);
  }
};


// Two floats to a word of two 16-bit values (a in the low half), rounded to
// nearest even by the hardware. Only plain groups use it: their values are
// finite, where the hardware's rounding and from_float()'s agree.
__device__ __forceinline__ uint32_t pack2(float a, float b, bf16_t) {
#if __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
#else
  return bf16_from_float(a) | (static_cast<uint32_t>(bf16_from_float(b)) << 16);
#endif
}
__device__ __forceinline__ uint32_t pack2(float a, float b, f16_t) {
#if __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
#else
  return f16_from_float(a) | (static_cast<uint32_t>(f16_from_float(b)) << 16);
#endif
}

// Where this thread's elements are.
struct QuantPlace {
  uint32_t group;             // group index
  uint32_t k0;                // first element within the group
  int64_t row, start, first;  // row, the group's first column, flat index of element k0
  int count;                  // valid elements (0 for a thread past the last group)
};

template <int kPer = kQuantPerThread>
__device__ __forceinline__ QuantPlace quant_place(const QuantShape& s) {
  QuantPlace p;
  const uint32_t tid = blockIdx.x * kQuantThreads + threadIdx.x;
  p.group = tid >> s.lanes_log2;
  p.k0 = (tid & ((1u << s.lanes_log2) - 1u)) * kPer;
  const uint32_t g = p.group < s.total_groups ? p.group : 0u;
  const uint32_t row = fast_div(g, s.by_groups_per_row);
  p.row = row;
  p.start = static_cast<int64_t>(g - row * s.groups_per_row) * s.group_size;
  p.first = p.row * s.last_dim + p.start + p.k0;
  const int64_t left = s.last_dim - p.start - p.k0;
  p.count = p.group >= s.total_groups || left <= 0 ? 0 : (left < kPer ? static_cast<int>(left) : kPer);
  return p;
}

// The codes of 4 elements (8-bit) from z = t + (2^23 + b): byte 1 of each, by byte selects.
__device__ __forceinline__ uint32_t gather_byte1(float z0, float z1, float z2, float z3) {
  const uint32_t lo = __byte_perm(__float_as_uint(z0), __float_as_uint(z1), 0x0051);
  const uint32_t hi = __byte_perm(__float_as_uint(z2), __float_as_uint(z3), 0x0051);
  return __byte_perm(lo, hi, 0x5410);
}

// The plain path's codes of this thread's kPer elements, packed as stored.
template <int kBits, int kPer>
__device__ __forceinline__ void plain_codes(const float* v, const uint32_t* words, bool stochastic, float lo,
                                            float inv256, uint32_t* packed) {
  constexpr float kTop = 256.0f * ((1 << kBits) - 1);
  float z[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    float t = (v[k] - lo) * inv256;
    t = t <= kTop ? t : kTop;
    // 2^23 + b: byte k % 4 of the hash word under 0x4b0000 (one byte select), or 2^23 + 128. The
    // constant is the first operand so that it, not the selector, is the one held in a register.
    const uint32_t magic = stochastic ? __byte_perm(kMagicBits, words[k / 4], 0x3104 + k % 4) : kMagicBits | kNearestByte;
    z[k] = t + __uint_as_float(magic);
  }
  if constexpr (kBits == 8) {
#pragma unroll
    for (int i = 0; i < kPer / 4; ++i) packed[i] = gather_byte1(z[4 * i], z[4 * i + 1], z[4 * i + 2], z[4 * i + 3]);
  } else {
    // even elements' codes in one word's bytes, odd ones' in another, then nibbles interleaved
#pragma unroll
    for (int i = 0; i < kPer / 8; ++i) {
      const float* y = z + 8 * i;
      const uint32_t even = gather_byte1(y[0], y[2], y[4], y[6]), odd = gather_byte1(y[1], y[3], y[5], y[7]);
      packed[i] = even | (odd << 4);
    }
  }
}

// quantize: x [rows, D] -> codes [rows, row_bytes], stats [rows, groups, 2]. kPer: elements a thread (32, or
// 64 on the 16-byte path for groups of 64 or more; s.lanes_log2 must count lanes of kPer).
template <class T, int kBits, bool kVec, int kPer = kQuantPerThread>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ codes, float* __restrict__ stats,
                    QuantShape s, uint64_t seed, bool stochastic) {
  static_assert(kPer == kQuantPerThread || (kVec && kPer == 2 * kQuantPerThread), "32, or 64 on the 16-byte path");
  constexpr int kQmax = (1 << kBits) - 1;
  constexpr int kPacked = kPer * kBits / 32;
  constexpr int kLanesMax = 256 / kPer;  // lanes of the largest group
  const QuantPlace at = quant_place<kPer>(s);
  Chunk<T, kPer> c;
  float lo = INFINITY, hi = -INFINITY;
  if constexpr (kVec) {
    if (at.count > 0) {  // a whole chunk: the row length is a multiple of kPer
      c.load(x + at.first);
      c.min_max(lo, hi);
    }
  }
  float v[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if constexpr (kVec) {
      v[k] = c.get(k);
    } else {
      v[k] = k < at.count ? to_float(x[at.first + k]) : 0.0f;
      if (k < at.count) lo = min_nan(lo, v[k]), hi = max_nan(hi, v[k]);
    }
  }
  // Combine the group's lanes; every lane of the warp takes part (lanes past
  // the last group hold the neutral +-inf).
  const int lanes = 1 << s.lanes_log2;
#pragma unroll
  for (int off = 1; off < kLanesMax; off *= 2) {
    if (off < lanes) {  // the same for the whole warp
      lo = min_nan(lo, __shfl_xor_sync(0xffffffffu, lo, off));
      hi = max_nan(hi, __shfl_xor_sync(0xffffffffu, hi, off));
    }
  }
  if (at.group >= s.total_groups) return;
  const QuantSide side = quant_side(lo, hi, false, kQmax);
  float a = 0.0f;
  if (!kCommonPathOnly && side.side != 0) {  // rare; taken by all of the group's lanes alike, so only they shuffle
    const float vx = side.side < 0 ? lo : hi;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const float m = fabsf(v[k]);
      a = k < at.count && v[k] != vx && m > a ? m : a;
    }
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t mask = ((1u << lanes) - 1u) << (lane & ~static_cast<uint32_t>(lanes - 1));
#pragma unroll
    for (int off = 1; off < kLanesMax; off *= 2) {
      if (off < lanes) a = fmaxf(a, __shfl_xor_sync(mask, a, off));
    }
  }
  const QuantGroup g = quant_group(lo, hi, side, a, kQmax);
  if (at.k0 == 0) reinterpret_cast<float2*>(stats)[at.group] = make_float2(g.stat0, g.stat1);
  if (at.count == 0) return;

  uint8_t* out = codes + at.row * s.row_bytes;
  if (kVec && (kCommonPathOnly || quant_is_plain(g))) {
    // The rounding bytes: first is a multiple of kPer, so the thread's kPer / 4 hash words share their high
    // half.
    uint32_t words[kPer / 4];
    if (stochastic) {
      const uint64_t w0 = static_cast<uint64_t>(at.first) >> 2;
      const uint32_t high = hash_high(seed, static_cast<uint32_t>(w0 >> 32));
#pragma unroll
      for (int j = 0; j < kPer / 4; ++j) words[j] = hash_word_low(seed, static_cast<uint32_t>(w0) + j, high);
    }
    uint32_t packed[kPacked];
    plain_codes<kBits, kPer>(v, words, stochastic, g.stat0, g.inv256, packed);
    uint4* dst = reinterpret_cast<uint4*>(out + (at.start + at.k0) * kBits / 8);
#pragma unroll
    for (int i = 0; i < kPacked / 4; ++i) dst[i] = make_uint4(packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]);
    return;
  }
  // The general formula, one element at a time.
  uint32_t q[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const uint32_t b = stochastic ? hash_byte(seed, static_cast<uint64_t>(at.first + k)) : kNearestByte;
    q[k] = quantize_value(v[k], g, b);
  }
#pragma unroll
  for (int k = 0; k < kPer; k += 2) {
    if (k >= at.count) break;
    const uint32_t high = k + 1 < at.count ? q[k + 1] : 0u;
    if constexpr (kBits == 8) {
      out[at.start + at.k0 + k] = static_cast<uint8_t>(q[k]);
      if (k + 1 < at.count) out[at.start + at.k0 + k + 1] = static_cast<uint8_t>(high);
    } else {
      out[(at.start + at.k0 + k) / 2] = static_cast<uint8_t>(q[k] | (high << 4));
    }
  }
}

// dequantize: codes, stats -> out [rows, D] of T.
template <class T, int kBits, bool kVec>
__global__ void __launch_bounds__(kQuantThreads)
    dequantize_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ stats, T* __restrict__ out,
                      QuantShape s) {
  constexpr int kQmax = (1 << kBits) - 1;
  constexpr int kPacked = kQuantPerThread * kBits / 32;
  const QuantPlace at = quant_place(s);
  if (at.count == 0) return;
  // two loads, not one float2: a caller's stats may be a view starting at an odd float
  const float lo = stats[2 * static_cast<int64_t>(at.group)], scale = stats[2 * static_cast<int64_t>(at.group) + 1];
  const uint8_t* in = codes + at.row * s.row_bytes;
  uint32_t q[kQuantPerThread];
  if constexpr (kVec) {
    uint32_t w[kPacked];
    const uint4* src = reinterpret_cast<const uint4*>(in + (at.start + at.k0) * kBits / 8);
#pragma unroll
    for (int i = 0; i < kPacked / 4; ++i) {
      const uint4 c = src[i];
      w[4 * i] = c.x, w[4 * i + 1] = c.y, w[4 * i + 2] = c.z, w[4 * i + 3] = c.w;
    }
#pragma unroll
    for (int k = 0; k < kQuantPerThread; ++k) q[k] = (w[k * kBits / 32] >> (kBits * k % 32)) & kQmax;
  } else {
#pragma unroll
    for (int k = 0; k < kQuantPerThread; ++k) {
      const int64_t e = at.start + at.k0 + k;
      q[k] = k >= at.count ? 0u : (kBits == 8 ? in[e] : (in[e / 2] >> (4 * (e & 1))) & 0xfu);
    }
  }
  T* y = out + at.first;
  if (kVec && (kCommonPathOnly || dequant_is_plain(lo, scale))) {
    float f[kQuantPerThread];
#pragma unroll
    for (int k = 0; k < kQuantPerThread; ++k) f[k] = dequantize_plain(q[k], lo, scale);
    if constexpr (std::is_same_v<T, float>) {
#pragma unroll
      for (int i = 0; i < kQuantPerThread / 4; ++i) {
        reinterpret_cast<float4*>(y)[i] = make_float4(f[4 * i], f[4 * i + 1], f[4 * i + 2], f[4 * i + 3]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kQuantPerThread / 8; ++i) {
        const float* g = f + 8 * i;
        reinterpret_cast<uint4*>(y)[i] = make_uint4(pack2(g[0], g[1], T{}), pack2(g[2], g[3], T{}),
                                                    pack2(g[4], g[5], T{}), pack2(g[6], g[7], T{}));
      }
    }
    return;
  }
  const DequantGroup d = dequant_group(lo, scale, kQmax);
#pragma unroll
  for (int k = 0; k < kQuantPerThread; ++k) {
    if (k < at.count) from_float(y + k, dequantize_value(q[k], d));
  }
}

}  // namespace effmem::cuda
