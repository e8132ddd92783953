// CUDA implementation of effmem::swiglu and effmem::swiglu_backward: the
// per-element math of common/swiglu_math.h (the CPU kernel's, bit for bit),
// 16 bytes of each tensor per thread and iteration where every pointer is
// 16-byte aligned, element by element otherwise and for the tail.
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
#include "common/swiglu_math.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/elementwise.cuh"

namespace effmem::cuda {
namespace {

constexpr int kThreads = 256;

// Applies op(i, k) to every element: the 16-byte path (op sees Vec loads) where `vec`, then the
// remainder one element at a time.
template <class T, class VecOp, class OneOp>
__device__ __forceinline__ void each(int64_t n, bool vec, VecOp vec_op, OneOp one_op) {
  constexpr int kN = Vec<T>::kN;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t first = 0;
  if (vec) {
    const int64_t packs = n / kN;
    for (int64_t p = thread; p < packs; p += threads) vec_op(p * kN);
    first = packs * kN;
  }
  for (int64_t i = first + thread; i < n; i += threads) one_op(i);
}

template <class T>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const T* g, const T* u, T* o, int64_t n, bool vec) {
  each<T>(
      n, vec,
      [&](int64_t i) {
        const Vec<T> gv = *reinterpret_cast<const Vec<T>*>(g + i);
        const Vec<T> uv = *reinterpret_cast<const Vec<T>*>(u + i);
        Vec<T> ov;
#pragma unroll
        for (int k = 0; k < Vec<T>::kN; ++k) {
          store_float(&ov.v[k], swiglu_value<T>(load_as_float(&gv.v[k]), load_as_float(&uv.v[k])));
        }
        *reinterpret_cast<Vec<T>*>(o + i) = ov;
      },
      [&](int64_t i) { store_float(o + i, swiglu_value<T>(load_as_float(g + i), load_as_float(u + i))); });
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n, bool vec) {
  each<T>(
      n, vec,
      [&](int64_t i) {
        const Vec<T> yv = *reinterpret_cast<const Vec<T>*>(dy + i);
        const Vec<T> gv = *reinterpret_cast<const Vec<T>*>(g + i);
        const Vec<T> uv = *reinterpret_cast<const Vec<T>*>(u + i);
        Vec<T> a, b;
#pragma unroll
        for (int k = 0; k < Vec<T>::kN; ++k) {
          float x, y;
          swiglu_grads<T>(load_as_float(&yv.v[k]), load_as_float(&gv.v[k]), load_as_float(&uv.v[k]), &x, &y);
          store_float(&a.v[k], x);
          store_float(&b.v[k], y);
        }
        *reinterpret_cast<Vec<T>*>(dg + i) = a;
        *reinterpret_cast<Vec<T>*>(du + i) = b;
      },
      [&](int64_t i) {
        float x, y;
        swiglu_grads<T>(load_as_float(dy + i), load_as_float(g + i), load_as_float(u + i), &x, &y);
        store_float(dg + i, x);
        store_float(du + i, y);
      });
}

template <class T>
int blocks_for(int64_t n) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * Vec<T>::kN;
  return static_cast<int>(std::clamp<int64_t>((n + per_block - 1) / per_block, 1, 1 << 20));
}

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

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CUDA, m) {
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
}

}  // namespace effmem::cuda
