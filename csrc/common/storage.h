// Elementwise kernels' view of their storage types (float, bf16_t, f16_t), for host and device: load as
// float, round a float result as torch's casts round, store a rounded value. Shared by the kernels that
// must give the same bits on the CPU and on a GPU (swiglu_math.h, rms_norm_math.h).
#pragma once

#include <cstdint>
#include <type_traits>

#include "float_bits.h"
#include "hd.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace effmem {

// Rounding a float result to the storage type T (float, bf16_t, f16_t) and back. On a GPU the
// hardware conversion (one instruction, round to nearest even like float_bits.h's) replaces the bit
// arithmetic (SwiGLU's backward rounds four times per element). NaN comes back as some NaN; store_float gives
// every NaN the same bits on both devices.
template <class T>
EFFMEM_HD float round_to(float x) {
  if constexpr (sizeof(T) == 4) {
    return x;
  } else if constexpr (std::is_same_v<T, bf16_t>) {
#if defined(__CUDA_ARCH__)
    return __bfloat162float(__float2bfloat16_rn(x));
#else
    return float_from_bf16(bf16_from_float(x));
#endif
  } else {
#if defined(__CUDA_ARCH__)
    return __half2float(__float2half_rn(x));
#else
    return float_from_f16(f16_from_float(x));
#endif
  }
}

// Loads and stores of T as float. A stored value is already rounded to T (round_to), so the store is
// exact; every NaN is stored as one quiet NaN (float_bits.h's for 16 bits, 0x7fc00000 for float32),
// since the sign and payload of a NaN that arithmetic makes differ between x86 and a GPU.
template <class T>
EFFMEM_HD float load_as_float(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return *p;
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return float_from_bf16(p->bits);
  } else {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(p->bits));   // exact, as float_from_f16 (a NaN stays a NaN)
#else
    return float_from_f16(p->bits);
#endif
  }
}

template <class T>
EFFMEM_HD void store_float(T* p, float x) {
  if constexpr (sizeof(T) == 4) {
    *p = x != x ? float_of(0x7fc00000u) : x;
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    p->bits = x != x ? uint16_t{0x7fc0} : static_cast<uint16_t>(bits_of(x) >> 16);
  } else {
#if defined(__CUDA_ARCH__)
    p->bits = x != x ? uint16_t{0x7e00} : __half_as_ushort(__float2half_rn(x));
#else
    p->bits = x != x ? uint16_t{0x7e00} : f16_from_float(x);
#endif
  }
}

}  // namespace effmem
