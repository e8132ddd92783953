// CUDA implementation of effmem::l2norm.
//   pass 1 (multi-tensor): partial[chunk] = sum over the chunk of x^2, in float
//   pass 2 (one block):    out = sqrt(sum over chunks of partial), in double
// Both passes sum in a fixed order, so the result is deterministic; nothing is
// read back to the host.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "common/checks.h"
#include "cuda/adam_kernel.cuh"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/multi_tensor.cuh"

namespace effmem::cuda {
namespace {

constexpr int kNormThreads = 512;
using NormTable = TensorTable<1, 128>;

template <class T>
__device__ T block_sum(T x) {
  __shared__ T warp_sums[kNormThreads / 32];
  for (int off = 16; off > 0; off /= 2) x += __shfl_down_sync(0xffffffffu, x, off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  x = threadIdx.x < kNormThreads / 32 ? warp_sums[threadIdx.x] : T(0);
  if (warp == 0) {
    for (int off = 16; off > 0; off /= 2) x += __shfl_down_sync(0xffffffffu, x, off);
  }
  return x;  // valid in thread 0
}

template <class T>
__global__ void __launch_bounds__(kNormThreads) sumsq_kernel(NormTable table, float* partial) {
  int slot;
  int64_t chunk;
  table.locate(blockIdx.x, &slot, &chunk);
  const int64_t start = chunk * kChunk;
  const int64_t n = min(kChunk, table.numel[slot] - start);
  const T* x = static_cast<const T*>(table.ptr[0][slot]) + start;
  float acc = 0.0f;
  if (vec_aligned<T>(x)) {
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kVec; i < n; i += kNormThreads * kVec) {
      if (i + kVec <= n) {
        const Pack<T> p = *reinterpret_cast<const Pack<T>*>(x + i);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float f = to_float(p.v[k]);
          acc += f * f;
        }
      } else {
        for (int64_t j = i; j < n; ++j) acc += to_float(x[j]) * to_float(x[j]);
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < n; j += kNormThreads) acc += to_float(x[j]) * to_float(x[j]);
  }
  const float total = block_sum(acc);
  if (threadIdx.x == 0) partial[table.first_block + blockIdx.x] = total;
}

__global__ void __launch_bounds__(kNormThreads) finish_kernel(const float* partial, int64_t n, float* out) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kNormThreads) acc += partial[i];
  const double total = block_sum(acc);
  if (threadIdx.x == 0) *out = static_cast<float>(sqrt(total));
}

at::Tensor l2norm_cuda(at::TensorList tensors) {
  check_norm_args(tensors);
  TORCH_CHECK_VALUE(!tensors.empty(), "tensors must not be empty");
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto options = tensors[0].options().dtype(at::kFloat);
  at::Tensor out = at::empty({}, options);

  // One launch sequence per dtype; partial sums of all of them share a buffer.
  int64_t total_chunks = 0;
  for (const at::Tensor& t : tensors) total_chunks += (t.numel() + kChunk - 1) / kChunk;
  at::Tensor partial = at::empty({std::max<int64_t>(total_chunks, 1)}, options);
  float* partial_ptr = partial.data_ptr<float>();
  int64_t offset = 0;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    std::vector<std::vector<void*>> lists(1);
    std::vector<int64_t> numels;
    int64_t chunks = 0;
    for (const at::Tensor& t : tensors) {
      if (t.scalar_type() != dtype) continue;
      lists[0].push_back(t.data_ptr());
      numels.push_back(t.numel());
      chunks += (t.numel() + kChunk - 1) / kChunk;
    }
    if (chunks == 0) continue;
    dispatch_float_dtype(dtype, "tensors", [&](auto tag) {
      using T = typename decltype(tag)::type;
      for_each_launch<1, 128>(lists, numels, {}, [&](const NormTable& table, int blocks) {
        sumsq_kernel<T><<<blocks, kNormThreads, 0, stream>>>(table, partial_ptr + offset);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    offset += chunks;
  }
  finish_kernel<<<1, kNormThreads, 0, stream>>>(partial_ptr, offset, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CUDA, m) { m.impl("l2norm", &l2norm_cuda); }

}  // namespace effmem::cuda
