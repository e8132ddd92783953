// The "fast" policy's elementwise CUDA kernels and OffloadAdam's delay_correction (launched by
// csrc/cuda/elementwise.cu): no torch headers, so that tests/cuda_emulation compiles them as host C++ and runs
// them against the CPU kernels.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/delay_correction_math.h"
#include "common/rms_norm_math.h"
#include "common/swiglu_math.h"

namespace effmem::cuda {

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

}  // namespace effmem::cuda
