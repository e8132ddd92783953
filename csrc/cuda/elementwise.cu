// CUDA implementations of the "fast" activation policy's elementwise ops (the math of
// common/swiglu_math.h and common/rms_norm_math.h, the CPU kernels' bits):
//   effmem::swiglu, effmem::swiglu_backward: flat over the elements, 16 bytes of each tensor per thread
//     and iteration where every pointer is 16-byte aligned, element by element otherwise and for the tail;
//   effmem::rms_norm_apply: a block per row (grid-stride over rows), 16 bytes per thread and iteration
//     where rows and weight allow it.
// One translation unit: each .cu file costs the build a minute of nvcc over torch's headers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "common/checks.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/elementwise_kernel.cuh"
#include "engine/delay_correction.h"

namespace effmem::cuda {
namespace {

at::Tensor swiglu_cuda(const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_swiglu_args(nullptr, gate_in, up_in);
  const c10::cuda::CUDAGuard guard(gate_in.device());
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor out = at::empty_like(gate, at::MemoryFormat::Contiguous);
  const int64_t n = gate.numel();
  if (n == 0) return out;
  dispatch_float_dtype(gate.scalar_type(), "gate", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* g = static_cast<const T*>(gate.data_ptr());
    const T* u = static_cast<const T*>(up.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    swiglu_kernel<T><<<blocks_for<T>(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        g, u, o, n, all_aligned(g, u, o));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_in, const at::Tensor& gate_in,
                                                        const at::Tensor& up_in) {
  check_swiglu_args(&grad_in, gate_in, up_in);
  const c10::cuda::CUDAGuard guard(gate_in.device());
  const at::Tensor grad = grad_in.contiguous(), gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor dgate = at::empty_like(gate, at::MemoryFormat::Contiguous);
  at::Tensor dup = at::empty_like(gate, at::MemoryFormat::Contiguous);
  const int64_t n = gate.numel();
  if (n == 0) return {dgate, dup};
  dispatch_float_dtype(gate.scalar_type(), "gate", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* dy = static_cast<const T*>(grad.data_ptr());
    const T* g = static_cast<const T*>(gate.data_ptr());
    const T* u = static_cast<const T*>(up.data_ptr());
    T* dg = static_cast<T*>(dgate.data_ptr());
    T* du = static_cast<T*>(dup.data_ptr());
    swiglu_backward_kernel<T><<<blocks_for<T>(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dy, g, u, dg, du, n, all_aligned(dy, g, u, dg, du));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {dgate, dup};
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

void launch_delay_correction(void* w, const void* r, const void* g, int64_t n, at::ScalarType dtype,
                             const DelayCorrection& c, CUstream_st* stream) {
  if (n == 0) return;
  dispatch_float_dtype(dtype, "params", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* wp = static_cast<T*>(w);
    const DelayR<T>* rp = static_cast<const DelayR<T>*>(r);
    const T* gp = static_cast<const T*>(g);
    delay_correction_kernel<T><<<blocks_for<T>(n), kThreads, 0, stream>>>(wp, rp, gp, n, c,
                                                                          all_aligned(wp, rp, gp));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

TORCH_LIBRARY_IMPL(effmem, CUDA, m) {
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
  m.impl("rms_norm_apply", &rms_norm_apply_cuda);
}

}  // namespace effmem::cuda
