// effmem::dequantize's kernel for tensors whose groups are all whole (see
// dequantize_flat_kernel below); the group-mapped kernels and the shared
// helpers (pack2, kQuantThreads, kCommonPathOnly) are in quantize_kernel.cuh,
// the math in common/quant_math.h.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/quantize_kernel.cuh"

namespace effmem::cuda {

// The codes of one slice of a flat dequantize: kBytes (2 to 8) bytes in one aligned load.
template <int kBytes>
__device__ __forceinline__ uint64_t load_codes(const uint8_t* p) {
  if constexpr (kBytes == 8) {
    const uint2 c = *reinterpret_cast<const uint2*>(p);
    return c.x | (static_cast<uint64_t>(c.y) << 32);
  } else if constexpr (kBytes == 4) {
    return *reinterpret_cast<const uint32_t*>(p);
  } else {
    return *reinterpret_cast<const uint16_t*>(p);
  }
}

// A code as the float it stands for, 2^23 + q - 2^23 exactly (q < 2^8): for 8-bit codes one byte select
// into the exponent's word and one add, where a shift, a mask and an int-to-float conversion take three.
// (The constant first, so that it, not the selector, is the operand held in a register.)
__device__ __forceinline__ float code_as_float(uint64_t c, int k, std::integral_constant<int, 8>) {
  const uint32_t word = static_cast<uint32_t>(c >> (32 * (k / 4)));
  return __uint_as_float(__byte_perm(0x4b000000u, word, 0x3214u + (k % 4))) - 8388608.0f;
}
// 4-bit: a byte holds codes 2j (low nibble) and 2j + 1; the even codes of a word masked out at once, the odd
// ones shifted down and masked (the compiler shares both words among their 8 codes), then as for 8 bits.
__device__ __forceinline__ float code_as_float(uint64_t c, int k, std::integral_constant<int, 4>) {
  const uint32_t word = static_cast<uint32_t>(c >> (32 * (k / 8)));  // a register of the pair, no shift
  const uint32_t nibbles = (k % 2 == 0 ? word : word >> 4) & 0x0f0f0f0fu;
  return __uint_as_float(__byte_perm(0x4b000000u, nibbles, 0x3214u + (k % 8) / 2)) - 8388608.0f;
}

// dequantize where every group is whole (last_dim a multiple of the group size, and of 32 for the 16-byte
// path), so codes, stats and values are flat arrays in one order: element e is group e / G and code byte
// e * bits / 8. The work is split by stores instead of by groups: a lane writes kSlice values (16 bytes) per
// window and the warp's lanes neighbouring slices, so each of a warp's store instructions writes 512
// contiguous bytes, and its code loads read 128-256 contiguous bytes. (dequantize_kernel's lanes write 16
// bytes 64 bytes apart, half a sector each, spread over 2 KB per instruction: 58% of the copy bandwidth on
// an H200 on 2026-11-26, where quantize, whose lanes read alike but write 16 contiguous code bytes each,
// reached 94%.) Each thread still takes 32 values, in kWindows windows 32 slices apart; every load is issued
// before the math. Same per-value formulas as dequantize_kernel: the same bits.
template <class T, int kBits>
__global__ void __launch_bounds__(kQuantThreads)
    dequantize_flat_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ stats, T* __restrict__ out,
                           int64_t numel, uint32_t group_log2) {
  constexpr int kQmax = (1 << kBits) - 1;
  constexpr int kSlice = 16 / static_cast<int>(sizeof(T));  // values per 16-byte store: 8, or 4 for float
  constexpr int kWindows = kQuantPerThread / kSlice;
  constexpr int kBytes = kSlice * kBits / 8;                // code bytes per slice
  constexpr int kStride = 32 * kSlice;                      // values between a lane's windows
  // 64-bit arithmetic once per thread; per window only 32-bit offsets from the warp's first value, which is
  // a multiple of 1024 and so of every group size.
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x) / 32;
  const int64_t warp_first = warp * 32 * kQuantPerThread;
  const uint32_t lane_first = (threadIdx.x % 32) * kSlice;
  const int64_t first = warp_first + lane_first;
  // Window w is in range where w * kStride < room (numel is a multiple of 32, so a slice is all in or all
  // out): one 32-bit compare per window.
  const int64_t left = numel - first;
  const uint32_t room = left <= 0                   ? 0u
                        : left > kWindows * kStride ? uint32_t{kWindows * kStride}
                                                    : static_cast<uint32_t>(left);
  const uint8_t* src = codes + first * kBits / 8;  // first is a multiple of kSlice: a whole byte
  // the warp's first group's stats, as an address: each window adds 8 bytes per group in one wide multiply-add
  const uint64_t st = reinterpret_cast<uintptr_t>(stats + 2 * (warp_first >> group_log2));
  T* y = out + first;
  uint64_t c[kWindows];  // set, and read, only for the windows in range
  float lo[kWindows], scale[kWindows];
#pragma unroll
  for (int w = 0; w < kWindows; ++w) {
    if (w * kStride < room) {
      c[w] = load_codes<kBytes>(src + w * kStride * kBits / 8);
      const uint32_t g = (lane_first + w * kStride) >> group_log2;
      const float* sg = reinterpret_cast<const float*>(st + static_cast<uint64_t>(g) * 8u);
      // two loads, not one float2: a caller's stats may be a view starting at an odd float
      lo[w] = sg[0], scale[w] = sg[1];
    }
  }
#pragma unroll
  for (int w = 0; w < kWindows; ++w) {
    if (w * kStride >= room) return;  // the later windows lie further still
    T* yw = y + w * kStride;
    if (kCommonPathOnly || dequant_is_plain(lo[w], scale[w])) {
      float f[kSlice];
#pragma unroll
      for (int k = 0; k < kSlice; ++k) {
        f[k] = dequantize_plain_of(code_as_float(c[w], k, std::integral_constant<int, kBits>{}), lo[w], scale[w]);
      }
      if constexpr (std::is_same_v<T, float>) {
        *reinterpret_cast<float4*>(yw) = make_float4(f[0], f[1], f[2], f[3]);
      } else {
        *reinterpret_cast<uint4*>(yw) = make_uint4(pack2(f[0], f[1], T{}), pack2(f[2], f[3], T{}),
                                                   pack2(f[4], f[5], T{}), pack2(f[6], f[7], T{}));
      }
    } else {
      const DequantGroup d = dequant_group(lo[w], scale[w], kQmax);
#pragma unroll
      for (int k = 0; k < kSlice; ++k) {
        from_float(yw + k, dequantize_value(static_cast<uint32_t>((c[w] >> (kBits * k)) & kQmax), d));
      }
    }
  }
}

}  // namespace effmem::cuda
