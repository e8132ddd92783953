// CUDA chunk work of the fused linear cross-entropy (driver in
// common/linear_ce.cpp, formulas in common/linear_ce_math.h). One block per
// token: the forward reads the token's chunk of logits twice (max, then the
// sum of exponentials, the target's logit and the plain sum) and merges them
// into the token's running log-sum-exp; the backward turns each logit into
// d loss / d logit in one pass. Nothing is read back to the host: a target
// outside [0, V) that is not ignore_index leaves the token's target logit
// NaN, so its loss is NaN rather than a device assert.
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

struct MaxOp {
  __device__ float operator()(float a, float b) const { return a > b ? a : b; }
};
struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};

__global__ void __launch_bounds__(kCeThreads)
    ce_forward_kernel(const float* __restrict__ z, int64_t len, int64_t v0, const int64_t* __restrict__ target,
                      float cap, bool need_sum, float* __restrict__ m, float* __restrict__ s,
                      float* __restrict__ c_target, float* __restrict__ c_sum) {
  const int64_t row = blockIdx.x;
  const float* zr = z + row * len;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < len; j += kCeThreads) {
    const float c = ce_softcap(zr[j], cap);
    mx = c > mx ? c : mx;
  }
  const float cmax = block_reduce(mx, MaxOp{}, -INFINITY);
  float se = 0.0f, sum = 0.0f;
  for (int64_t j = threadIdx.x; j < len; j += kCeThreads) {
    const float c = ce_softcap(zr[j], cap);
    se += expf(c - cmax);
    sum += c;
  }
  const float csum = block_reduce(se, SumOp{}, 0.0f);
  const float plain = need_sum ? block_reduce(sum, SumOp{}, 0.0f) : 0.0f;
  if (threadIdx.x == 0) {
    const OnlineLse merged = lse_merge(OnlineLse{m[row], s[row]}, cmax, csum);
    m[row] = merged.m;
    s[row] = merged.s;
    const int64_t local = target[row] - v0;
    if (local >= 0 && local < len) c_target[row] = ce_softcap(zr[local], cap);
    if (need_sum) c_sum[row] += plain;
  }
}

// z and dz may be one buffer (float32 gradients written over the logits): each thread reads its logit
// before it writes that element's gradient, so neither is __restrict__.
template <class T>
__global__ void __launch_bounds__(kCeThreads)
    ce_grad_kernel(const float* z, int64_t len, int64_t v0, const int64_t* __restrict__ target,
                   const float* __restrict__ lse, const float* __restrict__ g, float eps, float vocab, float cap,
                   T* dz) {
  const int64_t row = blockIdx.x;
  const float lse_r = lse[row], g_r = g[row];
  const int64_t t = target[row] - v0;
  for (int64_t j = threadIdx.x; j < len; j += kCeThreads) {
    const float c = ce_softcap(z[row * len + j], cap);
    from_float(dz + row * len + j, ce_logit_grad(c, lse_r, j == t, g_r, eps, vocab, cap));
  }
}

void forward_chunk(const at::Tensor& z, int64_t v0, const at::Tensor& target, double cap, bool need_sum,
                   CeState& st) {
  TORCH_INTERNAL_ASSERT(z.is_contiguous() && z.scalar_type() == at::kFloat);
  const int64_t rows = z.size(0), len = z.size(1);
  if (rows == 0) return;
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
