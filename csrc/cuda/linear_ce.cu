// CUDA chunk work of the fused linear cross-entropy (driver in
// common/linear_ce.cpp, formulas in common/linear_ce_math.h). One block per
// token: the forward reads the token's chunk of logits once (a running max and
// sum of exponentials per thread, the target's logit and the plain sum) and
// merges them into the token's running log-sum-exp; the backward turns each
// logit into d loss / d logit in one pass. Nothing is read back to the host: a target
// outside [0, V) that is not ignore_index leaves the token's target logit
// NaN, so its loss is NaN rather than a device assert.
#include <limits>

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/linear_ce.h"
#include "common/linear_ce_math.h"
#include "cuda/adam_kernel.cuh"
#include "cuda/dtype_dispatch.cuh"

namespace effmem::cuda {
namespace {

constexpr int kCeThreads = 256;

template <class Op>
__device__ float block_reduce(float x, Op op, float identity) {
  __shared__ float partial[kCeThreads / 32];
  for (int off = 16; off > 0; off /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, off));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // partial may still be read by a previous reduction
  if (lane == 0) partial[warp] = x;
  __syncthreads();
  x = lane < kCeThreads / 32 ? partial[lane] : identity;
  for (int off = 16; off > 0; off /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;  // in every thread
}

struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// Adds logit c to a thread's running (max m, sum s of exp(c - m)): one exp per logit. A -inf logit adds
// nothing; a NaN one makes m and s NaN, so the token's loss is NaN, as torch's.
__device__ __forceinline__ void lse_add(float c, float& m, float& s) {
  if (c > m) {
    s = s * expf(m - c) + 1.0f;  // m = -inf at first: s is 0 then
    m = c;
  } else if (c != -INFINITY) {
    s += expf(c - m);
    if (c != c) m = c;
  }
}

// Rows of a multiple of 4 logits are read 16 bytes at a time (at::empty's rows are then 16-byte aligned).
__device__ __forceinline__ bool rows_of_float4(const float* z, int64_t len) {
  return len % 4 == 0 && reinterpret_cast<uintptr_t>(z) % 16 == 0;
}

// Calls f(j, z[j]) for each logit j of a row, spread over the block's threads.
template <class F>
__device__ __forceinline__ void for_each_logit(const float* zr, int64_t len, bool vec, F f) {
  if (vec) {
    const float4* z4 = reinterpret_cast<const float4*>(zr);
    for (int64_t q = threadIdx.x; q < len / 4; q += kCeThreads) {
      const float4 v = z4[q];
      f(4 * q, v.x);
      f(4 * q + 1, v.y);
      f(4 * q + 2, v.z);
      f(4 * q + 3, v.w);
    }
  } else {
    for (int64_t j = threadIdx.x; j < len; j += kCeThreads) f(j, zr[j]);
  }
}

// One pass over the token's chunk: each thread's running (max, sum of exp), merged over the block, then
// into the token's running log-sum-exp.
__global__ void __launch_bounds__(kCeThreads)
    ce_forward_kernel(const float* __restrict__ z, int64_t len, int64_t v0, const int64_t* __restrict__ target,
                      float cap, bool need_sum, float* __restrict__ m, float* __restrict__ s,
                      float* __restrict__ c_target, float* __restrict__ c_sum) {
  const int64_t row = blockIdx.x;
  const float* zr = z + row * len;
  float tm = -INFINITY, ts = 0.0f, sum = 0.0f;
  for_each_logit(zr, len, rows_of_float4(z, len), [&](int64_t, float zj) {
    const float c = ce_softcap(zj, cap);
    lse_add(c, tm, ts);
    sum += c;
  });
  // the block's (max, sum): merged pairwise, a warp with shuffles, then the warps through shared memory
  __shared__ float pm[kCeThreads / 32], ps[kCeThreads / 32];
  for (int off = 16; off > 0; off /= 2) {
    const float om = __shfl_xor_sync(0xffffffffu, tm, off), os = __shfl_xor_sync(0xffffffffu, ts, off);
    const OnlineLse merged = lse_merge(OnlineLse{tm, ts}, om, os);
    tm = merged.m;
    ts = merged.s;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    pm[warp] = tm;
    ps[warp] = ts;
  }
  const float plain = need_sum ? block_reduce(sum, SumOp{}, 0.0f) : 0.0f;  // synchronises the block
  __syncthreads();
  if (threadIdx.x == 0) {
    OnlineLse merged{m[row], s[row]};
    for (int w = 0; w < kCeThreads / 32; ++w) merged = lse_merge(merged, pm[w], ps[w]);
    m[row] = merged.m;
    s[row] = merged.s;
    const int64_t local = target[row] - v0;
    if (local >= 0 && local < len) c_target[row] = ce_softcap(zr[local], cap);
    if (need_sum) c_sum[row] += plain;
  }
}

// z and dz may be one buffer (float32 gradients written over the logits): each thread reads its logits
// before it writes those elements' gradients, so neither is __restrict__.
template <class T>
__global__ void __launch_bounds__(kCeThreads)
    ce_grad_kernel(const float* z, int64_t len, int64_t v0, const int64_t* __restrict__ target,
                   const float* __restrict__ lse, const float* __restrict__ g, float eps, float vocab, float cap,
                   T* dz) {
  const int64_t row = blockIdx.x;
  const float lse_r = lse[row], g_r = g[row];
  const int64_t t = target[row] - v0;
  T* out = dz + row * len;
  for_each_logit(z + row * len, len, rows_of_float4(z, len), [&](int64_t j, float zj) {
    const float c = ce_softcap(zj, cap);
    from_float(out + j, ce_logit_grad(c, lse_r, j == t, g_r, eps, vocab, cap));
  });
}

// One block per row: gridDim.x stops at 2^31 - 1, and a larger count narrowed silently.
void check_grid_rows(int64_t rows) {
  TORCH_CHECK_VALUE(rows <= std::numeric_limits<int32_t>::max(), "linear_cross_entropy: ", rows,
                    " tokens in one chunk; at most 2^31 - 1 on CUDA");
}

void forward_chunk(const at::Tensor& z, int64_t v0, const at::Tensor& target, double cap, bool need_sum,
                   CeState& st) {
  TORCH_INTERNAL_ASSERT(z.is_contiguous() && z.scalar_type() == at::kFloat);
  const int64_t rows = z.size(0), len = z.size(1);
  if (rows == 0) return;
  check_grid_rows(rows);
  const c10::cuda::CUDAGuard guard(z.device());
  ce_forward_kernel<<<rows, kCeThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      z.data_ptr<float>(), len, v0, target.data_ptr<int64_t>(), static_cast<float>(cap), need_sum,
      st.m.data_ptr<float>(), st.s.data_ptr<float>(), st.c_target.data_ptr<float>(), st.c_sum.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// dz: [rows, len] of the gradient's dtype; z itself where that is float32.
void launch_grad(const at::Tensor& z, int64_t v0, const at::Tensor& target, const at::Tensor& lse,
                 const at::Tensor& g, double eps, int64_t vocab, double cap, const at::Tensor& dz) {
  TORCH_INTERNAL_ASSERT(z.is_contiguous() && z.scalar_type() == at::kFloat && dz.is_contiguous());
  const int64_t rows = z.size(0), len = z.size(1);
  if (rows == 0) return;
  check_grid_rows(rows);
  const c10::cuda::CUDAGuard guard(z.device());
  dispatch_float_dtype(dz.scalar_type(), "hidden", [&](auto tag) {
    using T = typename decltype(tag)::type;
    ce_grad_kernel<T><<<rows, kCeThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        z.data_ptr<float>(), len, v0, target.data_ptr<int64_t>(), lse.data_ptr<float>(), g.data_ptr<float>(),
        static_cast<float>(eps), static_cast<float>(vocab), static_cast<float>(cap),
        static_cast<T*>(dz.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor grad_chunk(const at::Tensor& z, int64_t v0, const at::Tensor& target, const at::Tensor& lse,
                      const at::Tensor& g, double eps, int64_t vocab, double cap, at::ScalarType dtype) {
  at::Tensor dz = at::empty(z.sizes(), z.options().dtype(dtype));
  launch_grad(z, v0, target, lse, g, eps, vocab, cap, dz);
  return dz;
}

// Whole rows: the forward kernel (which leaves z as it is), then the gradient from the rows' log-sum-exp.
at::Tensor rows_chunk(const at::Tensor& z, const at::Tensor& target, const at::Tensor& g, double eps, double cap,
                      bool need_sum, CeState& st, at::ScalarType dtype) {
  forward_chunk(z, 0, target, cap, need_sum, st);
  const at::Tensor dz = dtype == at::kFloat ? z : at::empty(z.sizes(), z.options().dtype(dtype));
  launch_grad(z, 0, target, st.m + st.s.log(), g, eps, z.size(1), cap, dz);
  return dz;
}

const CeChunkKernels kCudaKernels{&forward_chunk, &grad_chunk, &rows_chunk};

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias, const at::Tensor& target,
                                                int64_t ignore_index, double label_smoothing, double softcap,
                                                int64_t vocab_chunk) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return linear_ce_forward_impl(hidden, weight, bias, target.contiguous(), ignore_index, label_smoothing, softcap,
                                vocab_chunk, kCudaKernels);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
    double label_smoothing, double softcap, int64_t vocab_chunk, std::array<bool, 3> output_mask) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return linear_ce_backward_impl(grad_loss, hidden, weight, bias, target.contiguous(), lse.contiguous(),
                                 ignore_index, label_smoothing, softcap, vocab_chunk, output_mask, kCudaKernels);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_backward_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const at::Tensor& g, int64_t ignore_index, double label_smoothing, double softcap,
    int64_t token_chunk, std::array<bool, 3> output_mask) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return linear_ce_forward_backward_impl(hidden, weight, bias, target.contiguous(), g.contiguous(), ignore_index,
                                         label_smoothing, softcap, token_chunk, output_mask, kCudaKernels);
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CUDA, m) {
  m.impl("linear_ce_forward", &forward_cuda);
  m.impl("linear_ce_backward", &backward_cuda);
  m.impl("linear_ce_forward_backward", &forward_backward_cuda);
}

}  // namespace effmem::cuda
