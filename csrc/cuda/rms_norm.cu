// CUDA implementation of effmem::rms_norm_apply (common/rms_norm_math.h, the CPU kernel's bits): a block
// per row (grid-stride over rows), 16 bytes per thread and iteration where rows and weight allow it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "common/checks.h"
#include "common/rms_norm_math.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/elementwise.cuh"

namespace effmem::cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void __launch_bounds__(kThreads)
    rms_norm_apply_kernel(const T* x, const float* rstd, const T* w, T* y, int64_t rows, int64_t h, bool vec) {
  constexpr int kN = Vec<T>::kN;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float rs = rstd[r];
    const T* xr = x + r * h;
    T* yr = y + r * h;
    if (vec) {
      for (int64_t j = static_cast<int64_t>(threadIdx.x) * kN; j < h; j += kThreads * kN) {
        const Vec<T> xv = *reinterpret_cast<const Vec<T>*>(xr + j);
        const Vec<T> wv = *reinterpret_cast<const Vec<T>*>(w + j);
        Vec<T> yv;
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          store_float(&yv.v[k], rms_norm_value<T>(load_as_float(&xv.v[k]), rs, load_as_float(&wv.v[k])));
        }
        *reinterpret_cast<Vec<T>*>(yr + j) = yv;
      }
    } else {
      for (int64_t j = threadIdx.x; j < h; j += kThreads) {
        store_float(yr + j, rms_norm_value<T>(load_as_float(xr + j), rs, load_as_float(w + j)));
      }
    }
  }
}

at::Tensor rms_norm_apply_cuda(const at::Tensor& x_in, const at::Tensor& rstd_in, const at::Tensor& weight_in) {
  check_rms_norm_apply_args(x_in, rstd_in, weight_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), rstd = rstd_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return out;
  const int64_t h = x.size(-1), rows = x.numel() / h;
  dispatch_float_dtype(x.scalar_type(), "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(weight.data_ptr());
    T* yp = static_cast<T*>(out.data_ptr());
    // every row starts on a 16-byte boundary when the first does and a row is a whole number of packs
    const bool vec = h % Vec<T>::kN == 0 && all_aligned(xp, wp, yp);
    const int blocks = static_cast<int>(std::min<int64_t>(rows, 1 << 20));
    rms_norm_apply_kernel<T><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        xp, rstd.data_ptr<float>(), wp, yp, rows, h, vec);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CUDA, m) { m.impl("rms_norm_apply", &rms_norm_apply_cuda); }

}  // namespace effmem::cuda
