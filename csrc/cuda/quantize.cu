// CUDA implementations of effmem::quantize / effmem::dequantize: one warp per
// group (group_size <= 256, so at most 8 elements per lane, held in
// registers): one read of x, one write of codes and stats; dequantisation is
// one read of codes and stats, one write of the output. Lanes handle pairs of
// neighbouring elements so a 4-bit pair is one byte and loads are paired.
// Math and the hash in common/quant_math.h, shared with the CPU kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "common/checks.h"
#include "common/quant_math.h"
#include "cuda/adam_kernel.cuh"
#include "cuda/dtype_dispatch.cuh"

namespace effmem::cuda {
namespace {

constexpr int kQuantThreads = 256;  // 8 warps: 8 groups per block
constexpr int kWarpsPerBlock = kQuantThreads / 32;
constexpr int kMaxPairsPerLane = 256 / 64;

struct QuantShape {
  int64_t last_dim, group_size, groups_per_row, row_bytes, total_groups;
};

__device__ __forceinline__ float warp_min(float v) {
  for (int off = 16; off > 0; off /= 2) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

template <class T, int kBits>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ codes, float* __restrict__ stats,
                    QuantShape s, uint64_t seed, bool stochastic) {
  constexpr int kQmax = (1 << kBits) - 1;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (gi >= s.total_groups) return;  // whole warps leave together
  const int lane = threadIdx.x % 32;
  const int64_t row = gi / s.groups_per_row;
  const int64_t start = (gi % s.groups_per_row) * s.group_size;
  const int64_t n = min(s.group_size, s.last_dim - start);
  const int64_t base = row * s.last_dim + start;

  float v[2 * kMaxPairsPerLane];
  float lo = INFINITY, hi = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int p = 0; p < kMaxPairsPerLane; ++p) {
    const int64_t k = 2 * (lane + 32 * p);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      v[2 * p + e] = 0.0f;
      if (k + e < n) {
        const float f = to_float(x[base + k + e]);
        v[2 * p + e] = f;
        lo = f < lo ? f : lo;
        hi = f > hi ? f : hi;
        nan = nan || f != f;
      }
    }
  }
  lo = warp_min(lo);
  hi = warp_max(hi);
  nan = __any_sync(0xffffffffu, nan);
  // Only a group that might keep one extreme apart (decided from lo and hi,
  // so the whole warp takes the same branch) needs the largest magnitude
  // among its other values.
  const QuantSide side = quant_side(lo, hi, nan, kQmax);
  float a = 0.0f;
  if (side.side != 0) {
    const float vx = side.side < 0 ? lo : hi;
#pragma unroll
    for (int p = 0; p < kMaxPairsPerLane; ++p) {
      const int64_t k = 2 * (lane + 32 * p);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (k + e < n) {
          const float f = v[2 * p + e];
          const float m = f < 0.0f ? -f : f;
          a = f != vx && m > a ? m : a;
        }
      }
    }
    a = warp_max(a);
  }
  const QuantGroup g = quant_group(lo, hi, side, a, kQmax);
  if (lane == 0) {
    stats[2 * gi] = g.stat0;
    stats[2 * gi + 1] = g.stat1;
  }
  uint8_t* out = codes + row * s.row_bytes;
#pragma unroll
  for (int p = 0; p < kMaxPairsPerLane; ++p) {
    const int64_t k = 2 * (lane + 32 * p);
    if (k >= n) break;
    uint32_t q[2] = {0u, 0u};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (k + e < n) {
        const float u = stochastic ? hash_uniform(seed, static_cast<uint64_t>(base + k + e)) : 0.5f;
        q[e] = quantize_value(v[2 * p + e], g, u, kQmax);
      }
    }
    if constexpr (kBits == 8) {
      out[start + k] = static_cast<uint8_t>(q[0]);
      if (k + 1 < n) out[start + k + 1] = static_cast<uint8_t>(q[1]);
    } else {
      out[(start + k) / 2] = static_cast<uint8_t>(q[0] | (q[1] << 4));
    }
  }
}

template <class T, int kBits>
__global__ void __launch_bounds__(kQuantThreads)
    dequantize_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ stats, T* __restrict__ out,
                      QuantShape s) {
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (gi >= s.total_groups) return;
  const int lane = threadIdx.x % 32;
  const int64_t row = gi / s.groups_per_row;
  const int64_t start = (gi % s.groups_per_row) * s.group_size;
  const int64_t n = min(s.group_size, s.last_dim - start);
  const DequantGroup d = dequant_group(stats[2 * gi], stats[2 * gi + 1], (1 << kBits) - 1);
  const uint8_t* in = codes + row * s.row_bytes;
  T* y = out + row * s.last_dim + start;
  for (int64_t k = 2 * lane; k < n; k += 64) {
    uint32_t q0, q1;
    if constexpr (kBits == 8) {
      q0 = in[start + k];
      q1 = k + 1 < n ? in[start + k + 1] : 0u;
    } else {
      const uint32_t b = in[(start + k) / 2];
      q0 = b & 0xfu;
      q1 = b >> 4;
    }
    from_float(y + k, dequantize_value(q0, d));
    if (k + 1 < n) from_float(y + k + 1, dequantize_value(q1, d));
  }
}

QuantShape make_shape(const QuantLayout& l, int64_t group_size) {
  return {l.last_dim, group_size, l.groups_per_row, l.row_bytes, l.rows * l.groups_per_row};
}

int64_t num_blocks(int64_t total_groups) { return (total_groups + kWarpsPerBlock - 1) / kWarpsPerBlock; }

std::tuple<at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, int64_t bits, int64_t group_size,
                                                 int64_t seed, bool stochastic) {
  check_quantize_args(x, bits, group_size);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t last_dim = x.dim() == 0 ? 1 : x.size(-1);
  const QuantLayout l = quant_layout(x.numel(), last_dim, bits, group_size);
  at::Tensor codes = at::empty({l.rows, l.row_bytes}, x.options().dtype(at::kByte));
  at::Tensor stats = at::empty({l.rows, l.groups_per_row, 2}, x.options().dtype(at::kFloat));
  const QuantShape s = make_shape(l, group_size);
  if (s.total_groups == 0) return {codes, stats};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_dtype(x.scalar_type(), "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = static_cast<const T*>(x.data_ptr());
    if (bits == 8) {
      quantize_kernel<T, 8><<<num_blocks(s.total_groups), kQuantThreads, 0, stream>>>(
          xp, codes.data_ptr<uint8_t>(), stats.data_ptr<float>(), s, static_cast<uint64_t>(seed), stochastic);
    } else {
      quantize_kernel<T, 4><<<num_blocks(s.total_groups), kQuantThreads, 0, stream>>>(
          xp, codes.data_ptr<uint8_t>(), stats.data_ptr<float>(), s, static_cast<uint64_t>(seed), stochastic);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {codes, stats};
}

at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                           int64_t last_dim, at::ScalarType dtype) {
  check_dequantize_args(codes, stats, bits, group_size, last_dim, dtype);
  const c10::cuda::CUDAGuard guard(codes.device());
  const QuantLayout l = quant_layout(codes.size(0) * last_dim, last_dim, bits, group_size);
  at::Tensor out = at::empty({l.rows, last_dim}, codes.options().dtype(dtype));
  const QuantShape s = make_shape(l, group_size);
  if (s.total_groups == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_dtype(dtype, "dtype", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* op = static_cast<T*>(out.data_ptr());
    if (bits == 8) {
      dequantize_kernel<T, 8><<<num_blocks(s.total_groups), kQuantThreads, 0, stream>>>(
          codes.data_ptr<uint8_t>(), stats.data_ptr<float>(), op, s);
    } else {
      dequantize_kernel<T, 4><<<num_blocks(s.total_groups), kQuantThreads, 0, stream>>>(
          codes.data_ptr<uint8_t>(), stats.data_ptr<float>(), op, s);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CUDA, m) {
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize", &dequantize_cuda);
}

}  // namespace effmem::cuda
