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
#include "common/rms_norm_math.h"
#include "common/swiglu_math.h"
#include "cuda/dtype_dispatch.cuh"
#include "engine/delay_correction.h"

namespace effmem::cuda {
namespace {

// 16 bytes of a storage type: one load or store instruction
template <class T>
struct alignas(16) Vec {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

template <class... Ptr>
bool all_aligned(Ptr... p) {
  return ((reinterpret_cast<uintptr_t>(p) % 16 == 0) && ...);
}

constexpr int kThreads = 256;

// vec_op(i) for the first index i of every whole 16-byte pack where `vec` (all pointers aligned), then
// one_op(i) for each element left (all of them otherwise), grid-stride.
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

// OffloadAdam's delay_correction: w = delay_correct(w, r, g), on the engine's upload stream.
// r is DelayR<T>: T, or bf16 for float16 weights (the same width, so one pack of each per iteration).
template <class T>
__global__ void __launch_bounds__(kThreads)
    delay_correction_kernel(T* w, const DelayR<T>* r, const T* g, int64_t n, DelayCorrection c, bool vec) {
  using R = DelayR<T>;
  static_assert(sizeof(R) == sizeof(T));
  each<T>(
      n, vec,
      [&](int64_t i) {
        Vec<T> wv = *reinterpret_cast<const Vec<T>*>(w + i);
        const Vec<R> rv = *reinterpret_cast<const Vec<R>*>(r + i);
        const Vec<T> gv = *reinterpret_cast<const Vec<T>*>(g + i);
#pragma unroll
        for (int k = 0; k < Vec<T>::kN; ++k) {
          store_float(&wv.v[k], round_to<T>(delay_correct(load_as_float(&wv.v[k]), load_as_float(&rv.v[k]),
                                                          load_as_float(&gv.v[k]), c)));
        }
        *reinterpret_cast<Vec<T>*>(w + i) = wv;
      },
      [&](int64_t i) {
        store_float(w + i, round_to<T>(delay_correct(load_as_float(w + i), load_as_float(r + i),
                                                     load_as_float(g + i), c)));
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
