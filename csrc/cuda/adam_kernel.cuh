// The multi-tensor Adam kernel. Each block updates one chunk of one tensor;
// each thread handles kVec consecutive elements per iteration with one
// vector load/store per list when the tensors are suitably aligned.
//
// Per element (csrc/common/adam_math.h):
//   g = grad * inv_scale (+ wd * w)      w = w * (1 - lr * wd)   (AdamW)
//   m = b1 * m + (1 - b1) * g            v = b2 * v + (1 - b2) * g * g
//   w = w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//   param = round_to_nearest_even(w)     (bf16/fp16 params)
// Traffic for bf16 params and grads: 2 + 3 * 4 read, 3 * 4 + 2 written = 28 B.
#pragma once

#include <cuda_fp16.h>

#include <type_traits>

#include "common/adam_math.h"
#include "common/float_bits.h"
#include "cuda/multi_tensor.cuh"

namespace effmem::cuda {

constexpr int kAdamThreads = 512;
constexpr int kVec = 4;
// Lists: 0 param, 1 grad, 2 master (the param itself for fp32), 3 exp_avg, 4 exp_avg_sq.
using AdamTable = TensorTable<5, 56>;

struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled, bias_correction;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_t x) { return float_from_bf16(x.bits); }
__device__ __forceinline__ float to_float(f16_t x) { return __half2float(__ushort_as_half(x.bits)); }
__device__ __forceinline__ void from_float(float* p, float x) { *p = x; }
__device__ __forceinline__ void from_float(bf16_t* p, float x) { p->bits = bf16_from_float(x); }
// The hardware conversion turns every NaN into 0x7fff; the CPU keeps the
// sign and gives a quiet 0x7e00, so NaNs take the shared path. That matches
// the conversion only: the float NaN reaching it may differ already (an
// invalid operation gives 0x7fffffff on a GPU, 0xffc00000 on x86), so CPU
// and CUDA agree bit for bit on finite results; a NaN is a NaN on both.
__device__ __forceinline__ void from_float(f16_t* p, float x) {
  p->bits = x != x ? f16_from_float(x) : __half_as_ushort(__float2half_rn(x));
}

template <class T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <class T>
__device__ __forceinline__ bool vec_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Pack<T>) == 0;
}

template <class P, class G>
__global__ void __launch_bounds__(kAdamThreads)
    adam_kernel(AdamTable table, AdamHyper h, const float* lr_ptr, const float* inv_scale,
                const float* found_inf, int* status) {
  constexpr bool kLowPrecision = !std::is_same_v<P, float>;
  // Read on the device, so a grad scaler's skip costs no host sync.
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  int slot;
  int64_t chunk;
  table.locate(blockIdx.x, &slot, &chunk);
  const int64_t start = chunk * kChunk;
  const int64_t n = min(kChunk, table.numel[slot] - start);

  __shared__ AdamCoeffs coeffs;
  __shared__ int refused;
  if (threadIdx.x == 0) {
    const double lr = lr_ptr != nullptr ? static_cast<double>(*lr_ptr) : h.lr;
    const double scale = inv_scale != nullptr ? static_cast<double>(*inv_scale) : 1.0;
    const double step = static_cast<double>(*table.step[slot]);
    // Values on the device, unchecked by the host: refuse what the CPU op would
    // reject (adam_refusal, shared with it) and say so in status.
    refused = adam_refusal(lr, step);
    if (refused != 0 && status != nullptr) atomicOr(status, refused);
    if (refused == 0) {
      coeffs = adam_coeffs(lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled, h.bias_correction, step,
                           scale);
    }
  }
  __syncthreads();
  if (refused != 0) return;
  const AdamCoeffs c = coeffs;

  P* param = static_cast<P*>(table.ptr[0][slot]) + start;
  const G* grad = static_cast<const G*>(table.ptr[1][slot]) + start;
  float* w = static_cast<float*>(table.ptr[2][slot]) + start;
  float* m = static_cast<float*>(table.ptr[3][slot]) + start;
  float* v = static_cast<float*>(table.ptr[4][slot]) + start;

  auto update_one = [&](int64_t j) {
    float wj = w[j], mj = m[j], vj = v[j];
    adam_update(wj, mj, vj, to_float(grad[j]), c);
    m[j] = mj;
    v[j] = vj;
    w[j] = wj;
    if constexpr (kLowPrecision) from_float(param + j, wj);
  };
  const bool aligned = vec_aligned<P>(param) && vec_aligned<G>(grad) && vec_aligned<float>(w) &&
                       vec_aligned<float>(m) && vec_aligned<float>(v);
  if (aligned) {
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kVec; i < n; i += kAdamThreads * kVec) {
      if (i + kVec <= n) {
        const Pack<G> gp = *reinterpret_cast<const Pack<G>*>(grad + i);
        Pack<float> wp = *reinterpret_cast<const Pack<float>*>(w + i);
        Pack<float> mp = *reinterpret_cast<const Pack<float>*>(m + i);
        Pack<float> vp = *reinterpret_cast<const Pack<float>*>(v + i);
        Pack<P> pp;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          adam_update(wp.v[k], mp.v[k], vp.v[k], to_float(gp.v[k]), c);
          from_float(&pp.v[k], wp.v[k]);
        }
        *reinterpret_cast<Pack<float>*>(m + i) = mp;
        *reinterpret_cast<Pack<float>*>(v + i) = vp;
        *reinterpret_cast<Pack<float>*>(w + i) = wp;
        if constexpr (kLowPrecision) *reinterpret_cast<Pack<P>*>(param + i) = pp;
      } else {
        for (int64_t j = i; j < n; ++j) update_one(j);  // the tensor's last few elements
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < n; j += kAdamThreads) update_one(j);
  }
}

}  // namespace effmem::cuda
