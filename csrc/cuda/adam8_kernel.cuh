// The multi-tensor Adam kernel with 8-bit moments (common/adam8_math.h). Each
// CUDA block takes one chunk (kChunk elements) of one tensor; each warp takes
// one block of 256 elements of it at a time, 8 per lane: decode both moments,
// the fp32 Adam update (common/adam_math.h), the block's new scales by warp
// max-reductions, encode with the rounding bytes of each element, store.
// Simple element loads for now: no GPU has timed this kernel yet; the CPU
// kernel and this one share every formula, and tests compare them bit for bit.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/adam8_math.h"
#include "common/adam_math.h"
#include "cuda/adam_kernel.cuh"
#include "cuda/multi_tensor.cuh"

namespace effmem::cuda {

// Lists: 0 param, 1 grad, 2 master (the param itself for fp32), 3 m codes, 4 v codes, 5 m scales, 6 v scales.
constexpr int kAdam8Tensors = 36;
using Adam8Table = TensorTable<7, kAdam8Tensors>;
struct Adam8Salts {
  int64_t salt[kAdam8Tensors];  // per table slot: the tensor's place in its optimizer
};
constexpr int kAdam8Threads = 512;
constexpr int kAdam8PerLane = kAdam8Block / 32;

__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

template <class P, class G>
__global__ void __launch_bounds__(kAdam8Threads)
    adam8_kernel(Adam8Table table, Adam8Salts salts, AdamHyper h, const float* lr_ptr, const float* inv_scale,
                 const float* found_inf, int* status) {
  constexpr bool kLowPrecision = !std::is_same_v<P, float>;
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  int slot;
  int64_t chunk;
  table.locate(blockIdx.x, &slot, &chunk);
  const int64_t start = chunk * kChunk;  // a multiple of kAdam8Block
  const int64_t n = min(kChunk, table.numel[slot] - start);

  __shared__ AdamCoeffs coeffs;
  __shared__ int refused;
  __shared__ float step_value;
  if (threadIdx.x == 0) {
    const double lr = lr_ptr != nullptr ? static_cast<double>(*lr_ptr) : h.lr;
    const double scale = inv_scale != nullptr ? static_cast<double>(*inv_scale) : 1.0;
    step_value = *table.step[slot];
    refused = adam_refusal(lr, step_value);
    if (refused != 0 && status != nullptr) atomicOr(status, refused);
    if (refused == 0) {
      coeffs = adam_coeffs(lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled, h.bias_correction,
                           step_value, scale);
    }
  }
  __syncthreads();
  if (refused != 0) return;
  const AdamCoeffs c = coeffs;
  const uint64_t seed_m = adam8_seed(step_value, salts.salt[slot], false);
  const uint64_t seed_v = adam8_seed(step_value, salts.salt[slot], true);

  P* param = static_cast<P*>(table.ptr[0][slot]);
  const G* grad = static_cast<const G*>(table.ptr[1][slot]);
  float* w = static_cast<float*>(table.ptr[2][slot]);
  uint8_t* mc = static_cast<uint8_t*>(table.ptr[3][slot]);
  uint8_t* vc = static_cast<uint8_t*>(table.ptr[4][slot]);
  float* ms = static_cast<float*>(table.ptr[5][slot]);
  float* vs = static_cast<float*>(table.ptr[6][slot]);
  const int lane = threadIdx.x % 32;
  const int warps = kAdam8Threads / 32;
  for (int64_t b0 = start + static_cast<int64_t>(threadIdx.x / 32) * kAdam8Block; b0 < start + n;
       b0 += static_cast<int64_t>(warps) * kAdam8Block) {
    const int64_t blk = b0 / kAdam8Block;
    const int64_t e0 = b0 + lane * kAdam8PerLane;  // this lane's first element
    const int64_t end = start + n;
    const float sm = ms[blk], sv = vs[blk];
    float m[kAdam8PerLane], r[kAdam8PerLane];
    float am = 0.0f, ar = 0.0f;
#pragma unroll
    for (int k = 0; k < kAdam8PerLane; ++k) {
      const int64_t e = e0 + k;
      m[k] = r[k] = 0.0f;
      if (e < end) {
        float wk = w[e], mk = adam8_decode_m(mc[e], sm), vk = adam8_decode_v(vc[e], sv);
        adam_update(wk, mk, vk, to_float(grad[e]), c);
        w[e] = wk;
        if constexpr (kLowPrecision) from_float(param + e, wk);
        r[k] = sqrtf(vk);
        m[k] = adam8_kept_m(mk, r[k]);
        const float a = m[k] < 0.0f ? -m[k] : m[k];
        am = a > am ? a : am;
        ar = r[k] > ar ? r[k] : ar;
      }
    }
    // the block's scales: every lane of the warp takes part (lanes past the end hold 0)
    am = warp_max(am);
    ar = warp_max(ar);
    // An infinite moment takes no part in the scale (adam8_finite). am and ar are the warp's own after
    // warp_max, so every lane takes this branch or none, and its shuffles see all 32.
    if (!(am <= kAdam8FiniteMax) || !(ar <= kAdam8FiniteMax)) {
      float fm = 0.0f, fr = 0.0f;
#pragma unroll
      for (int k = 0; k < kAdam8PerLane; ++k) {
        const float a = adam8_finite(m[k] < 0.0f ? -m[k] : m[k]), rk = adam8_finite(r[k]);
        fm = a > fm ? a : fm;
        fr = rk > fr ? rk : fr;
      }
      fm = warp_max(fm);
      fr = warp_max(fr);
      am = am <= kAdam8FiniteMax ? am : fm;
      ar = ar <= kAdam8FiniteMax ? ar : fr;
    }
    if (lane == 0) {
      ms[blk] = am;
      vs[blk] = ar;
    }
    const float inv_m = adam8_inverse(am), inv_v = adam8_inverse(ar);
    // rounding bytes: byte e % 4 of hash word e / 4 (e0 is a multiple of 8: two words per lane)
    uint32_t hm[kAdam8PerLane / 4], hv[kAdam8PerLane / 4];
    const uint64_t w0 = static_cast<uint64_t>(e0) >> 2;
    const uint32_t high_m = hash_high(seed_m, static_cast<uint32_t>(w0 >> 32));
    const uint32_t high_v = hash_high(seed_v, static_cast<uint32_t>(w0 >> 32));
#pragma unroll
    for (int j = 0; j < kAdam8PerLane / 4; ++j) {
      hm[j] = hash_word_low(seed_m, static_cast<uint32_t>(w0) + j, high_m);
      hv[j] = hash_word_low(seed_v, static_cast<uint32_t>(w0) + j, high_v);
    }
#pragma unroll
    for (int k = 0; k < kAdam8PerLane; ++k) {
      const int64_t e = e0 + k;
      if (e < end) {
        const uint32_t shift = 8u * static_cast<uint32_t>(k % 4);
        const float a = m[k] < 0.0f ? -m[k] : m[k];
        const float km = adam8_k(adam8_t(a, inv_m, 127.0f), (hm[k / 4] >> shift) & 0xffu, 127.0f);
        const float kv = adam8_k(adam8_t(r[k], inv_v, 255.0f), (hv[k / 4] >> shift) & 0xffu, 255.0f);
        mc[e] = static_cast<uint8_t>(adam8_code_m(m[k], km));
        vc[e] = static_cast<uint8_t>(adam8_code_v(r[k], inv_v, kv));
      }
    }
  }
}

}  // namespace effmem::cuda
