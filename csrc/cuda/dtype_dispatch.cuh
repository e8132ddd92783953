// Maps a torch dtype to the storage tag the kernels are templated on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "common/float_bits.h"

namespace effmem::cuda {

template <class T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<T>{}) with T = float, bf16_t or f16_t for dtype t.
template <class Fn>
void dispatch_float_dtype(at::ScalarType t, const char* arg, Fn&& fn) {
  switch (t) {
    case at::kFloat: return fn(Tag<float>{});
    case at::kBFloat16: return fn(Tag<bf16_t>{});
    case at::kHalf: return fn(Tag<f16_t>{});
    default: TORCH_CHECK_TYPE(false, arg, " must be float32, bfloat16 or float16, got ", t);
  }
}

}  // namespace effmem::cuda
